"""A module graph: the modules of an experiment, each of a kind under its own layout, and the edges that
carry tensors between them. Built and checked by ``hetero.graph.build.build_graph``; pure data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hetero.config import ModuleConfig
from hetero.kinds.registry import Kind
from hetero.parallel.sharding import Sharding
from hetero.parallel.compression.edge_config import EdgeCompressionConfig
from hetero.parallel.layout import Layout
from hetero.parallel.placement import Placement


@dataclass(frozen=True)
class Node:
    """One module: its kind, typed model config, layout and settings (``parallel``, ``optim``, ...)."""

    name: str
    index: int  # declaration order: the module's weights are drawn from seed + index
    kind: Kind
    config: Any
    layout: Layout
    settings: ModuleConfig
    trains: bool = True  # some parameter of it is trained (``trainable`` and not every one ``frozen``)

    @property
    def options(self):
        return self.settings.parallel


@dataclass(frozen=True)
class Edge:
    """Rows of ``src``'s output ``output`` cross into ``dst``'s input ``input``: per row a
    ``(tokens, width)`` tensor; into placeholders it lands at ``offset`` of the destination's sequence.
    The rows it carries are those both modules process; ``source`` and ``destination`` say how each end
    lays the tensor out (rows over DP, tokens over CP and SP where the module splits its sequence).
    A ``routed`` edge carries items' tokens (images, as many as the source's ``Kind.item_tokens`` gives
    each) to their own placeholders in the destination's rows (``hetero.parallel.token_route``);
    ``tokens`` is 0 and the destination's window is its whole sequence."""

    index: int
    src: str
    dst: str
    output: str
    input: str
    tokens: int
    width: int
    placeholders: bool
    offset: int
    compression: EdgeCompressionConfig
    source: Sharding
    destination: Sharding
    routed: bool = False

    @property
    def name(self) -> str:
        return f"{self.src}->{self.dst}"


@dataclass(frozen=True)
class Graph:
    nodes: dict[str, Node]
    edges: tuple[Edge, ...]
    order: tuple[str, ...]  # every module after the modules that feed it
    placement: Placement
    schedule: str  # phased | graph_1f1b

    def in_edges(self, name: str) -> list[Edge]:
        return [e for e in self.edges if e.dst == name]

    def out_edges(self, name: str) -> list[Edge]:
        return [e for e in self.edges if e.src == name]

    def is_sink(self, name: str) -> bool:
        return not self.out_edges(name)

    def backward(self, name: str) -> bool:
        """Whether module ``name`` runs backward in training: it trains, or a module it reads from does
        (then it passes its inputs' gradients back, frozen or not)."""
        return self.nodes[name].trains or any(self.backward(e.src) for e in self.in_edges(name))

    def training(self, name: str) -> str:
        """What training runs of module ``name``: ``trained``; ``frozen, input gradients`` (it passes
        gradients back to a trained module it reads from); ``frozen, forward only`` (and ``, N microbatches
        ahead`` under ``parallel.forward_ahead``)."""
        if self.nodes[name].trains:
            return "trained"
        if self.backward(name):
            return "frozen, input gradients"
        ahead = self.nodes[name].options.forward_ahead
        return "frozen, forward only" + (f", {ahead} microbatches ahead" if ahead else "")

    def depth_after(self, name: str) -> int:
        """Pipeline stages on the longest path from ``name``'s last stage to a sink (its own excluded)."""
        return max((self.nodes[e.dst].layout.pp + self.depth_after(e.dst) for e in self.out_edges(name)), default=0)
