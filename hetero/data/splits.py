"""A job's splits: ``train.data`` checked, opened, prepared and loaded through its format
(``hetero.data.sources``), one source or a mixture of several (``hetero.data.mixture``).

``check`` and ``open`` run before any rank starts (``hetero layout``, ``hetero train``): the first from
the config alone, the second reading each source's first samples. ``prepare`` writes what built-in
datasets need on one process; ``load_splits`` gives every rank the same global batches.
"""

from __future__ import annotations

import torch.distributed as dist

from hetero.config import ExperimentConfig
from hetero.data.mixture import mixture_batches, mixture_errors
from hetero.data.sources.format import Batches
from hetero.data.sources.registry import data_format
from hetero.errors import ConfigError
from hetero.graph.graph import Graph


def check(experiment: ExperimentConfig, graph: Graph) -> None:
    """Refuse, from the config alone, data that is unknown or cannot feed the graph's modules."""
    data = experiment.train.data
    problems = mixture_errors(experiment, graph) if data.mixture else []
    if problems:
        raise ConfigError("; ".join(problems))
    for source in data.sources():
        data_format(source.format).check(experiment, graph, source)


def open_sources(experiment: ExperimentConfig, graph: Graph) -> None:
    """``check``, then open each source and parse its first samples (a wrong path or format stops here)."""
    check(experiment, graph)
    for source in experiment.train.data.sources():
        data_format(source.format).open(experiment, graph, source)


def prepare(experiment: ExperimentConfig, graph: Graph) -> None:
    """Write what the data needs on disk, on one process (``hetero train`` before it launches the ranks,
    rank 0 before the job's barrier)."""
    for source in experiment.train.data.sources():
        data_format(source.format).prepare(experiment, graph, source)


def load(experiment: ExperimentConfig, graph: Graph, split: str) -> Batches:
    """The global batches of ``split`` (train | heldout); what ``prepare`` writes must exist."""
    data = experiment.train.data
    if data.mixture:
        return mixture_batches(experiment, graph, split)
    source = data.sources()[0]
    return data_format(source.format).load(experiment, graph, source, split)


def load_splits(experiment: ExperimentConfig, graph: Graph, splits=("train", "heldout")) -> dict[str, Batches]:
    """Each split's batches; rank 0 prepares first (every rank calls this: it has a barrier)."""
    if dist.get_rank() == 0:
        prepare(experiment, graph)
    dist.barrier()
    return {split: load(experiment, graph, split) for split in splits}
