"""Boundary communicators: move a tensor from one module's layout to another's, and its gradient back.

A ``Boundary`` joins a source module (a ``Side``: its layout and the PP stage holding the tensor) to a
destination module, for one tensor or a dict of tensors, each described by a ``TensorSpec`` (rank,
dtype, and how each side shards it: DP over the batch dim, CP over the sequence dim, zigzag or
contiguous, TP replicated or sequence-parallel). Ranks of other PP stages take no part.

    boundary = Boundary("vision->llm", Side(vision_layout), Side(llm_layout), TensorSpec(ndim=3))
    out = boundary(x, shape=(batch, seq, hidden))  # autograd: loss.backward() sends gradients back

``forward``/``backward`` are the same exchange without autograd (a pipeline schedule calls them):
``transfer = boundary.forward(x, shape)`` gives ``transfer.output`` on destination ranks, and
``boundary.backward(transfer, grad)`` returns the source ranks' gradients.

The plan (``boundary_plan``) is computed once per shape signature and cached. Forward takes at most
two rounds: one batched round of point-to-point messages carries every element across once (spread
over source replicas and destination replicas, local copies where a rank holds the data on both
sides), then receivers that are replicas of one another complete their copies among themselves (an
all-gather done with the same batched point-to-point calls, so any subset of a module's ranks can
complete without a process group of its own). Backward takes at most three: destination replicas
reduce-scatter their gradients (and local copies hand theirs to the senders), the sums cross back,
and source replicas all-gather, so each source replica gets the full summed gradient of its shard.

Shapes. Every rank passes the global shape(s) of the call, which it knows from the microbatch
description; that costs nothing. With ``exchange_shapes=True`` destination ranks that are not also
source ranks may pass ``None``: each learns the shapes from one partner source rank's header before
it can post its receives (one extra round on those ranks). Source ranks always pass the shape: their
shard alone is ambiguous when a batch splits unevenly.

Pairing. Each call sends, on every crossing link, a call header (magic, the boundary's digest and
name, direction, per-direction call number: the same length for every boundary) and a shape header
(dtype and global shape per tensor). The receiver checks them before anything else and raises
``BoundaryError`` naming the boundary, both ranks and the difference: another shape, a skipped call,
a forward meeting a backward, or, on a shared ``group``, a call to another boundary (on separate
groups that one shows up as the timeout). Payloads travel on a tag derived from the call's
signature, posted alongside the headers: a mismatched call can never deliver a message of the wrong
size, which gloo answers by aborting the process (measured). A dead peer or a missing call raises
within the group's timeout (gloo honours it for send and receive). The group is built on every rank
at construction, or passed in to share one among boundaries. NCCL ignores tags and completes a batch
as a whole, so there a mismatched call is not caught by the headers first: it surfaces as NCCL's own
error or the timeout (untested: this machine has no GPU).

Asynchronous sends. With ``async_sends=True`` a rank that only sends in a call's crossing round (a
source-only rank in forward, a destination-only rank in backward) posts the crossing's payloads and
headers and returns without waiting for them; the handles and their buffers stay with the boundary
until ``wait_sends()``, which the caller makes once per step (e.g. before the optimizer step) and
which raises any failed send as a ``BoundaryError``. Receives still block, and rounds that both send
and receive on a rank (completion among replicas, colocated ranks) still wait. This lets the two
sides call in different orders, as the stages of a 1F1B pipeline do (the source runs F0 F1 B0 F2 ..,
the destination F0 B0 F1 B1 ..): with waited sends a source sending F1 while the destination sends
B0 would deadlock on a transport that does not buffer (gloo's sends wait for the receive, measured).
NCCL runs a group's operations in order on one stream, so there a posted send can still hold up the
receives after it; whether 1F1B orders complete on NCCL is untested (no GPU on this machine).
Until ``wait_sends()`` the source's ``x`` must not be changed in place (its shard may be sent
straight from it) and the boundary must stay alive (on gloo a dropped handle cancels its send,
measured). Pairing checks and byte counters are the same either way (bytes are counted when
the sends are posted).

Bytes are counted per rank and direction, split into cross-module (sent between different processes
across the boundary), intra-module (completion within replica groups: exactly the bytes each rank
puts on or takes off the wire, i.e. (n-1)/n of a piece per member for an all-gather of n) and local
copies (no wire); headers apart. ``counters()`` returns them as a dict.
"""

