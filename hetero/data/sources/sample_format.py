"""A data format of samples (``hetero.data.samples``): users' files, shaped into rows by one collation
step (``hetero.data.collate``) and ordered by ``hetero.data.sample_batches``.

A subclass says how to open its files as a ``SampleSource`` (``source``); the held-out split is
``train.data.heldout_path`` opened the same way, or every ``heldout_every``-th sample of the source.
"""

from __future__ import annotations

from hetero.config import ExperimentConfig
from hetero.data.collate import SampleSkipped, Shaper
from hetero.data.config import SourceConfig
from hetero.data.sample_batches import SampleBatches
from hetero.data.sample_index import SampleIndex, sample_index
from hetero.data.samples import SampleError, SampleSource, split_of
from hetero.data.sources.format import DataFormat
from hetero.errors import ConfigError
from hetero.graph.graph import Graph

OPENED_SAMPLES = 4  # what ``open`` parses, tokenizes and decodes before any rank starts


class Samples:
    """What a format that serves samples by id gives a mixture (``hetero.data.mixture``): a split's
    samples, their index, and the shaper that makes them rows."""

    def split(self, experiment: ExperimentConfig, config: SourceConfig, split: str) -> SampleSource:
        raise NotImplementedError

    def shaper(self, experiment: ExperimentConfig, graph: Graph) -> Shaper:
        data = experiment.train.data
        return Shaper(graph, data.image_token, data.too_long)

    def index(self, experiment: ExperimentConfig, source: SourceConfig, samples: SampleSource, shaper: Shaper,
              split: str) -> SampleIndex:
        """The index of a split's samples (``hetero.data.sample_index``), from its file or built and kept."""
        data = experiment.train.data
        reader = f"{source.format}|{split}|{data.heldout_every}|{data.heldout_path}|{data.caption_prompt}"
        return sample_index(samples, shaper.tokenizer, reader, shaper.videos)

    def index_splits(self, experiment: ExperimentConfig, graph: Graph, source: SourceConfig) -> None:
        """Index both splits, once, before the ranks read the indexes."""
        shaper = self.shaper(experiment, graph)
        for split in ("train", "heldout"):
            self.index(experiment, source, self.split(experiment, source, split), shaper, split)


class SampleFormat(Samples, DataFormat):
    def source(self, experiment: ExperimentConfig, config: SourceConfig, path: str) -> SampleSource:
        """The samples at ``path``; ``ConfigError`` naming the file when it cannot be opened."""
        raise NotImplementedError

    def split(self, experiment: ExperimentConfig, config: SourceConfig, split: str) -> SampleSource:
        data = experiment.train.data
        if config.path is None:
            raise ConfigError(f"train.data.format={config.format} reads your files: set train.data.path")
        if split == "heldout" and data.heldout_path is not None and not data.mixture:
            return self.source(experiment, config, data.heldout_path)
        try:
            return split_of(self.source(experiment, config, config.path), split, data.heldout_every)
        except SampleError as err:
            raise ConfigError(str(err)) from None

    def columns(self, experiment, graph, source) -> tuple[str, ...]:
        return self.shaper(experiment, graph).columns(experiment.train.data.pack)

    def open(self, experiment: ExperimentConfig, graph: Graph, source: SourceConfig) -> None:
        """Open the training split and shape its first samples (a bad one is refused unless skipped)."""
        samples, shaper = self.split(experiment, source, "train"), self.shaper(experiment, graph)
        for index in range(min(OPENED_SAMPLES, len(samples))):
            try:
                shaper.document(samples.sample(index))
            except SampleSkipped:
                pass
            except SampleError as err:
                if experiment.train.data.on_error != "skip":
                    raise ConfigError(f"{err} (train.data.on_error=skip skips bad samples)") from None

    def prepare(self, experiment: ExperimentConfig, graph: Graph, source: SourceConfig) -> None:
        self.index_splits(experiment, graph, source)

    def load(self, experiment, graph, source, split) -> SampleBatches:
        data, shaper = experiment.train.data, self.shaper(experiment, graph)
        samples = self.split(experiment, source, split)
        return SampleBatches([samples], [self.index(experiment, source, samples, shaper, split)], [1.0], shaper, split,
                             experiment.batch.global_batch_size, experiment.seed, data.on_error,
                             data.max_skip_fraction, data.pack)
