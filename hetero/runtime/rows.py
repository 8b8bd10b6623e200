"""Which rows of a global batch each module and each edge carries, per microbatch, and each DP replica's.

All of it is host-side bookkeeping (CPU tensors, made so explicitly). Microbatch ``m`` is rows ``[m·B/n, (m+1)·B/n)`` of the global batch. A module processes the rows whose
presence flag for its kind's modality (``has_<modality>``) is set, or every row; its DP replicas split
those rows into contiguous runs, earlier replicas taking the extra row. An edge carries the rows both its
modules process, in order, so each replica on either side holds one contiguous run of them. Every rank
holds the same bookkeeping (the batch's columns of one value per row and its images' places; a loader
may leave out the rows and pixels the rank's modules do not read, ``RankReads``,
``hetero.kinds.batch_rows``) and computes the same answer, so all agree on shapes and skipped calls.

A module whose kind works on items (images: the batch's ``image_*`` columns, one entry per image,
``image_row`` naming the row each belongs to) processes the items of the microbatch's rows instead, and
its DP replicas split them by cost (a native-resolution image's patches), not by count
(``balanced_split``): the most costly first, each onto the replica with the least so far. Items of one
cost (fixed-size images) split into contiguous runs as rows do, so an edge between two modules of
items carries them as rows, whatever each side's dp.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from hetero.graph.graph import Edge, Graph
from hetero.kinds.batch_rows import batch_size
from hetero.parallel.sharding import Rows, dp_rows


def balanced_split(costs: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """Indices of ``costs`` split into ``parts`` of near-equal total cost: the most costly first (earlier
    on ties), each onto the part with the least so far (the lower on ties); each part in ascending order."""
    loads, chosen = [0] * parts, [[] for _ in range(parts)]
    for index in sorted(range(len(costs)), key=lambda i: (-int(costs[i]), i)):
        part = min(range(parts), key=lambda p: (loads[p], p))
        loads[part] += int(costs[index])
        chosen[part].append(index)
    return [torch.tensor(sorted(c), dtype=torch.long, device="cpu") for c in chosen]


def item_split(costs: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """Indices of ``costs`` over ``parts`` replicas: contiguous runs (earlier parts taking the extra one)
    where every item costs the same, else ``balanced_split``."""
    if len(costs) == 0 or bool((costs == costs[0]).all()):
        every = torch.arange(len(costs), device="cpu")
        return [every[dp_rows(len(costs), part, parts)] for part in range(parts)]
    return balanced_split(costs, parts)


def presence(batch: dict[str, torch.Tensor], modality: str | None) -> torch.Tensor | None:
    """(B,) bool: the rows carrying ``modality``; None where every row does (no modality, or no flag)."""
    flag = batch.get(f"has_{modality}") if modality is not None else None
    return None if flag is None else flag.bool().cpu()


class StepRows:
    def __init__(self, graph: Graph, batch: dict[str, torch.Tensor], microbatches: int):
        size = batch_size(batch)
        if size % microbatches:
            raise ValueError(f"a global batch of {size} samples does not split into {microbatches} microbatches")
        self.graph, self.size, self.microbatches = graph, size, microbatches
        micro = size // microbatches
        self.spans = [slice(m * micro, (m + 1) * micro) for m in range(microbatches)]
        self.items = {name: node.kind.item_costs(node.config, batch) for name, node in graph.nodes.items()
                      if node.kind.per_item(node.config)}
        self.present = {name: presence(batch, node.kind.modality) for name, node in graph.nodes.items()
                        if name not in self.items}
        self._rows = {
            name: [torch.arange(span.start, span.stop, device="cpu") if flags is None
                   else span.start + torch.nonzero(flags[span]).flatten() for span in self.spans]
            for name, flags in self.present.items()
        }
        if self.items:
            owner = batch["image_row"].cpu()
            for name in self.items:
                self._rows[name] = [torch.nonzero((owner >= s.start) & (owner < s.stop)).flatten() for s in self.spans]
        self._memo: dict[tuple, object] = {}
        for edge in graph.edges:  # every rank refuses a row edge of items out of order before the step
            if not edge.routed and self.items.keys() & {edge.src, edge.dst}:
                for m in range(microbatches):
                    self.split(edge, m)

    def all(self, name: str) -> torch.Tensor:
        """Every global row (or item) module ``name`` processes in the batch."""
        if name in self.items:
            return torch.cat(self._rows[name])
        flags = self.present[name]
        return torch.arange(self.size, device="cpu") if flags is None else torch.nonzero(flags).flatten()

    def module(self, name: str, m: int) -> torch.Tensor:
        """The global rows (or items) module ``name`` processes in microbatch ``m``."""
        return self._rows[name][m]

    def local(self, name: str, m: int, dp_rank: int) -> torch.Tensor:
        """The rows (or items) DP replica ``dp_rank`` of module ``name`` takes in microbatch ``m``."""
        rows = self._rows[name][m]
        if name in self.items:
            key = ("items", name, m)
            if key not in self._memo:
                self._memo[key] = [rows[part] for part in item_split(self.items[name][rows],
                                                                     self.graph.nodes[name].layout.dp)]
            return self._memo[key][dp_rank]
        return rows[dp_rows(len(rows), dp_rank, self.graph.nodes[name].layout.dp)]

    def edge(self, edge: Edge, m: int) -> torch.Tensor:
        key = ("edge", edge.index, m)
        if key not in self._memo:
            src = self._rows[edge.src][m]
            self._memo[key] = src[torch.isin(src, self._rows[edge.dst][m])]
        return self._memo[key]

    def carried(self, edge: Edge, m: int, module: str, dp_rank: int) -> torch.Tensor:
        """The edge's rows (global) that ``module``'s replica ``dp_rank`` holds, in order."""
        local = self.local(module, m, dp_rank)
        return local[torch.isin(local, self.edge(edge, m))]

    def positions(self, edge: Edge, m: int, module: str, dp_rank: int) -> torch.Tensor:
        """Where the edge's rows sit among the local rows of ``module``'s replica ``dp_rank``."""
        return torch.nonzero(torch.isin(self.local(module, m, dp_rank), self.edge(edge, m))).flatten()

    def split(self, edge: Edge, m: int) -> Rows:
        """Each side's per-replica count of the edge's rows. A boundary takes each replica's rows as one
        contiguous run of the edge's, in order: a module of items whose replicas hold them otherwise (items
        of unequal costs) is refused."""
        key = ("split", edge.index, m)
        if key not in self._memo:
            def counts(module: str) -> tuple[int, ...]:
                held = [self.carried(edge, m, module, d) for d in range(self.graph.nodes[module].layout.dp)]
                if module in self.items and not torch.equal(torch.cat(held), self.edge(edge, m)):
                    raise ValueError(f"{edge.name}: {module}'s replicas split the edge's items by unequal costs, out "
                                     f"of order; a row edge carries items of one cost each (fixed-size images)")
                return tuple(len(h) for h in held)

            self._memo[key] = Rows(counts(edge.src), counts(edge.dst))
        return self._memo[key]


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch tensor on ``device``: to a GPU through pinned memory, without waiting for the copy."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def reads_of(node, available: Iterable[str]) -> tuple[str, ...]:
    """The batch columns module ``node`` reads in a batch with columns ``available``: its data keys, and
    the optional and evaluation ones the batch has."""
    kind, available = node.kind, tuple(available)
    return kind.data_keys(node.config) + kind.optional_keys(available) + kind.evaluation_keys(available)


@dataclass(frozen=True)
class RankReads:
    """What one rank's modules read of a batch, as global row and item numbers: for each module the rank
    holds, its replica's share in every microbatch, at every pipeline stage (each stage takes its replica's
    columns: the first the inputs, the last the labels). Rows for the modules reading per-row columns
    (tokens), items for the modules of items (images). A function of the batch's bookkeeping alone (its
    ``index`` and presence flags, ``image_row``, ``image_start``, ``image_grid``), so a loader can tell
    what to tokenize and what to decode before it does either."""

    graph: Graph
    microbatches: int
    replicas: tuple[tuple[str, int], ...]  # (module, the rank's DP coordinate in it)

    def __call__(self, batch: dict[str, torch.Tensor], available: Iterable[str] | None = None
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(the rows this rank reads of each per-row column, the items it reads), each ascending; a column
        no module here reads is absent. ``available``: the columns of the batch being built (default:
        ``batch``'s)."""
        plan = StepRows(self.graph, batch, self.microbatches)
        available = tuple(batch if available is None else available)
        rows: dict[str, list[torch.Tensor]] = {}
        items = []
        for name, dp in self.replicas:
            local = [plan.local(name, m, dp) for m in range(self.microbatches)]
            if name in plan.items:
                items.extend(local)
                continue
            for key in reads_of(self.graph.nodes[name], available):
                rows.setdefault(key, []).extend(local)
        none = torch.zeros(0, dtype=torch.long, device="cpu")
        return ({key: torch.unique(torch.cat(parts)) for key, parts in rows.items()},
                torch.unique(torch.cat(items)) if items else none)


def rank_reads(graph: Graph, microbatches: int, rank: int) -> RankReads:
    """What rank ``rank`` reads of a batch: its replica of every module it holds that reads batch columns."""
    replicas = tuple((name, graph.placement.coord(name, rank).dp) for name in graph.placement.modules_on(rank)
                     if graph.nodes[name].kind.data_keys(graph.nodes[name].config))
    return RankReads(graph, microbatches, replicas)
