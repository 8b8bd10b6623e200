"""A routed edge in the runtime: items' tokens (images) to their placeholders.

Each item's token count comes from the source's kind (``Kind.item_tokens``: a native-resolution image's
patches, a fixed-size image's ``num_patches``, a projector's ``tokens``). The executor hands the edge the
source replica's whole output for a microbatch (its items' tokens, item after item, flattened to
(tokens, width)) and gets back, on a destination rank, the tokens it holds with their local rows and
positions (an ``Arrival`` whose tensor is (tokens, width)); backward returns the source output's gradient.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from hetero.graph.graph import Edge, Graph
from hetero.parallel.sharding import sequence_spans
from hetero.parallel.token_route import RankRoute, TokenRequest, TokenRoute
from hetero.runtime.rows import StepRows, batch_size

PLACES = ("image_row", "image_start")  # the batch columns that place each item


class RoutedEdge:
    codec = None  # its tokens travel uncompressed

    def __init__(self, edge: Edge, graph: Graph, timeout_s: float, async_sends: bool, device: torch.device):
        self.edge = edge
        self.source_node = graph.nodes[edge.src]
        source, destination = graph.nodes[edge.src].layout, graph.nodes[edge.dst].layout
        sharding = edge.destination
        node = graph.nodes[edge.dst]
        length = node.kind.inputs(node.config)[edge.input].tokens
        whole = replace(sharding, window=None)

        def held(rank: int) -> torch.Tensor:
            if sharding.seq_dim is None:
                return torch.arange(length, device="cpu")
            spans = sequence_spans(length, whole, destination, destination.coord(rank))
            return torch.cat([torch.arange(a, b, device="cpu") for a, b in spans])  # host-side plan

        self.length = length
        self.route = TokenRoute(edge.name, source, destination, functools.cache(held),
                                replicated_over_tp=not sharding.sequence_parallel, timeout_s=timeout_s,
                                async_sends=async_sends, device=device)
        self._routes: dict[int, RankRoute] = {}

    @property
    def is_source(self) -> bool:
        return self.route.is_source

    @property
    def is_destination(self) -> bool:
        return self.route.is_destination

    def tokens(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(items,) host tensor: each item's tokens, as the source's kind gives them."""
        node = self.source_node
        return node.kind.item_tokens(node.config, batch)

    def batch_errors(self, batch: dict[str, torch.Tensor]) -> list[str]:
        """Items the batch does not place, places outside the batch's rows, and placeholders outside their
        row: refused on every rank before the step (after the modules' column checks)."""
        name = self.edge.name
        missing = [key for key in PLACES if key not in batch]
        if missing:
            return [f"{name}: routing images to their placeholders needs the batch columns {', '.join(missing)} "
                    f"(per image its row and its first placeholder's position)"]
        tokens, start, row = self.tokens(batch), batch["image_start"].cpu(), batch["image_row"].cpu()
        if not len(tokens) == len(start) == len(row):
            return [f"{name}: {self.edge.src} hands on {len(tokens)} images but the batch places {len(row)} "
                    f"(image_row) and {len(start)} (image_start); give every image one of each"]
        rows = batch_size(batch)
        outside = torch.nonzero((row < 0) | (row >= rows)).flatten().tolist()
        if outside:
            i = outside[0]
            return [f"{name}: image {i} belongs to row {int(row[i])}, outside the batch's rows 0..{rows - 1}; "
                    f"give image_row values below {rows}"]
        bad = torch.nonzero((start < 0) | (start + tokens > self.length)).flatten().tolist()
        if not bad:
            return []
        i = bad[0]
        return [f"{name}: image {i} (row {int(row[i])}) has its {int(tokens[i])} placeholders at positions "
                f"{int(start[i])}..{int(start[i] + tokens[i]) - 1}, outside the {self.length} positions of "
                f"{self.edge.dst}'s rows; pack its document into a row that holds it"]

    def request(self, rows: StepRows, batch: dict[str, torch.Tensor], m: int, graph: Graph) -> TokenRequest:
        edge = self.edge
        return TokenRequest(
            source_items=[rows.local(edge.src, m, d) for d in range(graph.nodes[edge.src].layout.dp)],
            tokens=self.tokens(batch),
            row=batch["image_row"].cpu(),
            start=batch["image_start"].cpu(),
            destination_rows=[rows.local(edge.dst, m, d) for d in range(graph.nodes[edge.dst].layout.dp)],
        )

    def forward(self, m: int, x: torch.Tensor | None, request: TokenRequest):
        self._routes[m] = route = self.route.plan(request)
        return self.route.forward(route, x, self.edge.width)

    def backward(self, m: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        return self.route.backward(self._routes.pop(m), grad, self.edge.width)

    def begin(self, *args) -> None:
        pass

    def wait_sends(self) -> None:
        self.route.wait_sends()

    def counters(self) -> dict[str, int]:
        return self.route.counters()

    def sent_bytes(self) -> dict[str, int]:
        counters = self.route.counters()
        return {d: counters[f"{d}.cross_sent_bytes"] for d in ("forward", "backward")}

    def ends(self) -> dict[str, object]:
        return {}

    def memory_bytes(self) -> int:
        return 0