from __future__ import annotations

import functools
import re
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Literal, Mapping, Sequence

import torch
import torch.distributed as dist

from hetero.errors import ConfigError
from hetero.parallel.boundary_plan import (
    SUPPORTED_DTYPES,
    Block,
    Entry,
    Messages,
    Piece,
    RankPlan,
    Sharding,
    Side,
    TensorSpec,
    check_global_shape,
    keep_keys,
    merge_messages,
    rank_plan,
)
from hetero.parallel.layout import Layout

__all__ = ["Boundary", "BoundaryError", "Sharding", "Side", "TensorSpec", "Transfer"]

Direction = Literal["forward", "backward"]
Shape = Sequence[int]
TensorOrDict = torch.Tensor | Mapping[str, torch.Tensor]
SINGLE_KEY = "tensor"  # the key of a boundary built for one tensor rather than a dict
HEADER_MAGIC = 0x6865746572  # "heter"
HEADER_TAG = 1  # call headers of every boundary share this tag: a call to another boundary is named
NAME_BYTES = 64  # a boundary's name travels in its call header, cut to this many bytes
DIRECTIONS: tuple[Direction, ...] = ("forward", "backward")
COUNTER_KINDS = (
    "calls",
    "rounds",
    "cross_sent_bytes",
    "cross_recv_bytes",
    "intra_sent_bytes",
    "intra_recv_bytes",
    "local_copy_bytes",
    "header_sent_bytes",
    "header_recv_bytes",
)


class BoundaryError(RuntimeError):
    """A boundary call failed: mismatched calls on the two sides, a dead peer, or a timeout."""


@dataclass
class Transfer:
    """One forward call's result on this rank: the destination shard(s) and what backward needs."""

    output: torch.Tensor | dict[str, torch.Tensor] | None
    plan: RankPlan | None  # None on ranks that take no part


@dataclass
class _Message:
    peer: int
    buffer: torch.Tensor
    kind: Literal["cross", "intra", "header"]
    tag: int


@dataclass
class _PostedSends:
    """A round of sends posted and not yet waited: its messages keep their buffers alive."""

    direction: Direction
    call: int
    started: float
    messages: list[_Message]
    works: list[dist.Work]


@dataclass
class _Header:
    """What one call tells its peers: ``call`` has a fixed length on every boundary (magic, digest,
    direction, call number, name), so any boundary's header fits any receiver; ``shapes`` (per
    tensor: dtype code, global shape) travels on the boundary's own tag and is read only once the
    call header matched."""

    call: torch.Tensor
    shapes: torch.Tensor


