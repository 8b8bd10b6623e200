"""A boundary's messages on the wire: batched point-to-point rounds, pairing headers, errors, counters.

Every call sends, both ways on each crossing link, a call header (magic, the boundary's digest and name,
direction, per-direction call number: the same length for every boundary) and a shape header (dtype and
global shape per tensor, then the rows each side's DP replicas hold), in a batch of their own. Each side
checks what it got before it posts a payload and raises ``BoundaryError`` naming the boundary, both ranks
and the difference: another shape, a skipped call, a forward meeting a backward, or, on a shared group, a
call to another boundary (on separate groups that one shows up as the timeout). So both ends of a
mismatched call fail at once, and no payload of the wrong size is ever posted (gloo answers one by
aborting the process, measured; NCCL, which ignores tags and completes a batch as a whole, would hang).
Payloads also travel on a tag derived from the call's signature. A dead peer or a missing call raises
within the group's timeout (gloo honours it for send and receive).

A piece's elements (``boundary_plan.Piece``: blocks, each a dense sub-box of both sides' local tensors)
travel flattened block after block, row-major: the canonical order both sides derive alike; senders
gather them from their local tensor (``Values``), receivers scatter them into theirs.

Bytes are counted per direction, split into cross-module (between different processes across the
boundary), intra-module (completion within replica groups) and local copies (no wire); headers apart.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta
import zlib
from dataclasses import dataclass
from typing import Callable, Literal, Mapping, Sequence

import torch
import torch.distributed as dist

from hetero.parallel.boundary_plan import SUPPORTED_DTYPES, Block, Entry, Messages, Piece, TensorSpec

Direction = Literal["forward", "backward"]
DIRECTIONS: tuple[Direction, ...] = ("forward", "backward")
HEADER_MAGIC = 0x6865746572  # "heter"
HEADER_TAG = 1  # call headers of every boundary share this tag: a call to another boundary is named
OPEN_TAG = 0  # the group's opening round (Wire.open); payload tags are >= 2
NAME_BYTES = 64  # a boundary's name travels in its call header, cut to this many bytes
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
class Message:
    peer: int
    buffer: torch.Tensor
    kind: Literal["cross", "intra", "header"]
    tag: int


@dataclass
class PostedRound:
    """A round posted and not yet waited: its messages keep their buffers alive."""

    direction: Direction
    call: int
    started: float
    messages: list[Message]
    receives: list[bool]  # per message: a receive (else a send)
    works: list[dist.Work]
    on_header: Callable[[Message], None] | None


@dataclass
class Header:
    """What one call tells its peers: ``call`` has a fixed length on every boundary (magic, digest,
    direction, call number, name), so any boundary's header fits any receiver; ``shapes`` (per tensor:
    dtype code, global shape; then the DP rows of both sides) travels on the boundary's own tag and is
    read only once the call header matched."""

    call: torch.Tensor
    shapes: torch.Tensor


def message_tag(text: str) -> int:
    """A message tag from a text: 2 .. 2**31-1 (0 is torch's default, 1 is ``HEADER_TAG``)."""
    return 2 + zlib.crc32(text.encode()) % (2**31 - 2)


class Wire:
    """One boundary's traffic from this rank: rounds of batched P2P messages, headers, byte counters."""

    def __init__(
        self,
        name: str,
        digest: int,
        groups: Mapping[Direction, dist.ProcessGroup],
        specs: Mapping[str, TensorSpec],
        row_words: int,
        device: torch.device,
        timeout_s: float,
        role: Callable[[int], str],
    ) -> None:
        """``groups``: the group each direction's messages travel on (two groups let the two sides make
        their forward and backward calls in different orders, as a pipeline's stages do, while each
        link's messages stay in order per group, as NCCL pairs them). ``row_words``: how many int64
        words the DP rows of both sides take in the shape header."""
        self.name, self.digest, self.groups, self.specs = name, digest, dict(groups), dict(specs)
        self.row_words, self.device, self.timeout_s, self.role = row_words, device, timeout_s, role
        self.rank = dist.get_rank()
        self.posted: list[PostedRound] = []
        self.counters: dict[str, int] = {}
        self.reset_counters()

    def reset_counters(self) -> None:
        self.counters = {f"{d}.{kind}": 0 for d in DIRECTIONS for kind in COUNTER_KINDS}

    def open(self) -> None:
        """Every member of each link group passes one word to the next in one batch (call it on every
        member): NCCL needs a group's first batched P2P to include every member, and a boundary's own
        calls may involve only some of them."""
        for group in {id(g): g for g in self.groups.values()}.values():
            members = dist.get_process_group_ranks(group)
            if self.rank not in members or len(members) == 1:
                continue
            i, n = members.index(self.rank), len(members)
            token = torch.zeros(1, dtype=torch.int64, device=self.device)
            arrived = torch.empty(1, dtype=torch.int64, device=self.device)
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, token, members[(i + 1) % n], group, tag=OPEN_TAG),
                                            dist.P2POp(dist.irecv, arrived, members[(i - 1) % n], group, tag=OPEN_TAG)])
            for work in works:
                work.wait()

    def count(self, direction: Direction, kind: str, amount: int) -> None:
        self.counters[f"{direction}.{kind}"] += amount

    # ----------------------------------------------------------------------------------- rounds

    def crossing(
        self,
        direction: Direction,
        call: int,
        tag: int,
        out: Messages,
        into: Messages,
        values: Callable[[Entry], torch.Tensor],
        header: Header,
        header_to: set[int],
        header_from: set[int],
        defer: bool,
    ) -> dict[int, torch.Tensor]:
        """The round across the boundary after its pairing headers; returns what arrived.

        Headers go both ways on every link (``header_to`` and ``header_from`` hold each payload peer in
        either direction), in a batch of their own that each side waits for and checks before it posts
        a payload: both ends of a mismatched call raise, neither leaves a payload the other will never
        take, and NCCL (which pairs a link's messages by order and completes a batch as one) never meets
        two payloads of different sizes. With ``defer`` a rank that only sends payloads posts both
        batches and returns; ``wait_sends`` checks the headers that came back, then waits the payloads.
        Payload tags still encode the call's signature, for gloo."""
        sends = [m for peer in sorted(header_to) for m in self.header_messages(peer, header)]
        headers = {peer: self.empty_header() for peer in sorted(header_from)}
        recvs = [m for peer, h in headers.items() for m in self.header_messages(peer, h)]
        check = lambda m: self.check_header(m, headers[m.peer], header)  # noqa: E731
        send_only = defer and not into
        self.round(direction, call, sends, recvs, check, defer=send_only)
        arriving = {peer: self.buffer(entries) for peer, entries in into.items()}
        payloads = [Message(peer, pack(entries, values), "cross", tag) for peer, entries in out.items()]
        incoming = [Message(peer, buffer, "cross", tag) for peer, buffer in arriving.items()]
        self.round(direction, call, payloads, incoming, defer=send_only)
        return arriving

    def exchange(
        self,
        direction: Direction,
        call: int,
        tag: int,
        out: Messages,
        into: Messages,
        values: Callable[[Entry], torch.Tensor],
        sink: Callable[[Entry, torch.Tensor], None],
    ) -> None:
        """One round inside a module: send ``out`` entries, receive ``into`` entries into ``sink``."""
        buffers = {peer: self.buffer(entries) for peer, entries in into.items()}
        sends = [Message(peer, pack(entries, values), "intra", tag) for peer, entries in out.items()]
        recvs = [Message(peer, buffer, "intra", tag) for peer, buffer in buffers.items()]
        self.round(direction, call, sends, recvs)
        for peer, entries in into.items():
            unpack(buffers[peer], entries, sink)

    def round(
        self,
        direction: Direction,
        call: int,
        sends: list[Message],
        recvs: list[Message],
        on_header: Callable[[Message], None] | None = None,
        defer: bool = False,
    ) -> None:
        """Post one round's messages as one batch; each header received goes to ``on_header`` first.
        With ``defer`` the round returns once posted; ``wait_sends`` waits for it (and checks its headers)."""
        if not sends and not recvs:
            return
        group = self.groups[direction]
        ops = [dist.P2POp(dist.isend, m.buffer, m.peer, group, tag=m.tag) for m in sends]
        ops += [dist.P2POp(dist.irecv, m.buffer, m.peer, group, tag=m.tag) for m in recvs]
        works = dist.batch_isend_irecv(ops)
        self.count(direction, "rounds", 1)
        started = time.monotonic()
        posted = PostedRound(direction, call, started, sends + recvs, [False] * len(sends) + [True] * len(recvs),
                             works, on_header)
        if defer:
            self.posted.append(posted)
        else:
            self._wait_round(posted)
        for messages, side in ((sends, "sent"), (recvs, "recv")):
            for message in messages:
                self.count(direction, f"{message.kind}_{side}_bytes", message.buffer.numel() * message.buffer.element_size())

    def _wait_round(self, posted: PostedRound) -> None:
        # Call headers first, then shape headers, then the rest: the most telling mismatch is raised.
        # (On NCCL one work stands for the whole batch: waiting it waits them all.)
        items = sorted(zip(posted.messages, posted.receives, posted.works), key=lambda item: _wait_order(*item[:2]))
        for message, is_recv, work in items:
            self.wait(work, message, is_recv, posted.direction, posted.call, posted.started)
            if is_recv and message.kind == "header" and posted.on_header is not None:
                try:
                    posted.on_header(message)
                except BoundaryError:
                    self._deliver_sends(posted)  # so that the peer gets this rank's headers and fails too
                    raise

    def _deliver_sends(self, posted: PostedRound) -> None:
        """Let a round's header sends arrive before raising: on gloo a dropped send is cancelled, and the
        peer would wait out the timeout instead of reading why this rank gave up. A peer in the same call
        takes the call header; its shape header is waited for only briefly (a peer in another boundary's
        call posts its receive under another tag and never takes it)."""
        for message, is_recv, work in zip(posted.messages, posted.receives, posted.works):
            if not is_recv:
                try:
                    work.wait() if message.tag == HEADER_TAG else work.wait(timedelta(seconds=1))
                except RuntimeError:
                    pass  # the error being raised says more than a failed send

    def wait_sends(self) -> None:
        """Wait for every deferred round, oldest first; a failed one, or a header that came back from
        another call, raises ``BoundaryError``."""
        while self.posted:
            self._wait_round(self.posted.pop(0))

    def wait(self, work: dist.Work, message: Message, is_recv: bool, direction: Direction, call: int,
             started: float) -> None:
        try:
            work.wait()
        except RuntimeError as error:
            cause = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip().splitlines()[0])
            action = "receiving from" if is_recv else "sending to"
            raise BoundaryError(
                f"boundary {self.name!r}: {direction} call #{call}: rank {self.rank} "
                f"({self.role(self.rank)}) failed {action} rank {message.peer} ({self.role(message.peer)}) "
                f"after {time.monotonic() - started:.1f} s (timeout {self.timeout_s:g} s): {cause}. The peer "
                f"is dead or stuck, or the two sides made different calls (another boundary, another shape, "
                f"or a call made on one side only)"
            ) from error

    def buffer(self, entries: list[Entry]) -> torch.Tensor:
        nbytes = sum((e.stop - e.start) * e.piece.dtype.itemsize for e in entries)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    # ---------------------------------------------------------------------------------- headers

    def header(self, direction: Direction, call: int, shapes: Mapping[str, Sequence[int]],
               rows: Sequence[int]) -> Header:
        name = self.name.encode()[:NAME_BYTES].ljust(NAME_BYTES, b"\0")
        words = [HEADER_MAGIC, self.digest, DIRECTIONS.index(direction), call]
        call_words = torch.cat([torch.tensor(words, device="cpu"), torch.frombuffer(bytearray(name), dtype=torch.int64)])
        shape_words = []
        for key, spec in self.specs.items():
            shape_words += [SUPPORTED_DTYPES.index(spec.dtype), *shapes.get(key, (0,) * spec.ndim)]
        shape_words += list(rows)
        return Header(call_words.to(self.device), torch.tensor(shape_words, dtype=torch.int64, device=self.device))

    def empty_header(self) -> Header:
        shape_words = sum(1 + spec.ndim for spec in self.specs.values()) + self.row_words
        return Header(
            torch.empty(4 + NAME_BYTES // 8, dtype=torch.int64, device=self.device),
            torch.empty(shape_words, dtype=torch.int64, device=self.device),
        )

    def header_messages(self, peer: int, header: Header) -> list[Message]:
        return [Message(peer, header.call, "header", HEADER_TAG), Message(peer, header.shapes, "header", self.digest)]

    def decode(self, words: torch.Tensor) -> tuple[dict[str, tuple[int, ...]], tuple[int, ...]]:
        """The shapes and the DP rows words of a shape header."""
        values, shapes, at = words.tolist(), {}, 0
        for key, spec in self.specs.items():
            shapes[key] = tuple(values[at + 1 : at + 1 + spec.ndim])
            at += 1 + spec.ndim
        return shapes, tuple(values[at:])

    def check_header(self, message: Message, got: Header, expected: Header, check_shapes: bool = True) -> None:
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
                f"({self.role(self.rank)}) and rank {message.peer} ({self.role(message.peer)}) disagree: {problem}"
            )

    def _call_problem(self, peer: int, got: torch.Tensor, expected: torch.Tensor) -> str | None:
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
            return f"rank {peer} made a {DIRECTIONS[g[2]]} call while this rank made a {DIRECTIONS[e[2]]} call"
        return (
            f"rank {peer} is at {DIRECTIONS[g[2]]} call #{g[3]}, this rank at #{e[3]}: one side skipped or "
            f"repeated a call"
        )

    def _describe(self, words: torch.Tensor) -> str:
        shapes, rows = self.decode(words)
        values, parts, at = words.tolist(), [], 0
        for key, spec in self.specs.items():
            dtype = str(SUPPORTED_DTYPES[values[at]]).removeprefix("torch.")
            parts.append(f"{key!r} of shape {shapes[key]} {dtype}")
            at += 1 + spec.ndim
        if rows and rows[0] >= 0:
            parts.append(f"DP rows {list(rows)}")
        return ", ".join(parts)


