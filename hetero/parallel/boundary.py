"""Boundary communicators: move a tensor from one module's layout to another's, and its gradient back.

A ``Boundary`` joins a source module (a ``Side``: its layout and the PP stage holding the tensor) to a
destination module, for one tensor or a dict of tensors, each described by a ``TensorSpec`` (rank,
dtype, and how each side shards it: DP over the batch dim, CP over the sequence dim, zigzag or
contiguous, TP replicated or sequence-parallel). Ranks of other PP stages take no part.

    boundary = Boundary("vision->llm", Side(vision_layout), Side(llm_layout), TensorSpec(ndim=3))
    out = boundary(x, shape=(batch, seq, hidden))  # autograd: loss.backward() sends gradients back

``forward``/``backward`` are the same exchange without autograd (a schedule calls them):
``transfer = boundary.forward(x, shape)`` gives ``transfer.output`` on destination ranks, and
``boundary.backward(transfer, grad)`` returns the source ranks' gradients. ``rows=Rows(source=...,
destination=...)`` gives a call's DP rows per replica on either side (default: an even split), e.g. the
rows of a multimodal batch that carry an image, which the two modules' replicas own unequally.

The plan (``boundary_plan``) is computed once per shape signature and cached. Forward takes at most two
rounds: one batched round of point-to-point messages carries every element across once (spread over
source replicas and destination replicas, local copies where a rank holds the data on both sides), then
receivers that are replicas of one another complete their copies among themselves (an all-gather done
with the same batched point-to-point calls, so any subset of a module's ranks can complete without a
process group of its own). Backward takes at most three: destination replicas reduce-scatter their
gradients (and local copies hand theirs to the senders), the sums cross back, and source replicas
all-gather, so each source replica gets the full summed gradient of its shard.

Shapes. Every rank passes the global shape(s) of the call, which it knows from the microbatch
description. With ``exchange_shapes=True`` destination ranks that are not also source ranks may pass
``None``: each learns the shapes from one partner source rank's header before it can post its receives
(one extra round on those ranks). Source ranks always pass the shape: their shard alone is ambiguous
when a batch splits unevenly. Pairing checks and errors are ``boundary_wire``'s.

Asynchronous sends. With ``async_sends=True`` a rank that only sends payloads in a call's crossing (a
source-only rank in forward, a destination-only rank in backward) posts its headers, the receives of its
peers' headers and its payloads, and returns; the handles and buffers stay with the boundary until ``wait_sends()``, which the
caller makes once per step and which raises any failed send as a ``BoundaryError``. Receives still
block. This lets the two sides call in different orders, as the stages of a 1F1B pipeline do (the
source runs F0 F1 B0 F2 .., the destination F0 B0 F1 B1 ..): with waited sends a source sending F1 while
the destination sends B0 would deadlock on a transport that does not buffer (gloo's sends wait for the
receive, measured). Until ``wait_sends()`` the source's ``x`` must not be changed in place and the
boundary must stay alive (on gloo a dropped handle cancels its send, measured).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from hetero.errors import ConfigError
from hetero.parallel.boundary_plan import (
    Entry,
    RankPlan,
    Rows,
    Sharding,
    Side,
    TensorSpec,
    check_global_shape,
    keep_keys,
    merge_messages,
    rank_plan,
    SideGroups,
)
from hetero.parallel.boundary_wire import (
    DIRECTIONS,
    BoundaryError,
    Direction,
    OwnRange,
    Values,
    Wire,
    copy_blocks,
    gather_blocks,
    length,
    message_tag,
    part,
    scatter_blocks,
    store,
    unpack,
)
from hetero.parallel.layout import Layout

__all__ = ["Boundary", "BoundaryError", "Rows", "Sharding", "Side", "TensorSpec", "Transfer"]

Shape = Sequence[int]
TensorOrDict = torch.Tensor | Mapping[str, torch.Tensor]
SINGLE_KEY = "tensor"  # the key of a boundary built for one tensor rather than a dict


@dataclass
class Transfer:
    """One forward call's result on this rank: the destination shard(s) and what backward needs."""

    output: torch.Tensor | dict[str, torch.Tensor] | None
    plan: RankPlan | None  # None on ranks that take no part