class Boundary:
    """Moves tensors from the source layout to the destination layout and gradients back.

    Construct it on every rank of the world, in the same order as every other boundary and group:
    it creates its process group there. ``tensors`` is one ``TensorSpec`` or a dict of them. With
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
        self.specs: dict[str, TensorSpec] = (
            {SINGLE_KEY: tensors} if isinstance(tensors, TensorSpec) else dict(tensors)
        )
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
        self.group = self._link_group(group, timeout_s)
        self.digest = _tag(
            repr((name, self.source, self.destination, list(self.specs.items()), exchange_shapes))
        )
        self._plans: OrderedDict[tuple, RankPlan] = OrderedDict()
        self._plan_cache_size = plan_cache_size
        self._calls = dict.fromkeys(DIRECTIONS, 0)
        self._posted: list[_PostedSends] = []
        self._counters: dict[str, int] = {}
        self.reset_counters()

    def _link_group(self, group: dist.ProcessGroup | None, timeout_s: float) -> dist.ProcessGroup:
        """The group every message of this boundary travels on: given (shared), or built here."""
        members = sorted(set(self.source.layout.ranks) | set(self.destination.layout.ranks))
        if group is None:
            # Built on every rank, member or not: a group created on only some ranks hangs the others.
            return dist.new_group(members, timeout=timedelta(seconds=timeout_s))
        missing = (
            sorted(set(members) - set(dist.get_process_group_ranks(group))) if self.rank in members else []
        )
        if missing:
            raise ConfigError(
                f"boundary {self.name!r}: the group passed lacks ranks {missing} of its modules; pass a "
                f"group holding ranks {members} (or none, and the boundary builds one)"
            )
        return group

    # ----------------------------------------------------------------------------------- public API

    def __call__(
        self, x: TensorOrDict | None, shape: Shape | Mapping[str, Shape] | None = None
    ) -> torch.Tensor | dict[str, torch.Tensor] | None:
        """Forward with autograd. Destination ranks get their shard(s); gradients flow back on backward.

        Source-only ranks get a scalar token instead: ``token.backward()`` takes part in the backward
        exchange. Ranks outside both active stages get None. Integer tensors carry no gradient.
        """
        if not (self.is_source or self.is_destination):
            return None
        xs = self._as_dict(x, "x") if self.is_source else {}
        keys = tuple(xs)
        anchor = torch.zeros((), requires_grad=True)  # keeps the node in the graph on destination-only ranks
        outputs = _BoundaryFunction.apply(self, shape, keys, anchor, *(xs[k] for k in keys))
        if not self.is_destination:
            return outputs[0]
        return self._unwrap(dict(zip(self.specs, outputs)))

    def forward(self, x: TensorOrDict | None, shape: Shape | Mapping[str, Shape] | None = None) -> Transfer:
        """Deliver ``x`` (source ranks; None elsewhere) to the destination layout, without autograd."""
        if not (self.is_source or self.is_destination):
            return Transfer(None, None)
        xs = self._as_dict(x, "x") if self.is_source else None
        plan, out = self._forward(xs, shape)
        return Transfer(self._unwrap(out), plan)

    def backward(
        self, transfer: Transfer, grad: TensorOrDict | None
    ) -> torch.Tensor | dict[str, torch.Tensor] | None:
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

        Raises ``BoundaryError`` naming the call, the direction and the peer of a send that failed.
        """
        while self._posted:
            posted = self._posted.pop(0)
            for message, work in zip(posted.messages, posted.works):
                self._wait(work, message, False, posted.direction, posted.call, posted.started)

    def counters(self) -> dict[str, int]:
        """This rank's counters, e.g. ``forward.cross_sent_bytes``, summed over calls since the reset."""
        return dict(self._counters)

    def reset_counters(self) -> None:
        self._counters = {f"{d}.{kind}": 0 for d in DIRECTIONS for kind in COUNTER_KINDS}

    def plan(self, shape: Shape | Mapping[str, Shape]) -> RankPlan:
        """This rank's plan for one shape signature, from the cache when it was seen before."""
        return self._plan(self._shape_dict(shape))

    def _plan(self, shapes: dict[str, tuple[int, ...]]) -> RankPlan:
        key = tuple(shapes.items())
        cached = self._plans.get(key)
        if cached is not None:
            self._plans.move_to_end(key)
            return cached
        for k, spec in self.specs.items():
            check_global_shape(shapes[k], spec, self.source, self.destination, self._what(k))
        plan = rank_plan(self.rank, shapes, self.specs, self.source, self.destination)
        self._plans[key] = plan
        if len(self._plans) > self._plan_cache_size:
            self._plans.popitem(last=False)
        return plan

    # ------------------------------------------------------------------------------------- forward

    def _forward(
        self, xs: dict[str, torch.Tensor] | None, shape: Shape | Mapping[str, Shape] | None
    ) -> tuple[RankPlan, dict[str, torch.Tensor]]:
        call = self._start("forward")
        learns_shapes = self.exchange_shapes and not self.is_source
        if learns_shapes:
            shapes = self._receive_shapes(call, shape)
        elif shape is None:
            raise ValueError(
                f"boundary {self.name!r}: rank {self.rank} ({self._role(self.rank)}) called forward without "
                f"the global shape; pass shape= (or build the boundary with exchange_shapes=True so "
                f"destination ranks learn it from the source)"
            )
        else:
            shapes = self._shape_dict(shape)
        plan = self._plan(shapes)
        if xs is not None:
            self._check_tensors(xs, plan, plan.src_shapes, "source", "x")
        tag = self._payload_tag("forward", call, plan)
        header = self._header("forward", call, plan.shapes)
        header_to, header_from = set(plan.cross_out), set(plan.cross_in)
        if self.exchange_shapes and self.is_source:
            header_to |= self._listeners_of(self.rank)
        if learns_shapes:
            header_from.discard(self._partner())  # its headers already came with the shapes
        pieces = {p.index: self._empty(p.numel, p.key) for p in plan.received}
        values = _Values.packed_from(xs or {}, "src")
        arriving = self._crossing(
            "forward", call, tag, plan.cross_out, plan.cross_in, values, header, header_to, header_from
        )
        out = {
            k: torch.empty(s, dtype=self.specs[k].dtype, device=self.device)
            for k, s in plan.dst_shapes.items()
        }
        for piece in plan.local_copies:
            _copy_blocks(xs[piece.key], out[piece.key], piece)  # type: ignore[index]
            self._count("forward", "local_copy_bytes", piece.numel * piece.dtype.itemsize)
        for peer, entries in plan.cross_in.items():
            _unpack(arriving[peer], entries, _store(pieces))
        # Receivers that are replicas of one another complete their pieces (an all-gather).
        self._exchange("forward", call, tag, plan.dest_out, plan.dest_in, _Values(pieces), _store(pieces))
        for piece in plan.received:
            _scatter_blocks(pieces[piece.index], out[piece.key], piece, "dst")
        return plan, out

    def _receive_shapes(
        self, call: int, given: Shape | Mapping[str, Shape] | None
    ) -> dict[str, tuple[int, ...]]:
        """Learn the call's shapes from this destination-only rank's partner source rank."""
        partner = self._partner()
        expected, header = self._header("forward", call, {}), self._empty_header()
        check = functools.partial(self._check_header, got=header, expected=expected, check_shapes=False)
        self._round("forward", call, [], self._header_messages(partner, header), check)
        shapes = self._decode_shapes(header.shapes)
        if given is not None and self._shape_dict(given) != shapes:
            raise BoundaryError(
                f"boundary {self.name!r}: forward call #{call}: destination rank {self.rank} passed shapes "
                f"{self._shape_dict(given)} but source rank {partner} sent {shapes}"
            )
        return shapes

    # ------------------------------------------------------------------------------------ backward

    def _backward(self, plan: RankPlan, given: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        call = self._start("backward")
        plan = keep_keys(plan, {k for k, spec in self.specs.items() if spec.differentiable})
        grads = {k: self._grad_or_zeros(given.get(k), k, s) for k, s in plan.dst_shapes.items()}
        self._check_tensors(grads, plan, plan.dst_shapes, "destination", "grad")
        tag = self._payload_tag("backward", call, plan)
        mine = {p.index: _gather_blocks(grads[p.key], p, "dst") for p in plan.received + plan.local_copies}
        # Per piece: a receiver's sum over its own range; a sender's sum over its own range.
        reduced = {p.index: _part(mine[p.index], p.receiver_range(self.rank)).clone() for p in plan.received}
        sums = {p.index: self._zeros(_length(p.sender_range(self.rank)), p.key) for p in plan.sent}
        for piece in plan.local_copies:  # a local copy's rank is one of the piece's senders
            sums[piece.index] += _part(mine[piece.index], piece.sender_range(self.rank))
        accumulate = self._accumulate(reduced, sums)

        # Round 1, inside each module: receivers reduce-scatter; local copies hand their parts to senders.
        out, into = merge_messages(plan.dest_in, plan.local_out), merge_messages(plan.dest_out, plan.local_in)
        self._exchange("backward", call, tag, out, into, _Values(mine), accumulate)
        # Round 2, across: receivers send their sums back to the senders of their segments.
        header = self._header("backward", call, plan.shapes)
        arriving = self._crossing(
            "backward",
            call,
            tag,
            plan.cross_in,
            plan.cross_out,
            _OwnRange(reduced, self.rank),
            header,
            set(plan.cross_in),
            set(plan.cross_out),
        )
        for peer, entries in plan.cross_out.items():
            _unpack(arriving[peer], entries, accumulate)
        # Round 3, inside the source: sender replicas all-gather their sums.
        full = {p.index: self._empty(p.numel, p.key) for p in plan.sent}
        for piece in plan.sent:
            _part(full[piece.index], piece.sender_range(self.rank)).copy_(sums[piece.index])
        self._exchange("backward", call, tag, plan.src_out, plan.src_in, _Values(full), _store(full))
        result = {
            k: torch.zeros(s, dtype=self.specs[k].dtype, device=self.device)
            for k, s in plan.src_shapes.items()
        }
        for piece in plan.sent:
            _scatter_blocks(full[piece.index], result[piece.key], piece, "src")
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

    # ------------------------------------------------------------------------------ communication

    def _crossing(
        self,
        direction: Direction,
        call: int,
        tag: int,
        out: Messages,
        into: Messages,
        values: _Values | _OwnRange,
        header: _Header,
        header_to: set[int],
        header_from: set[int],
    ) -> dict[int, torch.Tensor]:
        """The round across the boundary, with the pairing headers on its links; returns what arrived.

        Payload receives are posted together with the header receives, not after the check: their
        tag encodes the call's signature, so only a matching call's payload can land in them. With
        ``async_sends`` a rank that only sends here leaves its sends to ``wait_sends``.
        """
        arriving = {peer: self._buffer(entries) for peer, entries in into.items()}
        sends = [_Message(peer, self._pack(entries, values), "cross", tag) for peer, entries in out.items()]
        sends += [m for peer in sorted(header_to) for m in self._header_messages(peer, header)]
        headers = {peer: self._empty_header() for peer in sorted(header_from)}
        recvs = [m for peer, h in headers.items() for m in self._header_messages(peer, h)]
        recvs += [_Message(peer, buffer, "cross", tag) for peer, buffer in arriving.items()]
        self._round(
            direction,
            call,
            sends,
            recvs,
            lambda m: self._check_header(m, headers[m.peer], header),
            defer=self.async_sends,
        )
        return arriving

    def _exchange(
        self,
        direction: Direction,
        call: int,
        tag: int,
        out: Messages,
        into: Messages,
        values: _Values,
        sink: Callable[[Entry, torch.Tensor], None],
    ) -> None:
        """One round inside a module: send ``out`` entries, receive ``into`` entries into ``sink``."""
        buffers = {peer: self._buffer(entries) for peer, entries in into.items()}
        sends = [_Message(peer, self._pack(entries, values), "intra", tag) for peer, entries in out.items()]
        recvs = [_Message(peer, buffer, "intra", tag) for peer, buffer in buffers.items()]
        self._round(direction, call, sends, recvs)
        for peer, entries in into.items():
            _unpack(buffers[peer], entries, sink)

    def _round(
        self,
        direction: Direction,
        call: int,
        sends: list[_Message],
        recvs: list[_Message],
        on_header: Callable[[_Message], None] | None = None,
        defer: bool = False,
    ) -> None:
        """Post one round's messages as one batch; each header received goes to ``on_header`` first.

        With ``defer``, a round that only sends returns once posted; ``wait_sends`` waits for it.
        """
        if not sends and not recvs:
            return
        ops = [self._op(dist.isend, m) for m in sends] + [self._op(dist.irecv, m) for m in recvs]
        works = dist.batch_isend_irecv(ops)
        self._count(direction, "rounds", 1)
        started = time.monotonic()
        if defer and not recvs:
            self._posted.append(_PostedSends(direction, call, started, sends, works))
        else:
            posted = list(zip(sends + recvs, [False] * len(sends) + [True] * len(recvs), works))
            # Call headers first, then shape headers, then the rest: the most telling mismatch is raised.
            for message, is_recv, work in sorted(posted, key=lambda item: _wait_order(*item[:2])):
                self._wait(work, message, is_recv, direction, call, started)
                if is_recv and message.kind == "header" and on_header is not None:
                    on_header(message)
        for messages, side in ((sends, "sent"), (recvs, "recv")):
            for message in messages:
                nbytes = message.buffer.numel() * message.buffer.element_size()
                self._count(direction, f"{message.kind}_{side}_bytes", nbytes)

    def _header_messages(self, peer: int, header: _Header) -> list[_Message]:
        return [
            _Message(peer, header.call, "header", HEADER_TAG),
            _Message(peer, header.shapes, "header", self.digest),
        ]

    def _op(self, op: Callable, message: _Message) -> dist.P2POp:
        return dist.P2POp(op, message.buffer, message.peer, self.group, tag=message.tag)

    def _wait(
        self,
        work: dist.Work,
        message: _Message,
        is_recv: bool,
        direction: Direction,
        call: int,
        started: float,
    ) -> None:
        try:
            work.wait()
        except RuntimeError as error:
            cause = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip().splitlines()[0])
            action = "receiving from" if is_recv else "sending to"
            raise BoundaryError(
                f"boundary {self.name!r}: {direction} call #{call}: rank {self.rank} "
                f"({self._role(self.rank)}) failed {action} rank {message.peer} ({self._role(message.peer)}) "
                f"after {time.monotonic() - started:.1f} s (timeout {self.timeout_s:g} s): {cause}. The peer "
                f"is dead or stuck, or the two sides made different calls (another boundary, another shape, "
                f"or a call made on one side only)"
            ) from error

    # ------------------------------------------------------------------------------------ headers

    def _header(self, direction: Direction, call: int, shapes: Mapping[str, Shape]) -> _Header:
        name = self.name.encode()[:NAME_BYTES].ljust(NAME_BYTES, b"\0")
        words = [HEADER_MAGIC, self.digest, DIRECTIONS.index(direction), call]
        call_words = torch.cat([torch.tensor(words), torch.frombuffer(bytearray(name), dtype=torch.int64)])
        shape_words = []
        for key, spec in self.specs.items():
            shape_words += [SUPPORTED_DTYPES.index(spec.dtype), *shapes.get(key, (0,) * spec.ndim)]
        return _Header(
            call_words.to(self.device), torch.tensor(shape_words, dtype=torch.int64, device=self.device)
        )

    def _empty_header(self) -> _Header:
        return _Header(
            torch.empty(4 + NAME_BYTES // 8, dtype=torch.int64, device=self.device),
            torch.empty(
                sum(1 + spec.ndim for spec in self.specs.values()), dtype=torch.int64, device=self.device
            ),
        )

    def _decode_shapes(self, words: torch.Tensor) -> dict[str, tuple[int, ...]]:
        values, shapes, at = words.tolist(), {}, 0
        for key, spec in self.specs.items():
            shapes[key] = tuple(values[at + 1 : at + 1 + spec.ndim])
            at += 1 + spec.ndim
        return shapes

    def _check_header(
        self, message: _Message, got: _Header, expected: _Header, check_shapes: bool = True
    ) -> None:
        """Raise when a peer's header differs from this rank's call; the error names the difference."""
        if message.tag == HEADER_TAG:
            problem = self._call_problem(message.peer, got.call, expected.call)
        elif check_shapes and not torch.equal(got.shapes, expected.shapes):
            problem = (
                f"rank {message.peer} sent {self._describe(got.shapes)} but this rank expected "
                f"{self._describe(expected.shapes)}"
            )
        else:
            problem = None
        if problem is not None:
            direction, call = DIRECTIONS[int(expected.call[2])], int(expected.call[3])
            raise BoundaryError(
                f"boundary {self.name!r}: {direction} call #{call}: rank {self.rank} "
                f"({self._role(self.rank)}) and rank {message.peer} ({self._role(message.peer)}) "
                f"disagree: {problem}"
            )

    def _call_problem(self, peer: int, got: torch.Tensor, expected: torch.Tensor) -> str | None:
        """How a peer's call header differs from this rank's, or None when they match."""
        g, e = got.tolist(), expected.tolist()
        if g == e:
            return None
        if g[0] != HEADER_MAGIC:
            return f"rank {peer} sent something that is not a boundary header"
        their_name = got[4:].cpu().numpy().tobytes().rstrip(b"\0").decode(errors="replace")
        if their_name != self.name.encode()[:NAME_BYTES].decode(errors="replace"):
            return f"rank {peer} called boundary {their_name!r} while this rank called {self.name!r}"
        if g[1] != e[1]:
            return (
                f"rank {peer} built this boundary from another description (layouts, specs or "
                f"exchange_shapes); build it alike on every rank"
            )
        if g[2] != e[2]:
            return (
                f"rank {peer} made a {DIRECTIONS[g[2]]} call while this rank made a {DIRECTIONS[e[2]]} call"
            )
        return (
            f"rank {peer} is at {DIRECTIONS[g[2]]} call #{g[3]}, this rank at #{e[3]}: one side skipped or "
            f"repeated a call"
        )

    def _describe(self, words: torch.Tensor) -> str:
        values, parts, at = words.tolist(), [], 0
        for key, spec in self.specs.items():
            dtype = str(SUPPORTED_DTYPES[values[at]]).removeprefix("torch.")
            parts.append(f"{key!r} of shape {tuple(values[at + 1 : at + 1 + spec.ndim])} {dtype}")
            at += 1 + spec.ndim
        return ", ".join(parts)

    def _payload_tag(self, direction: Direction, call: int, plan: RankPlan) -> int:
        tag = _tag(f"{self.digest}|{direction}|{call}|{sorted(plan.shapes.items())}")
        return tag if tag != self.digest else tag + 1

    def _listeners(self) -> list[int]:
        """Destination ranks that are not source ranks: they learn shapes from a partner source."""
        return [r for r in self.destinations if r not in self.sources]

    def _partner(self) -> int:
        return self.sources[self._listeners().index(self.rank) % len(self.sources)]

    def _listeners_of(self, source: int) -> set[int]:
        index = self.sources.index(source)
        return {r for i, r in enumerate(self._listeners()) if i % len(self.sources) == index}

    # ------------------------------------------------------------------------------------- helpers

    def _start(self, direction: Direction) -> int:
        self._calls[direction] += 1
        self._count(direction, "calls", 1)
        return self._calls[direction]

    def _count(self, direction: Direction, kind: str, amount: int) -> None:
        self._counters[f"{direction}.{kind}"] += amount

    def _role(self, rank: int) -> str:
        roles = [
            name
            for name, ranks in (("source", self.sources), ("destination", self.destinations))
            if rank in ranks
        ]
        return "/".join(roles) or "inactive"

    def _what(self, key: str) -> str:
        return f"boundary {self.name!r} tensor {key!r}"

    def _as_dict(self, value: TensorOrDict | None, name: str) -> dict[str, torch.Tensor]:
        if value is None:
            raise ValueError(
                f"boundary {self.name!r}: rank {self.rank} ({self._role(self.rank)}) must pass {name}"
            )
        if self.single:
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"boundary {self.name!r} carries one tensor; pass {name} as a tensor")
            return {SINGLE_KEY: value}
        if not isinstance(value, Mapping):
            raise TypeError(
                f"boundary {self.name!r} carries tensors {list(self.specs)}; pass {name} as a dict"
            )
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
            raise ValueError(
                f"boundary {self.name!r}: shape= must give a shape for each of {list(self.specs)}"
            )
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

    def _buffer(self, entries: list[Entry]) -> torch.Tensor:
        nbytes = sum((e.stop - e.start) * e.piece.dtype.itemsize for e in entries)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    @staticmethod
    def _pack(entries: list[Entry], values: _Values | _OwnRange) -> torch.Tensor:
        chunks = [values(entry).contiguous().view(torch.uint8) for entry in entries]
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


