"""Transfer plans for boundary communicators: pure index arithmetic, no process groups.

Each side of a boundary lays out the same global tensor by its own layout. For one rank, a side's
*box* lists, per dimension, the global index spans the rank holds, in the order they sit in its local
tensor (``hetero.parallel.sharding``: DP rows, CP chunks, SP parts, windows).

Ranks of a side whose boxes are equal form a *replica group* (TP replicas, or every rank when nothing
is split). Replica groups of one side never overlap and together cover the tensor, so every element
has exactly one source group R that holds it and one destination group G that needs it. A *piece* is
the intersection of one R with one G, flattened in a canonical order both sides derive alike.

Moving a piece (forward):
- members of G that are also in R (the same process holds it on both sides, "local") copy it;
- the other members M receive it once across the boundary: the piece's flat elements are cut into
  |M| even ranges (one per receiver) and, independently, into |R| even ranges (one per sender); the
  segment where sender range i meets receiver range j goes from R[i] to M[j], so the crossing is
  spread evenly over both sides and no element crosses twice;
- M completes the piece inside itself: each member forwards its range to the others (an all-gather).

Backward runs the same segments the other way. The gradient of a piece is the sum over all of G's
copies: M reduce-scatters (each member ends with the sum of its range), local members hand their
contributions to the senders directly, receivers send their sums back over the crossing segments,
and R all-gathers the sender ranges, so every source replica ends with the full summed gradient.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import torch

from hetero.parallel.layout import Coord
from hetero.parallel.sharding import (  # noqa: F401 - re-exported for the boundary's users
    Span,
    Box,
    SUPPORTED_DTYPES,
    Sharding,
    TensorSpec,
    Side,
    split_evenly,
    cp_spans,
    part_of_spans,
    window_of_spans,
    sequence_spans,
    Rows,
    batch_span,
    rank_box,
    box_shape,
    check_global_shape,
)


@dataclass(frozen=True)
class DimOverlap:
    """One contiguous run shared by a source and a destination box along one dim (local offsets)."""

    src: int
    dst: int
    length: int


Block = tuple[DimOverlap, ...]  # one overlap per dim: a dense sub-box of both local tensors


@dataclass(frozen=True)
class Piece:
    """What one source replica group holds of what one destination replica group needs."""

    index: int  # position in this rank's piece list: the key of its buffers
    key: str
    dtype: torch.dtype
    blocks: tuple[Block, ...]  # flattened one after another, each row-major
    numel: int
    senders: tuple[int, ...]  # the source replica group R
    receivers: tuple[int, ...]  # destination replicas that need it over the wire (M)
    local: tuple[int, ...]  # destination replicas that are also in R: a local copy

    def sender_range(self, rank: int) -> Span:
        return split_evenly(self.numel, len(self.senders), self.senders.index(rank))

    def receiver_range(self, rank: int) -> Span:
        return split_evenly(self.numel, len(self.receivers), self.receivers.index(rank))


def dim_overlaps(src: Sequence[Span], dst: Sequence[Span]) -> tuple[DimOverlap, ...]:
    """Runs shared by two span lists, in global order, merged where contiguous on both sides."""
    found = []
    src_offset = 0
    for s_start, s_stop in src:
        dst_offset = 0
        for d_start, d_stop in dst:
            lo, hi = max(s_start, d_start), min(s_stop, d_stop)
            if lo < hi:
                found.append((lo, DimOverlap(src_offset + lo - s_start, dst_offset + lo - d_start, hi - lo)))
            dst_offset += d_stop - d_start
        src_offset += s_stop - s_start
    merged: list[DimOverlap] = []
    for _, run in sorted(found, key=lambda item: item[0]):
        last = merged[-1] if merged else None
        if last and run.src == last.src + last.length and run.dst == last.dst + last.length:
            merged[-1] = DimOverlap(last.src, last.dst, last.length + run.length)
        else:
            merged.append(run)
    return tuple(merged)


class SideGroups:
    """One side's replica groups for one tensor shape, found without listing the world.

    A group is the ranks of the holding stage that agree on the coordinates that split the tensor: dp
    where it has a batch dim, cp where it has a sequence dim, tp under sequence parallelism. Other ranks
    hold other elements, so a group's box (and its members, and its place in layout order) follows from
    that key alone. ``overlapping(box)`` finds the groups whose boxes meet another side's box by interval
    arithmetic: the DP replicas whose rows meet the box's rows (found from the box's ends, not by
    scanning the replicas), times the CP/SP parts (few) whose spans meet its sequence spans.
    """

    def __init__(self, shape: Sequence[int], sharding: Sharding, side: Side, counts: tuple[int, ...] | None = None):
        self.shape, self.sharding, self.layout, self.stage, self.counts = tuple(shape), sharding, side.layout, side.stage, counts
        layout = self.layout
        self.split_dp = sharding.batch_dim is not None
        self.split_cp = sharding.seq_dim is not None
        self.split_tp = sharding.seq_dim is not None and sharding.sequence_parallel
        self._starts = list(itertools.accumulate(counts, initial=0)) if counts is not None and self.split_dp else None
        self._sequence_parts = [
            ((cp, tp), sequence_spans(self.shape[sharding.seq_dim], sharding, layout, Coord(tp=tp, cp=cp, dp=0, pp=0)))
            for cp in range(layout.cp) for tp in (range(layout.tp) if self.split_tp else (0,))
        ] if self.split_cp else []

    def key_of(self, coord: Coord) -> tuple[int, int, int]:
        """The group of a rank at ``coord``: its splitting coordinates, 0 for the others."""
        return (coord.dp if self.split_dp else 0, coord.cp if self.split_cp else 0, coord.tp if self.split_tp else 0)

    def box(self, key: tuple[int, int, int]) -> Box:
        """``rank_box`` of the group's ranks, the batch span read off the counts' running sums."""
        dp, cp, tp = key
        box = rank_box(self.shape, self.sharding, self.layout, Coord(tp=tp, cp=cp, dp=dp, pp=self.stage or 0))
        if self._starts is None:
            return box
        batch = self.sharding.batch_dim
        return box[:batch] + (((self._starts[dp], self._starts[dp + 1]),),) + box[batch + 1:]

    def members(self, key: tuple[int, int, int]) -> tuple[int, ...]:
        """The group's ranks in layout order (dp outermost, then cp, then tp, as ranks are laid out)."""
        layout, (dp, cp, tp) = self.layout, key
        return tuple(
            layout.rank_at(Coord(tp=t, cp=c, dp=d, pp=self.stage or 0))
            for d in ((dp,) if self.split_dp else range(layout.dp))
            for c in ((cp,) if self.split_cp else range(layout.cp))
            for t in ((tp,) if self.split_tp else range(layout.tp))
        )

    def position(self, key: tuple[int, int, int]) -> int:
        """Where the group's first member sits in the stage's layout order (replica groups list in it)."""
        dp, cp, tp = key
        return (dp * self.layout.cp + cp) * self.layout.tp + tp

    def overlapping(self, box: Box) -> list[tuple[int, int, int]]:
        """Keys of the groups whose boxes may meet ``box`` (every dim checked by the caller's overlaps)."""
        sharding = self.sharding
        dps: list[int] = [0]
        if self.split_dp:
            found: set[int] = set()
            for lo, hi in box[sharding.batch_dim]:
                if lo < hi:
                    found.update(range(self._replica_at(lo), self._replica_at(hi - 1) + 1))
            dps = sorted(found)
        parts: list[tuple[int, int]] = [(0, 0)]
        if self.split_cp:
            wanted = box[sharding.seq_dim]
            parts = [part for part, spans in self._sequence_parts
                     if any(max(a, c) < min(b, d) for a, b in spans for c, d in wanted)]
        return [(dp, cp, tp) for dp in dps for cp, tp in parts]

    def _replica_at(self, index: int) -> int:
        """The DP replica whose rows hold batch index ``index`` (the last of those ending there, for counts
        with empty replicas: it is the one that holds the row)."""
        if self._starts is not None:
            return bisect.bisect_right(self._starts, index) - 1
        length, dp = self.shape[self.sharding.batch_dim], self.layout.dp
        base, extra = divmod(length, dp)
        if index < extra * (base + 1):
            return index // (base + 1)
        return extra + (index - extra * (base + 1)) // base