def pack(entries: list[Entry], values: Callable[[Entry], torch.Tensor]) -> torch.Tensor:
    chunks = [values(entry).contiguous().view(torch.uint8) for entry in entries]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def unpack(buffer: torch.Tensor, entries: list[Entry], sink: Callable[[Entry, torch.Tensor], None]) -> None:
    offset = 0
    for entry in entries:
        nbytes = (entry.stop - entry.start) * entry.piece.dtype.itemsize
        sink(entry, buffer[offset : offset + nbytes].view(entry.piece.dtype))
        offset += nbytes


def _wait_order(message: Message, is_recv: bool) -> int:
    if is_recv and message.kind == "header":
        return 0 if message.tag == HEADER_TAG else 1
    return 2


# ----------------------------------------------------------------- pieces in local tensors


class Values:
    """An entry's values, from flat per-piece buffers; ``packed_from`` packs them from local tensors on
    first use (once per piece)."""

    def __init__(
        self, flat: dict[int, torch.Tensor], tensors: Mapping[str, torch.Tensor] | None = None, side: str = ""
    ):
        self.flat = flat
        self.tensors = tensors
        self.side = side

    @classmethod
    def packed_from(cls, tensors: Mapping[str, torch.Tensor], side: str) -> Values:
        return cls({}, tensors, side)

    def __call__(self, entry: Entry) -> torch.Tensor:
        piece = entry.piece
        if piece.index not in self.flat:
            assert self.tensors is not None, "a buffer was not filled before its values were sent"
            self.flat[piece.index] = gather_blocks(self.tensors[piece.key], piece, self.side)
        return self.flat[piece.index][entry.start : entry.stop]