class _Values:
    """An entry's values, from flat per-piece buffers; ``packed_from`` packs them from local tensors
    on first use (once per piece)."""

    def __init__(
        self, flat: dict[int, torch.Tensor], tensors: Mapping[str, torch.Tensor] | None = None, side: str = ""
    ):
        self.flat = flat
        self.tensors = tensors
        self.side = side

    @classmethod
    def packed_from(cls, tensors: Mapping[str, torch.Tensor], side: str) -> _Values:
        return cls({}, tensors, side)

    def __call__(self, entry: Entry) -> torch.Tensor:
        piece = entry.piece
        if piece.index not in self.flat:
            assert self.tensors is not None, "a buffer was not filled before its values were sent"
            self.flat[piece.index] = _gather_blocks(self.tensors[piece.key], piece, self.side)
        return self.flat[piece.index][entry.start : entry.stop]


class _OwnRange:
    """An entry's values from buffers that hold only this rank's receiver range of each piece."""

    def __init__(self, buffers: dict[int, torch.Tensor], rank: int):
        self.buffers = buffers
        self.rank = rank

    def __call__(self, entry: Entry) -> torch.Tensor:
        start = entry.piece.receiver_range(self.rank)[0]
        return self.buffers[entry.piece.index][entry.start - start : entry.stop - start]


