"""A graph edge on the wire: a ``Boundary`` from the source's last stage to the destination's first, and a
``CompressedBoundary`` beside it when the edge has a ``compression:`` block (training passes send through
it; evaluation sends fp32, so it measures the weights).

What crosses is ``(rows, tokens, width)``: the rows of a microbatch the edge carries, split over each
side's DP replicas as they own them (``StepRows.split``), tokens and width whole on every rank.

Gradients: a plain boundary sums what the destination's replicas of a shard hand in, and each replica
(e.g. a TP rank) holds the full gradient of its input, so each hands in its share (1/replicas). A
compressed edge copies instead of summing (payloads cannot be added): every replica hands in the full
gradient and the source gets it once. Build every edge on every rank, in the graph's edge order.
"""

from __future__ import annotations

import torch

from hetero.graph.graph import Edge, Graph
from hetero.parallel.boundary import Boundary, Rows, Sharding, Side, Transfer, TensorSpec
from hetero.parallel.compressed_boundary import CompressedBoundary

SPEC = TensorSpec(3, source=Sharding(batch_dim=0, seq_dim=None), destination=Sharding(batch_dim=0, seq_dim=None))


class RuntimeEdge:
    def __init__(self, edge: Edge, graph: Graph, timeout_s: float, async_sends: bool, device: torch.device):
        self.edge = edge
        source, destination = Side(graph.nodes[edge.src].layout), Side(graph.nodes[edge.dst].layout)
        common = dict(timeout_s=timeout_s, async_sends=async_sends, device=device)
        self.plain = Boundary(edge.name, source, destination, SPEC, **common)
        self.codec = (CompressedBoundary(edge.name, source, destination, SPEC, edge.width, edge.compression, **common)
                      if edge.compression.enabled else None)
        self.use_codec = False
        self._transfers: dict[int, Transfer] = {}

    @property
    def is_source(self) -> bool:
        return self.plain.is_source

    @property
    def is_destination(self) -> bool:
        return self.plain.is_destination

    def begin(self, training: bool, source_rows, destination_rows, fresh: bool, sample_ids) -> None:
        """A pass starts; a training pass through a codec keys its compensation by each side's rows."""
        self.use_codec = training and self.codec is not None
        if self.use_codec:
            self.codec.begin_step(source_rows, destination_rows, fresh, sample_ids)

    def shape(self, rows: int) -> tuple[int, int, int]:
        return (rows, self.edge.tokens, self.edge.width)

    def forward(self, m: int, x: torch.Tensor | None, rows: Rows) -> torch.Tensor | None:
        shape = self.shape(sum(rows.source))
        if self.use_codec:
            return self.codec.forward(m, x, shape, rows)
        transfer = self.plain.forward(x, shape, rows)
        self._transfers[m] = transfer
        return transfer.output

    def backward(self, m: int, grad: torch.Tensor | None, rows: Rows) -> torch.Tensor | None:
        """``grad``: the full gradient of the destination rank's input (None elsewhere)."""
        shape = self.shape(sum(rows.source))
        if self.use_codec:
            return self.codec.backward(m, grad, shape, rows)
        if grad is not None:
            grad = grad / self.plain.replicas(shape, rows)
        return self.plain.backward(self._transfers.pop(m), grad)

    def wait_sends(self) -> None:
        for link in (self.plain, self.codec):
            if link is not None:
                link.wait_sends()

    def sent_bytes(self) -> dict[str, int]:
        """Wire bytes this rank sent so far (cross-module and within replica groups), per direction."""
        totals = dict.fromkeys(("forward", "backward"), 0)
        for link in (self.plain, self.codec):
            for key, value in (link.counters() if link is not None else {}).items():
                direction, kind = key.split(".", 1)
                if kind in ("cross_sent_bytes", "intra_sent_bytes"):
                    totals[direction] += value
        return totals

    def ends(self) -> dict[str, object]:
        """This rank's compressed edge ends (their compensation state is checkpointed)."""
        if self.codec is None:
            return {}
        return {f"{self.edge.name}.upstream": self.codec.upstream, f"{self.edge.name}.downstream": self.codec.downstream}

    def memory_bytes(self) -> int:
        return self.codec.memory_bytes() if self.codec is not None else 0