class OwnRange:
    """An entry's values from buffers that hold only this rank's receiver range of each piece."""

    def __init__(self, buffers: dict[int, torch.Tensor], rank: int):
        self.buffers = buffers
        self.rank = rank

    def __call__(self, entry: Entry) -> torch.Tensor:
        start = entry.piece.receiver_range(self.rank)[0]
        return self.buffers[entry.piece.index][entry.start - start : entry.stop - start]


def block_view(tensor: torch.Tensor, block: Block, side: str) -> torch.Tensor:
    view = tensor
    for dim, run in enumerate(block):
        start = run.src if side == "src" else run.dst
        if start != 0 or run.length != view.shape[dim]:
            view = view.narrow(dim, start, run.length)
    return view


def gather_blocks(tensor: torch.Tensor, piece: Piece, side: str) -> torch.Tensor:
    """The piece's elements in their canonical flat order, read from one side's local tensor."""
    views = [block_view(tensor, block, side).reshape(-1) for block in piece.blocks]
    return views[0] if len(views) == 1 else torch.cat(views)


def scatter_blocks(flat: torch.Tensor, tensor: torch.Tensor, piece: Piece, side: str) -> None:
    """Write the piece's flat elements into one side's local tensor."""
    offset = 0
    for block in piece.blocks:
        view = block_view(tensor, block, side)
        view.copy_(flat[offset : offset + view.numel()].view(view.shape))
        offset += view.numel()


def copy_blocks(source: torch.Tensor, destination: torch.Tensor, piece: Piece) -> None:
    for block in piece.blocks:
        block_view(destination, block, "dst").copy_(block_view(source, block, "src"))


def store(buffers: dict[int, torch.Tensor]) -> Callable[[Entry, torch.Tensor], None]:
    def put(entry: Entry, values: torch.Tensor) -> None:
        buffers[entry.piece.index][entry.start : entry.stop].copy_(values)

    return put


def part(flat: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    return flat[span[0] : span[1]]


def length(span: tuple[int, int]) -> int:
    return span[1] - span[0]