class Boundary:
    """Moves tensors from the source layout to the destination layout and gradients back.

    Construct it on every rank of the world, in the same order as every other boundary and group: it
    creates its process groups there (one per direction). ``tensors`` is one ``TensorSpec`` or a dict of them. With
    ``async_sends=True`` send-only crossings return before delivery: call ``wait_sends()`` once a step.
    """

    def __init__(
        self,
        name: str,
        source: Side | Layout,
        destination: Side | Layout,
        tensors: TensorSpec | Mapping[str, TensorSpec],
        *,
        timeout_s: float = 300.0,  # the group's timeout when built here; pass a shared group's own
        exchange_shapes: bool = False,
        device: torch.device | str = "cpu",
        group: dist.ProcessGroup | None = None,
        plan_cache_size: int = 64,
        async_sends: bool = False,
    ) -> None:
        self.name = name
        source, destination = _as_side(source), _as_side(destination)
        self.source = source.resolve(source.layout.pp - 1, f"boundary {name!r} source")
        self.destination = destination.resolve(0, f"boundary {name!r} destination")
        self.single = isinstance(tensors, TensorSpec)
        self.specs: dict[str, TensorSpec] = {SINGLE_KEY: tensors} if isinstance(tensors, TensorSpec) else dict(tensors)
        if not self.specs:
            raise ConfigError(f"boundary {name!r}: give at least one tensor spec")
        for key, spec in self.specs.items():
            spec.check(f"boundary {name!r} tensor {key!r}")
        self.timeout_s = timeout_s
        self.exchange_shapes = exchange_shapes
        self.async_sends = async_sends
        self.device = torch.device(device)
        self.rank = dist.get_rank()
        self.sources = self.source.active_ranks()
        self.destinations = self.destination.active_ranks()
        self.is_source = self.rank in self.sources
        self.is_destination = self.rank in self.destinations
        self.digest = message_tag(repr((name, self.source, self.destination, list(self.specs.items()), exchange_shapes)))
        self.wire = Wire(
            name, self.digest, self._link_groups(group, timeout_s), self.specs,
            self.source.layout.dp + self.destination.layout.dp, self.device, timeout_s, self._role,
        )
        self.wire.open()
        self._plans: OrderedDict[tuple, RankPlan] = OrderedDict()
        self._plan_cache_size = plan_cache_size
        self._calls = dict.fromkeys(DIRECTIONS, 0)

    def _link_groups(self, group: dist.ProcessGroup | None, timeout_s: float) -> dict[str, dist.ProcessGroup]:
        """The groups this boundary's forward and backward messages travel on: two built here, or one
        given (shared), which then carries both."""
        members = sorted(set(self.source.layout.ranks) | set(self.destination.layout.ranks))
        if group is None:
            # Built on every rank, member or not: a group created on only some ranks hangs the others.
            return {d: dist.new_group(members, timeout=timedelta(seconds=timeout_s)) for d in DIRECTIONS}
        missing = sorted(set(members) - set(dist.get_process_group_ranks(group))) if self.rank in members else []
        if missing:
            raise ConfigError(
                f"boundary {self.name!r}: the group passed lacks ranks {missing} of its modules; pass a "
                f"group holding ranks {members} (or none, and the boundary builds one)"
            )
        if self.async_sends:
            raise ConfigError(
                f"boundary {self.name!r}: async_sends lets the two sides interleave forward and backward calls "
                f"differently, which needs a group per direction; pass no group (the boundary builds them)"
            )
        return dict.fromkeys(DIRECTIONS, group)

    # ----------------------------------------------------------------------------------- public API

    def __call__(
        self, x: TensorOrDict | None, shape: Shape | Mapping[str, Shape] | None = None, rows: Rows = Rows()
    ) -> torch.Tensor | dict[str, torch.Tensor] | None:
        """Forward with autograd. Destination ranks get their shard(s); gradients flow back on backward.

        Source-only ranks get a scalar token instead: ``token.backward()`` takes part in the backward
        exchange. Ranks outside both active stages get None. Integer tensors carry no gradient.
        """
        if not (self.is_source or self.is_destination):
            return None
        xs = self._as_dict(x, "x") if self.is_source else {}
        keys = tuple(xs)
        anchor = torch.zeros((), requires_grad=True, device=self.device)  # keeps the node on destination-only ranks
        outputs = _BoundaryFunction.apply(self, shape, rows, keys, anchor, *(xs[k] for k in keys))
        if not self.is_destination:
            return outputs[0]
        return self._unwrap(dict(zip(self.specs, outputs)))

    def forward(
        self, x: TensorOrDict | None, shape: Shape | Mapping[str, Shape] | None = None, rows: Rows = Rows()
    ) -> Transfer:
        """Deliver ``x`` (source ranks; None elsewhere) to the destination layout, without autograd."""
        if not (self.is_source or self.is_destination):
            return Transfer(None, None)
        xs = self._as_dict(x, "x") if self.is_source else None
        plan, out = self._forward(xs, shape, rows)
        return Transfer(self._unwrap(out), plan)

    def backward(self, transfer: Transfer, grad: TensorOrDict | None) -> torch.Tensor | dict[str, torch.Tensor] | None:
        """Route ``grad`` of the destination shard(s) back; source ranks get the gradient of their x.

        Destination ranks pass the gradient of ``transfer.output`` (a missing tensor counts as zeros);
        other ranks pass None. Only floating-point tensors take part.
        """
        if transfer.plan is None:
            return None
        grads = self._as_dict(grad, "grad") if self.is_destination and grad is not None else {}
        return self._unwrap(self._backward(transfer.plan, grads))

    def wait_sends(self) -> None:
        """Wait for every send posted without waiting (``async_sends``), oldest first, and drop them.
        Raises ``BoundaryError`` naming the call, the direction and the peer of a send that failed."""
        self.wire.wait_sends()

    def counters(self) -> dict[str, int]:
        """This rank's counters, e.g. ``forward.cross_sent_bytes``, summed over calls since the reset."""
        return dict(self.wire.counters)

    def reset_counters(self) -> None:
        self.wire.reset_counters()

    def plan(self, shape: Shape | Mapping[str, Shape], rows: Rows = Rows()) -> RankPlan:
        """This rank's plan for one shape signature, from the cache when it was seen before."""
        return self._plan(self._shape_dict(shape), rows)

    def replicas(self, shape: Shape, rows: Rows = Rows()) -> int:
        """How many destination ranks hold the same shard of a one-tensor call as this destination rank
        (itself included): the ranks whose gradients the backward sums."""
        (spec,) = self.specs.values()
        groups = SideGroups(tuple(shape), spec.destination, self.destination, rows.destination)
        coord = self.destination.layout.coord(self.rank)
        assert coord is not None
        return len(groups.members(groups.key_of(coord)))

    def _plan(self, shapes: dict[str, tuple[int, ...]], rows: Rows) -> RankPlan:
        key = (tuple(shapes.items()), rows)
        cached = self._plans.get(key)
        if cached is not None:
            self._plans.move_to_end(key)
            return cached
        for k, spec in self.specs.items():
            check_global_shape(shapes[k], spec, self.source, self.destination, self._what(k), rows)
        plan = rank_plan(self.rank, shapes, self.specs, self.source, self.destination, rows)
        self._plans[key] = plan
        if len(self._plans) > self._plan_cache_size:
            self._plans.popitem(last=False)
        return plan

    # ------------------------------------------------------------------------------------- forward

    def _forward(
        self, xs: dict[str, torch.Tensor] | None, shape: Shape | Mapping[str, Shape] | None, rows: Rows
    ) -> tuple[RankPlan, dict[str, torch.Tensor]]:
        call = self._start("forward")
        learns_shapes = self.exchange_shapes and not self.is_source
        if learns_shapes:
            shapes, rows = self._receive_shapes(call, shape, rows)
        elif shape is None:
            raise ValueError(
                f"boundary {self.name!r}: rank {self.rank} ({self._role(self.rank)}) called forward without "
                f"the global shape; pass shape= (or build the boundary with exchange_shapes=True so "
                f"destination ranks learn it from the source)"
            )
        else:
            shapes = self._shape_dict(shape)
        plan = self._plan(shapes, rows)
        if xs is not None:
            self._check_tensors(xs, plan, plan.src_shapes, "source", "x")
        tag = self._payload_tag("forward", call, plan)
        header = self._header("forward", call, plan)
        peers = set(plan.cross_out) | set(plan.cross_in)  # headers go both ways on every crossing link
        header_to, header_from = set(peers), set(peers)
        if self.exchange_shapes and self.is_source:
            header_to |= self._listeners_of(self.rank)
            header_from |= self._listeners_of(self.rank)
        if learns_shapes:
            header_to.add(self._partner())
            header_from.discard(self._partner())  # its headers already came with the shapes
        pieces = {p.index: self._empty(p.numel, p.key) for p in plan.received}
        arriving = self.wire.crossing(
            "forward", call, tag, plan.cross_out, plan.cross_in, Values.packed_from(xs or {}, "src"), header,
            header_to, header_from, defer=self.async_sends,
        )
        out = {k: torch.empty(s, dtype=self.specs[k].dtype, device=self.device) for k, s in plan.dst_shapes.items()}
        for piece in plan.local_copies:
            copy_blocks(xs[piece.key], out[piece.key], piece)  # type: ignore[index]
            self.wire.count("forward", "local_copy_bytes", piece.numel * piece.dtype.itemsize)
        for peer, entries in plan.cross_in.items():
            unpack(arriving[peer], entries, store(pieces))
        # Receivers that are replicas of one another complete their pieces (an all-gather).
        self.wire.exchange("forward", call, tag, plan.dest_out, plan.dest_in, Values(pieces), store(pieces))
        for piece in plan.received:
            scatter_blocks(pieces[piece.index], out[piece.key], piece, "dst")
        return plan, out

    def _receive_shapes(
        self, call: int, given: Shape | Mapping[str, Shape] | None, rows: Rows
    ) -> tuple[dict[str, tuple[int, ...]], Rows]:
        """Learn the call's shapes (and DP rows) from this destination-only rank's partner source rank."""
        partner = self._partner()
        expected, header = self.wire.header("forward", call, {}, ()), self.wire.empty_header()
        check = functools.partial(self.wire.check_header, got=header, expected=expected, check_shapes=False)
        self.wire.round("forward", call, [], self.wire.header_messages(partner, header), check)
        shapes, words = self.wire.decode(header.shapes)
        dp = self.source.layout.dp
        learned = Rows(None if words[0] < 0 else tuple(words[:dp]), None if words[dp] < 0 else tuple(words[dp:]))
        if given is not None and (self._shape_dict(given), rows) != (shapes, learned):
            raise BoundaryError(
                f"boundary {self.name!r}: forward call #{call}: destination rank {self.rank} passed shapes "
                f"{self._shape_dict(given)} and rows {rows} but source rank {partner} sent {shapes} and {learned}"
            )
        return shapes, learned

    # ------------------------------------------------------------------------------------ backward

    def _backward(self, plan: RankPlan, given: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        call = self._start("backward")
        plan = keep_keys(plan, {k for k, spec in self.specs.items() if spec.differentiable})
        grads = {k: self._grad_or_zeros(given.get(k), k, s) for k, s in plan.dst_shapes.items()}
        self._check_tensors(grads, plan, plan.dst_shapes, "destination", "grad")
        tag = self._payload_tag("backward", call, plan)
        mine = {p.index: gather_blocks(grads[p.key], p, "dst") for p in plan.received + plan.local_copies}
        # Per piece: a receiver's sum over its own range; a sender's sum over its own range.
        reduced = {p.index: part(mine[p.index], p.receiver_range(self.rank)).clone() for p in plan.received}
        sums = {p.index: self._zeros(length(p.sender_range(self.rank)), p.key) for p in plan.sent}
        for piece in plan.local_copies:  # a local copy's rank is one of the piece's senders
            sums[piece.index] += part(mine[piece.index], piece.sender_range(self.rank))
        accumulate = self._accumulate(reduced, sums)

        # Round 1, inside each module: receivers reduce-scatter; local copies hand their parts to senders.
        out, into = merge_messages(plan.dest_in, plan.local_out), merge_messages(plan.dest_out, plan.local_in)
        self.wire.exchange("backward", call, tag, out, into, Values(mine), accumulate)
        # Round 2, across: receivers send their sums back to the senders of their segments.
        arriving = self.wire.crossing(
            "backward", call, tag, plan.cross_in, plan.cross_out, OwnRange(reduced, self.rank),
            self._header("backward", call, plan), set(plan.cross_in) | set(plan.cross_out),
            set(plan.cross_in) | set(plan.cross_out), defer=self.async_sends,
        )
        for peer, entries in plan.cross_out.items():
            unpack(arriving[peer], entries, accumulate)
        # Round 3, inside the source: sender replicas all-gather their sums.
        full = {p.index: self._empty(p.numel, p.key) for p in plan.sent}
        for piece in plan.sent:
            part(full[piece.index], piece.sender_range(self.rank)).copy_(sums[piece.index])
        self.wire.exchange("backward", call, tag, plan.src_out, plan.src_in, Values(full), store(full))
        result = {k: torch.zeros(s, dtype=self.specs[k].dtype, device=self.device) for k, s in plan.src_shapes.items()}
        for piece in plan.sent:
            scatter_blocks(full[piece.index], result[piece.key], piece, "src")
        return result

    def _accumulate(
        self, reduced: dict[int, torch.Tensor], sums: dict[int, torch.Tensor]
    ) -> Callable[[Entry, torch.Tensor], None]:
        """Sink for gradient parts: a receiver adds into its range, a sender into its range."""

        def add(entry: Entry, values: torch.Tensor) -> None:
            piece = entry.piece
            # A rank never both sends and receives one piece (receivers are the replicas outside R).
            if self.rank in piece.receivers:
                target, span = reduced[piece.index], piece.receiver_range(self.rank)
            else:
                target, span = sums[piece.index], piece.sender_range(self.rank)
            target[entry.start - span[0] : entry.stop - span[0]] += values

        return add

    def _grad_or_zeros(self, grad: torch.Tensor | None, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        if grad is not None:
            return grad
        return torch.zeros(shape, dtype=self.specs[key].dtype, device=self.device)

    # ------------------------------------------------------------------------------------- helpers

    def _header(self, direction: Direction, call: int, plan: RankPlan):
        rows = plan.rows.words(self.source.layout.dp, self.destination.layout.dp)
        return self.wire.header(direction, call, plan.shapes, rows)

    def _payload_tag(self, direction: Direction, call: int, plan: RankPlan) -> int:
        tag = message_tag(f"{self.digest}|{direction}|{call}|{sorted(plan.shapes.items())}|{plan.rows}")
        return tag if tag != self.digest else tag + 1

    def _listeners(self) -> list[int]:
        """Destination ranks that are not source ranks: they learn shapes from a partner source."""
        return [r for r in self.destinations if r not in self.sources]

    def _partner(self) -> int:
        return self.sources[self._listeners().index(self.rank) % len(self.sources)]

    def _listeners_of(self, source: int) -> set[int]:
        index = self.sources.index(source)
        return {r for i, r in enumerate(self._listeners()) if i % len(self.sources) == index}

    def _start(self, direction: Direction) -> int:
        self._calls[direction] += 1
        self.wire.count(direction, "calls", 1)
        return self._calls[direction]

    def _role(self, rank: int) -> str:
        roles = [name for name, ranks in (("source", self.sources), ("destination", self.destinations)) if rank in ranks]
        return "/".join(roles) or "inactive"

    def _what(self, key: str) -> str:
        return f"boundary {self.name!r} tensor {key!r}"

    def _as_dict(self, value: TensorOrDict | None, name: str) -> dict[str, torch.Tensor]:
        if value is None:
            raise ValueError(f"boundary {self.name!r}: rank {self.rank} ({self._role(self.rank)}) must pass {name}")
        if self.single:
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"boundary {self.name!r} carries one tensor; pass {name} as a tensor")
            return {SINGLE_KEY: value}
        if not isinstance(value, Mapping):
            raise TypeError(f"boundary {self.name!r} carries tensors {list(self.specs)}; pass {name} as a dict")
        unknown = sorted(set(value) - set(self.specs))
        if unknown:
            raise ValueError(
                f"boundary {self.name!r}: {name} has tensors {unknown} it does not carry (it carries "
                f"{list(self.specs)}); add specs for them or leave them out"
            )
        return dict(value)

    def _shape_dict(self, shape: Shape | Mapping[str, Shape]) -> dict[str, tuple[int, ...]]:
        shapes = {SINGLE_KEY: shape} if self.single else shape
        if not isinstance(shapes, Mapping) or any(k not in shapes for k in self.specs):
            raise ValueError(f"boundary {self.name!r}: shape= must give a shape for each of {list(self.specs)}")
        return {k: tuple(int(n) for n in shapes[k]) for k in self.specs}

    def _check_tensors(
        self,
        tensors: Mapping[str, torch.Tensor],
        plan: RankPlan,
        local_shapes: Mapping[str, tuple[int, ...]],
        role: str,
        name: str,
    ) -> None:
        for key, shape in local_shapes.items():
            tensor = tensors.get(key)
            if tensor is None:
                raise ValueError(f"{self._what(key)}: {role} rank {self.rank} did not pass {name}[{key!r}]")
            dtype = self.specs[key].dtype
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                layout = (self.source if role == "source" else self.destination).layout
                raise ValueError(
                    f"{self._what(key)}: {role} rank {self.rank} ({layout.coord(self.rank)}) passed {name} "
                    f"of shape {tuple(tensor.shape)} {tensor.dtype}, but its part of the global shape "
                    f"{plan.shapes[key]} is {shape} {dtype}"
                )

    def _unwrap(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor | dict[str, torch.Tensor] | None:
        if not tensors:
            return None
        return tensors[SINGLE_KEY] if self.single else tensors

    def _empty(self, numel: int, key: str) -> torch.Tensor:
        return torch.empty(numel, dtype=self.specs[key].dtype, device=self.device)

    def _zeros(self, numel: int, key: str) -> torch.Tensor:
        return torch.zeros(numel, dtype=self.specs[key].dtype, device=self.device)


class _BoundaryFunction(torch.autograd.Function):
    """Autograd around a boundary: forward is ``Boundary._forward``, backward ``Boundary._backward``."""

    @staticmethod
    def forward(
        ctx, boundary: Boundary, shape, rows: Rows, keys: tuple[str, ...], anchor: torch.Tensor, *xs: torch.Tensor
    ):  # type: ignore[override]
        plan, out = boundary._forward(dict(zip(keys, xs)) if keys else None, shape, rows)
        ctx.boundary, ctx.plan, ctx.keys = boundary, plan, keys
        if not boundary.is_destination:
            return (anchor.new_zeros(()),)
        outputs = tuple(out[k] for k in boundary.specs)
        ctx.mark_non_differentiable(*(t for t, s in zip(outputs, boundary.specs.values()) if not s.differentiable))
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        boundary: Boundary = ctx.boundary
        given = dict(zip(boundary.specs, grads)) if boundary.is_destination else {}
        result = boundary._backward(ctx.plan, given)
        return (None, None, None, None, None, *(result.get(k) for k in ctx.keys))


def _as_side(side: Side | Layout) -> Side:
    return side if isinstance(side, Side) else Side(side)