def plan_pieces(
    key: str,
    shape: Sequence[int],
    spec: TensorSpec,
    source: Side,
    destination: Side,
    rank: int,
    first_index: int,
    rows: Rows = Rows(),
) -> list[Piece]:
    """The pieces of one tensor that involve ``rank``, in the order every rank lists them (destination
    groups in layout order, then source groups).

    Only this rank's own source and destination replica groups are paired, each with the other side's
    groups whose boxes meet it (``SideGroups.overlapping``), so the cost grows with what the rank
    touches, not with the world.
    """
    src, dst = SideGroups(shape, spec.source, source, rows.source), SideGroups(shape, spec.destination, destination, rows.destination)
    pairs: set[tuple[tuple[int, int, int], tuple[int, int, int]]] = set()
    src_coord, dst_coord = _active_coord(source, rank), _active_coord(destination, rank)
    if dst_coord is not None:
        mine = dst.key_of(dst_coord)
        pairs.update((mine, other) for other in src.overlapping(dst.box(mine)))
    if src_coord is not None:
        mine = src.key_of(src_coord)
        pairs.update((other, mine) for other in dst.overlapping(src.box(mine)))
    pieces = []
    for dst_key, src_key in sorted(pairs, key=lambda pair: (dst.position(pair[0]), src.position(pair[1]))):
        per_dim = [dim_overlaps(s, d) for s, d in zip(src.box(src_key), dst.box(dst_key))]
        if not all(per_dim):
            continue
        src_ranks, dst_ranks = src.members(src_key), dst.members(dst_key)
        pieces.append(
            Piece(
                index=first_index + len(pieces),
                key=key,
                dtype=spec.dtype,
                blocks=tuple(itertools.product(*per_dim)),
                numel=math.prod(sum(run.length for run in runs) for runs in per_dim),
                senders=src_ranks,
                receivers=tuple(r for r in dst_ranks if r not in src_ranks),
                local=tuple(r for r in dst_ranks if r in src_ranks),
            )
        )
    return pieces


