"""Several sources at once (``train.data.mixture``): samples of users' formats (and the digits, as
conversations) drawn by weight, in an order that depends only on the seed
(``hetero.data.sample_batches``)."""

from __future__ import annotations

from hetero.config import ExperimentConfig
from hetero.data.sample_batches import SampleBatches
from hetero.data.sources.registry import data_format, data_formats
from hetero.data.sources.sample_format import Samples
from hetero.graph.graph import Graph


def mixture_errors(experiment: ExperimentConfig, graph: Graph) -> list[str]:
    drawn = [name for name, fmt in data_formats().items() if isinstance(fmt, Samples)]
    return [f"train.data.mixture[{i}].format={source.format} gives whole batches, not samples; a mixture draws "
            f"the samples of {', '.join(drawn)}"
            for i, source in enumerate(experiment.train.data.mixture)
            if not isinstance(data_format(source.format), Samples)]


def mixture_batches(experiment: ExperimentConfig, graph: Graph, split: str) -> SampleBatches:
    """The mixture's batches of ``split``: each source's own split, drawn by its weight."""
    data = experiment.train.data
    formats = [data_format(source.format) for source in data.mixture]
    shaper = formats[0].shaper(experiment, graph)
    sources = [fmt.split(experiment, source, split) for fmt, source in zip(formats, data.mixture)]
    indexes = [fmt.index(experiment, source, samples, shaper, split)
               for fmt, source, samples in zip(formats, data.mixture, sources)]
    return SampleBatches(sources, indexes, [source.weight for source in data.mixture], shaper, split,
                         experiment.batch.global_batch_size, experiment.seed, data.on_error, data.max_skip_fraction,
                         data.pack)
