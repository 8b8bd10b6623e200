"""The rules NCCL enforces and gloo forgives, checked on what a multi-rank run actually posted.

Each rank records its point-to-point operations and its collectives through ``torch.distributed``'s
Python API (``Recorder``); after the run, ``check`` applies four rules to every rank's record:

1. **Pairing.** NCCL matches messages by order, not by tag: for every group and every ordered pair of
   ranks, the i-th send from a to b and the i-th receive at b from a must agree in dtype and element
   count, and each side must post as many as the other.
2. **First batched P2P.** When a member's first operation on a group is a ``batch_isend_irecv``, every
   member's first operation on that group must be one (NCCL builds the communicator in that call).
3. **Collectives.** Every member of a group issues the same collectives in the same order, with the
   same dtypes and sizes (object collectives and ``all_to_all_single`` by name only).
4. **Collectives across groups.** No two ranks issue two groups' collectives in opposite orders (a
   cycle among the collectives, each rank's issue order its edges): where communicators' kernels run
   one at a time (one stream, ``CUDA_DEVICE_MAX_CONNECTIONS=1``) such ranks wait for each other forever.
   A schedule that interleaves modules differently per rank must still keep this order.

Collectives that DTensor issues through functional collectives (tensor parallelism's redistributions)
do not pass through this API and are not recorded; they are symmetric by construction.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

P2P = ("send", "recv", "isend", "irecv")
SIZED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
         "reduce_scatter_single", "reduce_scatter", "broadcast", "reduce", "gather", "scatter")
UNSIZED = ("barrier", "all_to_all_single", "all_to_all", "all_gather_object", "broadcast_object_list",
           "gather_object", "scatter_object_list")


class CommRuleViolation(AssertionError):
    """A run posted traffic NCCL would hang or fail on; the message names each problem."""


@dataclass(frozen=True)
class Op:
    group: str
    kind: str  # "send", "recv", or a collective's name
    peer: int | None  # the other rank of a send or receive (global)
    dtype: str
    numel: int
    batch: int | None = None  # which of this rank's batch_isend_irecv calls posted it


class Recorder:
    """Wraps the ``torch.distributed`` functions in this process to log every call (``install``)."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.ops: list[Op] = []
        self.members: dict[str, tuple[int, ...]] = {}
        self._batches = 0
        self._inside = threading.local()
        self._originals: dict[str, object] = {}

    def install(self) -> None:
        for name in P2P + SIZED + UNSIZED + ("batch_isend_irecv",):
            original = getattr(distributed_c10d, name, None)
            if original is None:
                continue
            self._originals[name] = original
            wrapper = self._batched(original) if name == "batch_isend_irecv" else self._wrap(name, original)
            setattr(distributed_c10d, name, wrapper)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapper)

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            if getattr(dist, name, None) is getattr(distributed_c10d, name):
                setattr(dist, name, original)
            setattr(distributed_c10d, name, original)

    def _group(self, group) -> str:
        group = group or dist.group.WORLD
        name = group.group_name
        if name not in self.members:
            self.members[name] = tuple(dist.get_process_group_ranks(group))
        return name

    def _wrap(self, name: str, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            if getattr(self._inside, "call", False):  # called by another recorded call (recv by irecv, ...)
                return original(*args, **kwargs)
            self.ops.append(self._describe(name, signature.bind(*args, **kwargs).arguments))
            self._inside.call = True
            try:
                return original(*args, **kwargs)
            finally:
                self._inside.call = False

        return recorded

    def _describe(self, name: str, arguments: dict) -> Op:
        group = arguments.get("group")
        group_name = self._group(group)
        if name in P2P:
            tensor = arguments["tensor"]
            peer = arguments.get("dst", arguments.get("src"))
            local = arguments.get("group_dst", arguments.get("group_src"))
            if local is not None:
                peer = dist.get_global_rank(group or dist.group.WORLD, local)
            kind = "send" if name in ("send", "isend") else "recv"
            return Op(group_name, kind, peer, str(tensor.dtype), tensor.numel())
        tensor = next((arguments[key] for key in ("input_tensor", "input", "tensor")
                       if isinstance(arguments.get(key), torch.Tensor)), None)
        if name in UNSIZED or tensor is None:
            return Op(group_name, name, None, "", 0)
        return Op(group_name, name, None, str(tensor.dtype), tensor.numel())

    def _batched(self, original):
        @functools.wraps(original)
        def recorded(p2p_op_list):
            batch, self._batches = self._batches, self._batches + 1
            for op in p2p_op_list:
                kind = "send" if op.op.__name__ == "isend" else "recv"
                self.ops.append(Op(self._group(op.group), kind, op.peer, str(op.tensor.dtype), op.tensor.numel(), batch))
            self._inside.call = True
            try:
                return original(p2p_op_list)
            finally:
                self._inside.call = False

        return recorded

    def record(self) -> tuple[list[Op], dict[str, tuple[int, ...]]]:
        return self.ops, self.members


def check(records: list[tuple[list[Op], dict[str, tuple[int, ...]]]], limit: int = 8) -> None:
    """Raise ``CommRuleViolation`` naming up to ``limit`` problems in the ranks' records (rank order)."""
    problems = _pairing(records) + _first_batches(records) + _collectives(records) + _cross_group_order(records)
    if problems:
        shown = "\n".join(problems[:limit]) + (f"\n... and {len(problems) - limit} more" if len(problems) > limit else "")
        raise CommRuleViolation(f"traffic NCCL would not accept ({len(problems)} problems):\n{shown}")


def _pairing(records) -> list[str]:
    sent, received = defaultdict(list), defaultdict(list)
    for rank, (ops, _) in enumerate(records):
        for op in ops:
            if op.kind == "send":
                sent[(op.group, rank, op.peer)].append(op)
            elif op.kind == "recv":
                received[(op.group, op.peer, rank)].append(op)
    problems = []
    for key in sorted(set(sent) | set(received), key=str):
        group, src, dst = key
        sends, recvs = sent.get(key, []), received.get(key, [])
        for i, (a, b) in enumerate(zip(sends, recvs)):
            if (a.dtype, a.numel) != (b.dtype, b.numel):
                problems.append(f"group {group}: send #{i} from rank {src} to rank {dst} is {a.numel} × {a.dtype}, "
                                f"but rank {dst}'s receive #{i} from rank {src} is {b.numel} × {b.dtype}")
                break
        if len(sends) != len(recvs):
            problems.append(f"group {group}: rank {src} sends {len(sends)} messages to rank {dst}, which receives "
                            f"{len(recvs)} from it")
    return problems


def _first_ops(records) -> dict[str, dict[int, Op | None]]:
    members: dict[str, tuple[int, ...]] = {}
    for _, groups in records:
        members.update(groups)
    firsts: dict[str, dict[int, Op | None]] = {}
    for group, ranks in members.items():
        firsts[group] = {}
        for rank in ranks:
            ops = records[rank][0] if rank < len(records) else []
            firsts[group][rank] = next((op for op in ops if op.group == group), None)
    return firsts


def _first_batches(records) -> list[str]:
    problems = []
    for group, firsts in _first_ops(records).items():
        batched = [rank for rank, op in firsts.items() if op is not None and op.batch is not None]
        if batched and len(batched) != len(firsts):
            others = {rank: ("nothing" if op is None else op.kind) for rank, op in firsts.items() if rank not in batched}
            problems.append(f"group {group} (ranks {list(firsts)}): ranks {batched} open it with a batched P2P, but "
                            f"the first operation of the others is {others}; every member must join that batch")
    return problems


def _collectives(records) -> list[str]:
    problems = []
    members: dict[str, tuple[int, ...]] = {}
    for _, groups in records:
        members.update(groups)
    for group, ranks in members.items():
        sequences = {rank: [(op.kind, op.dtype, op.numel) for op in records[rank][0]
                            if op.group == group and op.peer is None] for rank in ranks}
        first = ranks[0]
        for rank in ranks[1:]:
            a, b = sequences[first], sequences[rank]
            mismatch = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if mismatch is not None:
                problems.append(f"group {group}: collective #{mismatch} is {a[mismatch]} on rank {first} but "
                                f"{b[mismatch]} on rank {rank}")
            elif len(a) != len(b):
                problems.append(f"group {group}: rank {first} issues {len(a)} collectives, rank {rank} {len(b)}")
    return problems


def _cross_group_order(records) -> list[str]:
    """A cycle among the collectives (the k-th collective of a group one node; each rank's next
    collective on another group an edge), named by its nodes and the ranks that order them so."""
    successors: dict[tuple[str, int], dict[tuple[str, int], int]] = defaultdict(dict)
    for rank, (ops, _) in enumerate(records):
        counts: dict[str, int] = defaultdict(int)
        previous = None
        for op in ops:
            if op.peer is not None:
                continue
            node = (op.group, counts[op.group])
            counts[op.group] += 1
            if previous is not None and previous[0] != node[0]:
                successors[previous].setdefault(node, rank)
            previous = node
    state: dict[tuple[str, int], int] = {}  # 1 on the current path, 2 done
    for root in list(successors):
        if root in state:
            continue
        state[root], path, pending = 1, [root], [iter(successors[root])]
        while pending:  # depth first, without recursion: the chains run to thousands of collectives
            after = next(pending[-1], None)
            if after is None:
                state[path.pop()] = 2
                pending.pop()
            elif state.get(after) == 1:
                cycle = path[path.index(after):] + [after]
                steps = [f"collective #{a[1]} of group {a[0]} before #{b[1]} of group {b[0]} on rank {successors[a][b]}"
                         for a, b in zip(cycle, cycle[1:])]
                return ["ranks order collectives of different groups in a cycle: " + "; ".join(steps)]
            elif after not in state:
                state[after] = 1
                path.append(after)
                pending.append(iter(successors.get(after, {})))
    return []