class _BoundaryFunction(torch.autograd.Function):
    """Autograd around a boundary: forward is ``Boundary._forward``, backward ``Boundary._backward``."""

    @staticmethod
    def forward(
        ctx, boundary: Boundary, shape, keys: tuple[str, ...], anchor: torch.Tensor, *xs: torch.Tensor
    ):  # type: ignore[override]
        plan, out = boundary._forward(dict(zip(keys, xs)) if keys else None, shape)
        ctx.boundary, ctx.plan, ctx.keys = boundary, plan, keys
        if not boundary.is_destination:
            return (anchor.new_zeros(()),)
        outputs = tuple(out[k] for k in boundary.specs)
        ctx.mark_non_differentiable(
            *(t for t, s in zip(outputs, boundary.specs.values()) if not s.differentiable)
        )
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        boundary: Boundary = ctx.boundary
        given = dict(zip(boundary.specs, grads)) if boundary.is_destination else {}
        result = boundary._backward(ctx.plan, given)
        return (None, None, None, None, *(result.get(k) for k in ctx.keys))


# --------------------------------------------------------------------------------- block helpers


def _block_view(tensor: torch.Tensor, block: Block, side: str) -> torch.Tensor:
    view = tensor
    for dim, run in enumerate(block):
        start = run.src if side == "src" else run.dst
        if start != 0 or run.length != view.shape[dim]:
            view = view.narrow(dim, start, run.length)
    return view


