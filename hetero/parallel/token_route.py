"""Routing items' tokens (native-resolution images) to their placeholders in another module's rows.

The source module's DP replicas each hold the tokens of the items they encoded, item after item
(``TokenRequest.source_items``); each item's tokens go to one row of the destination at consecutive
positions from ``start``. A destination rank (first pipeline stage) needs the tokens that fall in its
DP replica's rows and in the positions of the row it holds (its CP chunks, its SP part); TP replicas
that hold the same positions each receive them. Every rank derives the whole plan from the global batch
description, so both ends of every message agree on its size and order without a header: per pair of
ranks, the tokens in (item, token) order.

Forward: one batched round of point-to-point messages, each source replica's sends spread over its TP
ranks by destination, and a local copy where the source and destination rank are one process. The
destination gets ``(tokens, width)`` values with each token's local row and position. Backward: of the
destination ranks holding a token, only the one with the lowest TP coordinate returns its gradient
(each holds the full gradient of its copy), so every token's gradient crosses back once and the source
sums nothing twice; it goes to every TP rank of the source replica, each of which needs the full
gradient of its (replicated) output.

Messages go through ``boundary_wire.Wire`` rounds (timeouts, byte counters, deferred sends for a
pipeline's interleaved calls) on two groups of their own, one per direction, built on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hetero.parallel.boundary_wire import DIRECTIONS, Message, Wire, message_tag
from hetero.parallel.layout import Layout


@dataclass(frozen=True)
class TokenRequest:
    """One call's global description (host tensors, the same on every rank)."""

    source_items: list[torch.Tensor]  # per source DP replica, the items it holds, in its output's order
    tokens: torch.Tensor  # (items,) tokens per item
    row: torch.Tensor  # (items,) the destination row of each item (global)
    start: torch.Tensor  # (items,) the position of its first token in that row
    destination_rows: list[torch.Tensor]  # per destination DP replica, its rows (global), in local order


@dataclass
class RankRoute:
    """This rank's part of one call."""

    sends: dict[int, torch.Tensor]  # peer -> offsets into this rank's source output
    recvs: dict[int, tuple[torch.Tensor, torch.Tensor]]  # peer -> (local rows, local positions), in arrival order
    grad_sends: dict[int, int]  # backward: peer (each TP rank of a source replica) -> the forward peer whose tokens' gradient it takes
    grad_recvs: dict[int, torch.Tensor]  # backward: peer -> offsets into this rank's source output
    source_tokens: int  # the length of this rank's source output (0 where it holds none)