@dataclass(frozen=True)
class Entry:
    """A range of a piece's flat elements inside one message."""

    piece: Piece
    start: int
    stop: int


Messages = dict[int, list[Entry]]  # peer rank -> entries, in the order both ends pack them


@dataclass
class RankPlan:
    """One rank's part of a call's plan; backward uses the same lists with directions swapped.

    ``cross_out``/``cross_in``: forward crossing segments this rank sends (as a sender) or receives
    (as a receiver). ``dest_out``/``dest_in``: the forward completion inside M (this receiver's range
    to each other member, their ranges in). ``src_out``/``src_in``: the backward all-gather of sender
    ranges inside R. ``local_out``/``local_in``: backward contributions of local copies handed to the
    senders (this rank as a local copy, out; as a sender, in).
    """

    shapes: dict[str, tuple[int, ...]]
    rows: Rows
    src_shapes: dict[str, tuple[int, ...]]  # this rank's local shapes (empty when not a source)
    dst_shapes: dict[str, tuple[int, ...]]
    local_copies: list[Piece] = field(default_factory=list)
    received: list[Piece] = field(default_factory=list)  # pieces this rank assembles as a receiver
    sent: list[Piece] = field(default_factory=list)  # pieces this rank holds as a sender
    cross_out: Messages = field(default_factory=dict)
    cross_in: Messages = field(default_factory=dict)
    dest_out: Messages = field(default_factory=dict)
    dest_in: Messages = field(default_factory=dict)
    src_out: Messages = field(default_factory=dict)
    src_in: Messages = field(default_factory=dict)
    local_out: Messages = field(default_factory=dict)
    local_in: Messages = field(default_factory=dict)


def rank_plan(
    rank: int,
    shapes: Mapping[str, tuple[int, ...]],
    specs: Mapping[str, TensorSpec],
    source: Side,
    destination: Side,
    rows: Rows = Rows(),
) -> RankPlan:
    """This rank's sends, receives and copies for one shape signature (computed once, then cached)."""
    src_coord, dst_coord = _active_coord(source, rank), _active_coord(destination, rank)
    plan = RankPlan(
        shapes=dict(shapes),
        rows=rows,
        src_shapes={
            key: box_shape(rank_box(shapes[key], spec.source, source.layout, src_coord, rows.source))
            for key, spec in specs.items()
        }
        if src_coord
        else {},
        dst_shapes={
            key: box_shape(rank_box(shapes[key], spec.destination, destination.layout, dst_coord, rows.destination))
            for key, spec in specs.items()
        }
        if dst_coord
        else {},
    )
    pieces: list[Piece] = []
    for key, spec in specs.items():
        pieces += plan_pieces(key, shapes[key], spec, source, destination, rank, len(pieces), rows)
    for piece in pieces:
        _add_piece(plan, piece, rank)
    for messages in _all_messages(plan):
        for entries in messages.values():
            order_by_element_size(entries)
    return plan