def _gather_blocks(tensor: torch.Tensor, piece: Piece, side: str) -> torch.Tensor:
    """The piece's elements in their canonical flat order, read from one side's local tensor."""
    views = [_block_view(tensor, block, side).reshape(-1) for block in piece.blocks]
    return views[0] if len(views) == 1 else torch.cat(views)


def _scatter_blocks(flat: torch.Tensor, tensor: torch.Tensor, piece: Piece, side: str) -> None:
    """Write the piece's flat elements into one side's local tensor."""
    offset = 0
    for block in piece.blocks:
        view = _block_view(tensor, block, side)
        view.copy_(flat[offset : offset + view.numel()].view(view.shape))
        offset += view.numel()


def _copy_blocks(source: torch.Tensor, destination: torch.Tensor, piece: Piece) -> None:
    for block in piece.blocks:
        _block_view(destination, block, "dst").copy_(_block_view(source, block, "src"))


def _unpack(buffer: torch.Tensor, entries: list[Entry], sink: Callable[[Entry, torch.Tensor], None]) -> None:
    offset = 0
    for entry in entries:
        nbytes = (entry.stop - entry.start) * entry.piece.dtype.itemsize
        sink(entry, buffer[offset : offset + nbytes].view(entry.piece.dtype))
        offset += nbytes


def _store(buffers: dict[int, torch.Tensor]) -> Callable[[Entry, torch.Tensor], None]:
    def store(entry: Entry, values: torch.Tensor) -> None:
        buffers[entry.piece.index][entry.start : entry.stop].copy_(values)

    return store


def _part(flat: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    return flat[span[0] : span[1]]


def _length(span: tuple[int, int]) -> int:
    return span[1] - span[0]


def _tag(text: str) -> int:
    """A message tag from a text: 2 .. 2**31-1 (0 is torch's default, 1 is ``HEADER_TAG``)."""
    return 2 + zlib.crc32(text.encode()) % (2**31 - 2)


def _wait_order(message: _Message, is_recv: bool) -> int:
    if is_recv and message.kind == "header":
        return 0 if message.tag == HEADER_TAG else 1
    return 2


def _as_side(side: Side | Layout) -> Side:
    return side if isinstance(side, Side) else Side(side)
