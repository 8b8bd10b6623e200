"""Transfer plans for boundary communicators: pure index arithmetic, no process groups.

Each side of a boundary lays out the same global tensor by its own layout. For one rank, a side's
*box* lists, per dimension, the global index spans the rank holds, in the order they sit in its local
tensor: DP takes contiguous rows of the batch dim (uneven counts allowed, earlier replicas take the
extra row, or each replica the count a call's ``Rows`` gives it), CP takes zigzag chunks r and 2cp-1-r (or one contiguous span) of the sequence dim,
sequence parallelism cuts that local sequence further into TP parts, and every other dim is whole.

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

import itertools
import math
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import torch

from hetero.errors import ConfigError
from hetero.parallel.layout import Coord, Layout

Span = tuple[int, int]  # [start, stop) of global indices along one dim
Box = tuple[tuple[Span, ...], ...]  # per dim, the spans a rank holds in local order

# Header codes are indices into this tuple: append, never reorder. Integer and bool tensors (token ids,
# masks) cross without gradients.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int64, torch.int32, torch.bool,
)


@dataclass(frozen=True)
class Sharding:
    """How one side lays out a boundary tensor.

    ``batch_dim`` is split over DP (None: every DP replica holds the whole tensor), ``seq_dim`` over CP
    (None: not split over CP), zigzag-wise or contiguously; with ``sequence_parallel`` the CP rank's
    local sequence is cut further into contiguous TP parts, otherwise TP ranks are replicas.

    ``window=(offset, length)``: the tensor's ``seq_dim`` fills positions ``offset..offset+n-1`` of a
    sequence of ``length`` that the side splits as above (e.g. an encoder's embeddings at placeholder
    positions of an LLM's sequence); each rank holds the positions of the window that its part of the
    sequence holds, in its local order, and possibly none.
    """

    batch_dim: int | None = 0
    seq_dim: int | None = 1
    zigzag: bool = True
    sequence_parallel: bool = False
    window: tuple[int, int] | None = None


@dataclass(frozen=True)
class TensorSpec:
    """A boundary tensor: its rank, dtype and how each side shards it (the shape comes per call)."""

    ndim: int
    dtype: torch.dtype = torch.float32
    source: Sharding = Sharding()
    destination: Sharding = Sharding()

    def check(self, field_name: str) -> None:
        if self.ndim < 1:
            raise ConfigError(f"{field_name}.ndim={self.ndim} must be >= 1")
        if self.dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
            raise ConfigError(f"{field_name}.dtype={self.dtype} is not supported; use one of {names}")
        for side in ("source", "destination"):
            _check_sharding(getattr(self, side), self.ndim, f"{field_name}.{side}")

    @property
    def differentiable(self) -> bool:
        return self.dtype.is_floating_point


def _check_sharding(sharding: Sharding, ndim: int, field_name: str) -> None:
    for name in ("batch_dim", "seq_dim"):
        dim = getattr(sharding, name)
        if dim is not None and not 0 <= dim < ndim:
            raise ConfigError(f"{field_name}.{name}={dim} is outside the tensor's dims 0..{ndim - 1}")
    if sharding.batch_dim is not None and sharding.batch_dim == sharding.seq_dim:
        raise ConfigError(
            f"{field_name}: batch_dim and seq_dim are both {sharding.batch_dim}; "
            f"give them different dims or set one to None"
        )
    if sharding.sequence_parallel and sharding.seq_dim is None:
        raise ConfigError(f"{field_name}: sequence_parallel needs a seq_dim to split over TP")
    if sharding.window is not None:
        offset, length = sharding.window
        if sharding.seq_dim is None or not 0 <= offset <= length:
            raise ConfigError(
                f"{field_name}.window={sharding.window} needs a seq_dim and 0 <= offset <= length"
            )


@dataclass(frozen=True)
class Side:
    """One module's end of a boundary: its layout and the PP stage that holds the tensor."""

    layout: Layout
    stage: int | None = None  # default: the source's last stage, the destination's first

    def resolve(self, default_stage: int, field_name: str) -> Side:
        stage = default_stage if self.stage is None else self.stage
        if not 0 <= stage < self.layout.pp:
            raise ConfigError(
                f"{field_name}.stage={stage} but the layout has pp={self.layout.pp}; "
                f"choose a stage in 0..{self.layout.pp - 1}"
            )
        return Side(self.layout, stage)

    def active_ranks(self) -> tuple[int, ...]:
        """Ranks of the holding stage, in layout order; ranks of other stages take no part."""
        return tuple(rank for rank, coord in self.layout.coords() if coord.pp == self.stage)


def split_evenly(length: int, parts: int, index: int) -> Span:
    """Part ``index`` of ``parts`` contiguous parts of ``range(length)``; earlier parts take the extra."""
    base, extra = divmod(length, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def cp_spans(length: int, cp: int, cp_rank: int, zigzag: bool) -> tuple[Span, ...]:
    """The sequence spans CP rank ``cp_rank`` holds, in local order."""
    if cp == 1:
        return ((0, length),)
    if not zigzag:
        return (split_evenly(length, cp, cp_rank),)
    chunk = length // (2 * cp)
    first, second = cp_rank, 2 * cp - 1 - cp_rank
    return ((first * chunk, (first + 1) * chunk), (second * chunk, (second + 1) * chunk))


def part_of_spans(spans: Sequence[Span], parts: int, index: int) -> tuple[Span, ...]:
    """Part ``index`` of the local order that ``spans`` describe, cut into ``parts`` contiguous parts."""
    total = sum(stop - start for start, stop in spans)
    lo, hi = split_evenly(total, parts, index)
    result, offset = [], 0
    for start, stop in spans:
        a, b = max(lo, offset), min(hi, offset + stop - start)
        if a < b:
            result.append((start + a - offset, start + b - offset))
        offset += stop - start
    return tuple(result) or ((0, 0),)


def window_of_spans(spans: Sequence[Span], start: int, stop: int) -> tuple[Span, ...]:
    """The parts of ``spans`` inside ``[start, stop)``, shifted to start at 0, in the same order."""
    clipped = [(max(a, start) - start, min(b, stop) - start) for a, b in spans if max(a, start) < min(b, stop)]
    return tuple(clipped) or ((0, 0),)


def sequence_spans(length: int, sharding: Sharding, layout: Layout, coord: Coord) -> tuple[Span, ...]:
    """The spans of a ``seq_dim`` of ``length`` a rank at ``coord`` holds, in local order (see ``Sharding``)."""
    offset, full = sharding.window or (0, length)
    spans = cp_spans(full, layout.cp, coord.cp, sharding.zigzag)
    if sharding.sequence_parallel:
        spans = part_of_spans(spans, layout.tp, coord.tp)
    return window_of_spans(spans, offset, offset + length) if sharding.window else spans


@dataclass(frozen=True)
class Rows:
    """How many rows of the batch dim each DP replica holds, in DP order, on each side of one call (None:
    an even split, earlier replicas taking the extra row). Multimodal batches give replicas unequal shares
    of the rows that carry a modality."""

    source: tuple[int, ...] | None = None
    destination: tuple[int, ...] | None = None

    def words(self, source_dp: int, destination_dp: int) -> tuple[int, ...]:
        """Both sides' counts as header words (-1 each for an even split)."""
        return (self.source or (-1,) * source_dp) + (self.destination or (-1,) * destination_dp)


def batch_span(length: int, dp: int, dp_rank: int, counts: tuple[int, ...] | None) -> Span:
    if counts is None:
        return split_evenly(length, dp, dp_rank)
    start = sum(counts[:dp_rank])
    return start, start + counts[dp_rank]


def rank_box(
    shape: Sequence[int], sharding: Sharding, layout: Layout, coord: Coord, counts: tuple[int, ...] | None = None
) -> Box:
    """What a rank at ``coord`` holds of a global tensor of ``shape``; ``counts``: the rows of each DP
    replica (default: an even split)."""
    box: list[tuple[Span, ...]] = [((0, n),) for n in shape]
    if sharding.batch_dim is not None:
        box[sharding.batch_dim] = (batch_span(shape[sharding.batch_dim], layout.dp, coord.dp, counts),)
    if sharding.seq_dim is not None:
        box[sharding.seq_dim] = sequence_spans(shape[sharding.seq_dim], sharding, layout, coord)
    return tuple(box)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(sum(stop - start for start, stop in spans) for spans in box)


def check_global_shape(
    shape: Sequence[int], spec: TensorSpec, source: Side, destination: Side, what: str, rows: Rows = Rows()
) -> None:
    """Raise when ``shape`` cannot be laid out on both sides (zigzag CP needs 2*cp | sequence; explicit DP
    rows must cover the batch dim)."""
    if len(shape) != spec.ndim or any(n < 0 for n in shape):
        raise ValueError(f"{what}: global shape {tuple(shape)} does not fit a tensor of ndim={spec.ndim}")
    for role, side, sharding, counts in (
        ("source", source, spec.source, rows.source),
        ("destination", destination, spec.destination, rows.destination),
    ):
        if counts is not None and sharding.batch_dim is not None and (
            len(counts) != side.layout.dp or sum(counts) != shape[sharding.batch_dim] or min(counts) < 0
        ):
            raise ValueError(
                f"{what}: the {role}'s DP rows {list(counts)} do not split dim {sharding.batch_dim} (length "
                f"{shape[sharding.batch_dim]}) over its dp={side.layout.dp} replicas"
            )
        cp, dim = side.layout.cp, sharding.seq_dim
        if dim is None:
            continue
        length = shape[dim] if sharding.window is None else sharding.window[1]
        if sharding.window is not None and sharding.window[0] + shape[dim] > length:
            raise ValueError(
                f"{what}: the {role}'s dim {dim} (length {shape[dim]}) at offset {sharding.window[0]} runs past "
                f"its window's sequence of {length}"
            )
        if sharding.zigzag and cp > 1 and length % (2 * cp):
            raise ValueError(
                f"{what}: the {role} splits a sequence of {length} zigzag over cp={cp}, which "
                f"needs a multiple of 2*cp={2 * cp}; pad the sequence or set {role}.zigzag=False"
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


def replica_groups(boxes: Mapping[int, Box]) -> list[tuple[Box, tuple[int, ...]]]:
    """Ranks grouped by equal boxes, groups and members in the mapping's (layout) order."""
    groups: dict[Box, list[int]] = {}
    for rank, box in boxes.items():
        groups.setdefault(box, []).append(rank)
    return [(box, tuple(ranks)) for box, ranks in groups.items()]


def side_boxes(shape: Sequence[int], sharding: Sharding, side: Side, counts: tuple[int, ...] | None = None) -> dict[int, Box]:
    return {
        rank: rank_box(shape, sharding, side.layout, coord, counts)
        for rank, coord in side.layout.coords()
        if coord.pp == side.stage
    }


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
    """The pieces of one tensor that involve ``rank``, in the order every rank lists them.

    Only pairs with this rank's own source or destination replica group are intersected, so the
    cost grows with the number of groups, not with its square.
    """
    src_groups = replica_groups(side_boxes(shape, spec.source, source, rows.source))
    dst_groups = replica_groups(side_boxes(shape, spec.destination, destination, rows.destination))
    pieces = []
    for dst_box, dst_ranks in dst_groups:
        for src_box, src_ranks in src_groups:
            if rank not in dst_ranks and rank not in src_ranks:
                continue
            per_dim = [dim_overlaps(s, d) for s, d in zip(src_box, dst_box)]
            if not all(per_dim):
                continue
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