class TokenRoute:
    """Construct on every rank, in the same order as every other group-creating object."""

    def __init__(self, name: str, source: Layout, destination: Layout, held: Callable[[int], torch.Tensor],
                 replicated_over_tp: bool, *, timeout_s: float, async_sends: bool, device: torch.device):
        """``held(rank)``: the positions of a row destination rank ``rank`` holds, in its local order.
        ``replicated_over_tp``: the destination's TP ranks hold the same positions (no SP)."""
        self.name, self.source, self.destination = name, source, destination
        self.held, self.replicated_over_tp = held, replicated_over_tp
        self.async_sends, self.device = async_sends, device
        self.rank = dist.get_rank()
        members = sorted(set(source.ranks) | set(destination.ranks))
        groups = {d: dist.new_group(members, timeout=timedelta(seconds=timeout_s)) for d in DIRECTIONS}
        self.wire = Wire(name, message_tag(name), groups, {}, 0, device, timeout_s, self._role)
        self.wire.open()
        self.senders = [r for r in source.ranks if source.coord(r).pp == source.pp - 1]
        self.receivers = [r for r in destination.ranks if destination.coord(r).pp == 0]
        self.is_source, self.is_destination = self.rank in self.senders, self.rank in self.receivers
        self._calls = dict.fromkeys(DIRECTIONS, 0)

    def _role(self, rank: int) -> str:
        return "source" if rank in self.senders else "destination"

    def _sender(self, replica: int, receiver: int) -> int:
        """The source rank (of replica ``replica``'s last stage) that sends to ``receiver``: spread over its TP ranks."""
        tp = self.receivers.index(receiver) % self.source.tp
        return next(r for r in self.senders if self.source.coord(r).dp == replica and self.source.coord(r).tp == tp)

    def _needs(self, receiver: int, request: TokenRequest):
        """What ``receiver`` takes: (item, token index, local row, local position) per token, (item, token) order."""
        coord = self.destination.coord(receiver)
        rows = request.destination_rows[coord.dp]
        held = self.held(receiver)
        local_of = torch.full((int(held.max()) + 1 if len(held) else 1,), -1, dtype=torch.long, device="cpu")
        local_of[held] = torch.arange(len(held), device="cpu")
        chosen = torch.nonzero(torch.isin(request.row, rows)).flatten()
        parts = []
        for item in chosen.tolist():
            count, start = int(request.tokens[item]), int(request.start[item])
            positions = torch.arange(start, start + count, device="cpu")
            inside = positions < len(local_of)
            local = torch.full((count,), -1, dtype=torch.long, device="cpu")
            local[inside] = local_of[positions[inside]]
            taken = torch.nonzero(local >= 0).flatten()
            if len(taken):
                row = int(torch.nonzero(rows == request.row[item]).flatten()[0])
                parts.append((item, taken, torch.full((len(taken),), row, dtype=torch.long, device="cpu"), local[taken]))
        return parts

    def plan(self, request: TokenRequest) -> RankRoute:
        where = {}  # item -> (source replica, offset of its first token in that replica's output)
        for holder, items in enumerate(request.source_items):
            offset = 0
            for item in items.tolist():
                where[item] = (holder, offset)
                offset += int(request.tokens[item])
        replica = self.source.coord(self.rank).dp if self.is_source else None
        sends, recvs, grad_recvs = {}, {}, {}
        grad_sends: dict[int, int] = {}
        for receiver in self.receivers:
            if not (self.is_source or receiver == self.rank):
                continue
            blocks: dict[int, list] = {}  # source replica -> [(offsets, rows, positions)] in (item, token) order
            for item, taken, rows, positions in self._needs(receiver, request):
                source_replica, offset = where[item]
                blocks.setdefault(source_replica, []).append((offset + taken, rows, positions))
            for source_replica, parts in sorted(blocks.items()):
                sender = self._sender(source_replica, receiver)
                offsets = torch.cat([o for o, _, _ in parts])
                if receiver == self.rank:
                    recvs[sender] = (torch.cat([r for _, r, _ in parts]), torch.cat([p for _, _, p in parts]))
                    if self._owns(receiver):
                        for rank in self._replica_ranks(source_replica):
                            grad_sends[rank] = sender
                if sender == self.rank:
                    sends[receiver] = offsets
                if source_replica == replica and self._owns(receiver):
                    grad_recvs[receiver] = offsets
        mine = sum(int(request.tokens[i]) for i in request.source_items[replica].tolist()) if self.is_source else 0
        return RankRoute(dict(sorted(sends.items())), dict(sorted(recvs.items())), dict(sorted(grad_sends.items())),
                         dict(sorted(grad_recvs.items())), mine)

    def _owns(self, receiver: int) -> bool:
        """Whether ``receiver`` returns the gradients of what it received: of the destination ranks holding
        a token, the one with the lowest TP coordinate (every one under sequence parallelism)."""
        return not self.replicated_over_tp or self.destination.coord(receiver).tp == 0

    def _replica_ranks(self, replica: int) -> list[int]:
        """The last-stage ranks of a source replica: its TP ranks, each of which needs the full gradient."""
        return [r for r in self.senders if self.source.coord(r).dp == replica]

    def forward(self, route: RankRoute, x: torch.Tensor | None, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x``: this source rank's output (tokens, width), or None. Returns the received values (tokens,
        width) with their local rows and positions (empty on ranks that receive nothing)."""
        call = self._next("forward")
        tag = message_tag(f"{self.name}.forward.{call}")
        dtype = x.dtype if x is not None else torch.float32
        incoming = {peer: torch.empty(len(rows), width, dtype=dtype, device=self.device)
                    for peer, (rows, _) in route.recvs.items() if peer != self.rank}
        sends = [Message(peer, x[offsets.to(self.device)].contiguous(), "cross", tag)
                 for peer, offsets in route.sends.items() if peer != self.rank]
        self.wire.round("forward", call, sends, [Message(p, b, "cross", tag) for p, b in incoming.items()],
                        defer=self.async_sends and not incoming)
        values = []
        for peer in route.recvs:
            if peer == self.rank:
                values.append(x[route.sends[peer].to(self.device)])
                self.wire.count("forward", "local_copy_bytes", values[-1].numel() * values[-1].element_size())
            else:
                values.append(incoming[peer])
        rows = [r for r, _ in route.recvs.values()]
        positions = [p for _, p in route.recvs.values()]
        if not values:
            empty = torch.zeros(0, dtype=torch.long, device=self.device)
            return torch.zeros(0, width, dtype=dtype, device=self.device), empty, empty
        return torch.cat(values), torch.cat(rows).to(self.device), torch.cat(positions).to(self.device)

    def backward(self, route: RankRoute, grad: torch.Tensor | None, width: int) -> torch.Tensor | None:
        """``grad``: the destination rank's gradient of what it received. Returns this source rank's
        gradient of its output (None on ranks that are not sources): every TP rank of a source replica
        gets the gradient of all its replica's tokens."""
        call = self._next("backward")
        tag = message_tag(f"{self.name}.backward.{call}")
        blocks, start = {}, 0
        if grad is not None:
            for peer, (rows, _) in route.recvs.items():
                blocks[peer] = grad[start : start + len(rows)].float().contiguous()
                start += len(rows)
        incoming = {peer: torch.empty(len(offsets), width, dtype=torch.float32, device=self.device)
                    for peer, offsets in route.grad_recvs.items() if peer != self.rank}
        sends = [Message(peer, blocks[sender], "cross", tag) for peer, sender in route.grad_sends.items()
                 if peer != self.rank]
        self.wire.round("backward", call, sends, [Message(p, b, "cross", tag) for p, b in incoming.items()],
                        defer=self.async_sends and not incoming)
        if not self.is_source:
            return None
        total = torch.zeros(route.source_tokens, width, dtype=torch.float32, device=self.device)
        for peer, offsets in route.grad_recvs.items():
            piece = blocks[route.grad_sends[self.rank]] if peer == self.rank else incoming[peer]
            total.index_add_(0, offsets.to(self.device), piece)
        return total

    def _next(self, direction: str) -> int:
        self._calls[direction] += 1
        return self._calls[direction]

    def wait_sends(self) -> None:
        self.wire.wait_sends()

    def counters(self) -> dict[str, int]:
        return dict(self.wire.counters)
