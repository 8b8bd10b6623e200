"""The contract of a data format: ``DataFormat`` and the ``Batches`` it loads (see ``hetero.data.sources``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from hetero.data.rank_batches import Reads
from hetero.errors import ConfigError

if TYPE_CHECKING:
    from hetero.config import ExperimentConfig
    from hetero.data.config import SourceConfig
    from hetero.graph.graph import Graph


class Batches(Protocol):
    """A split's global batches, the same on every rank; ``reads``: build only what that rank's modules
    read (``hetero.data.rank_batches``), None for the global batch."""

    global_batch_size: int

    def batch(self, step: int, reads: Reads | None = None) -> dict[str, torch.Tensor]: ...

    def ordered_batches(self, reads: Reads | None = None) -> list[dict[str, torch.Tensor]]: ...


class DataFormat:
    """A kind of data. ``check`` and ``open`` run before any rank starts (``hetero layout``, ``hetero
    train``): ``check`` from the config alone, ``open`` reading the first samples; ``prepare`` writes what
    a built-in dataset needs once, on one process; ``load`` gives a split's batches on every rank."""

    name: str = ""

    def columns(self, experiment: ExperimentConfig, graph: Graph, source: SourceConfig) -> tuple[str, ...]:
        """The columns its batches hold for this graph."""
        raise NotImplementedError

    def check(self, experiment: ExperimentConfig, graph: Graph, source: SourceConfig) -> None:
        """Refuse, from the config alone, data that cannot feed this graph (default: a module reads a
        column the batches lack)."""
        held = set(self.columns(experiment, graph, source))
        for node in graph.nodes.values():
            missing = [key for key in node.kind.data_keys(node.config) if key not in held]
            if missing:
                raise ConfigError(
                    f"train.data.format={source.format} gives the columns {', '.join(sorted(held))} but {node.name} "
                    f"(kind {node.kind.name}) reads {', '.join(missing)}; choose a format whose samples "
                    f"{node.name} can read"
                )

    def open(self, experiment: ExperimentConfig, graph: Graph, source: SourceConfig) -> None:
        """Open the source and parse its first samples, so a wrong path or format stops the job before any
        rank starts (default: nothing to open)."""

    def prepare(self, experiment: ExperimentConfig, graph: Graph, source: SourceConfig) -> None:
        """Write what the data needs on disk (default: nothing)."""

    def load(self, experiment: ExperimentConfig, graph: Graph, source: SourceConfig, split: str) -> Batches:
        raise NotImplementedError


