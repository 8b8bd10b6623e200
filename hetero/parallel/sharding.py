"""How one side of a boundary lays out a tensor: per rank, the global index spans it holds of each dim.

DP takes contiguous rows of the batch dim (uneven counts allowed, earlier replicas taking the extra row,
or each replica the count a call's ``Rows`` gives it); CP takes zigzag chunks r and 2cp-1-r (or one
contiguous span) of the sequence dim; sequence parallelism cuts that local sequence further into TP
parts; a window keeps the part of a longer sequence that the tensor fills; every other dim is whole.
Pure index arithmetic, no process groups (``boundary_plan`` pairs the boxes of two sides).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

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


def dp_rows(batch_size: int, dp_rank: int, dp_size: int) -> slice:
    """The contiguous rows of DP rank ``dp_rank`` out of ``dp_size``; earlier ranks take the extra rows."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is outside 0..{dp_size - 1} (dp_size={dp_size})")
    base, extra = divmod(batch_size, dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return slice(start, start + base + (1 if dp_rank < extra else 0))