def _active_coord(side: Side, rank: int) -> Coord | None:
    coord = side.layout.coord(rank)
    return coord if coord is not None and coord.pp == side.stage else None


def _add_piece(plan: RankPlan, piece: Piece, rank: int) -> None:
    if rank in piece.local:
        plan.local_copies.append(piece)
        for sender in piece.senders:
            if sender != rank:
                _add(plan.local_out, sender, piece, piece.sender_range(sender))
    if rank in piece.senders:
        plan.sent.append(piece)
        mine = piece.sender_range(rank)
        for receiver in piece.receivers:
            _add_overlap(plan.cross_out, receiver, piece, mine, piece.receiver_range(receiver))
        for sender in piece.senders:
            if sender != rank:
                _add(plan.src_out, sender, piece, mine)
                _add(plan.src_in, sender, piece, piece.sender_range(sender))
        for other in piece.local:
            if other != rank:
                _add(plan.local_in, other, piece, mine)
    if rank in piece.receivers:
        plan.received.append(piece)
        mine = piece.receiver_range(rank)
        for sender in piece.senders:
            _add_overlap(plan.cross_in, sender, piece, piece.sender_range(sender), mine)
        for receiver in piece.receivers:
            if receiver != rank:
                _add(plan.dest_out, receiver, piece, mine)
                _add(plan.dest_in, receiver, piece, piece.receiver_range(receiver))


def _add(messages: Messages, peer: int, piece: Piece, span: Span) -> None:
    if span[0] < span[1]:
        messages.setdefault(peer, []).append(Entry(piece, *span))


def _add_overlap(messages: Messages, peer: int, piece: Piece, a: Span, b: Span) -> None:
    _add(messages, peer, piece, (max(a[0], b[0]), min(a[1], b[1])))


MESSAGE_FIELDS = ("cross_out", "cross_in", "dest_out", "dest_in", "src_out", "src_in", "local_out", "local_in")


def _all_messages(plan: RankPlan) -> Iterator[Messages]:
    for name in MESSAGE_FIELDS:
        yield getattr(plan, name)


def order_by_element_size(entries: list[Entry]) -> None:
    """Wider elements first, so every entry's byte offset in a packed message suits its dtype."""
    entries.sort(key=lambda entry: -entry.piece.dtype.itemsize)


def merge_messages(first: Messages, second: Messages) -> Messages:
    """Both message sets in one round: one message per peer (the peer merges its side alike)."""
    merged: Messages = {peer: list(entries) for peer, entries in first.items()}
    for peer, entries in second.items():
        merged.setdefault(peer, []).extend(entries)
    for entries in merged.values():
        order_by_element_size(entries)
    return merged


def keep_keys(plan: RankPlan, keys: set[str]) -> RankPlan:
    """The part of a plan that moves only ``keys`` (backward moves floating-point tensors only)."""

    def pieces(items: list[Piece]) -> list[Piece]:
        return [p for p in items if p.key in keys]

    def messages(items: Messages) -> Messages:
        kept = {peer: [e for e in entries if e.piece.key in keys] for peer, entries in items.items()}
        return {peer: entries for peer, entries in kept.items() if entries}

    return RankPlan(
        shapes={k: v for k, v in plan.shapes.items() if k in keys},
        rows=plan.rows,
        src_shapes={k: v for k, v in plan.src_shapes.items() if k in keys},
        dst_shapes={k: v for k, v in plan.dst_shapes.items() if k in keys},
        local_copies=pieces(plan.local_copies),
        received=pieces(plan.received),
        sent=pieces(plan.sent),
        **{name: messages(getattr(plan, name)) for name in MESSAGE_FIELDS},
    )
