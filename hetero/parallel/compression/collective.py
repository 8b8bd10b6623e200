"""The three collectives compressed exchanges use, with the bytes each puts on the wire counted.

Bytes follow the ring algorithms NCCL and gloo use for large messages: an all-reduce of ``B`` bytes sends
``2 (n-1)/n · B`` from every rank (reduce-scatter, then all-gather); an all-gather of ``B`` bytes from each
rank sends ``(n-1) · B``; an all-to-all of ``B`` bytes (``B/n`` to each peer) sends ``(n-1)/n · B``. The
fp32 all-reduce every ratio is measured against is counted the same way, so ratios compare like with like.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
import torch.distributed as dist

from hetero.parallel.compression.background import PostingGate
from hetero.parallel.compression.link import LinkedWork, SimulatedLink
from hetero.parallel.torch_compat import all_gather_single


def all_reduce_wire_bytes(nbytes: int, size: int) -> int:
    return 2 * (size - 1) * nbytes // size


def all_gather_wire_bytes(nbytes: int, size: int) -> int:
    return (size - 1) * nbytes


def all_to_all_wire_bytes(nbytes: int, size: int) -> int:
    return (size - 1) * nbytes // size


class Collective(Protocol):
    """Sum, gather and exchange over one set of replicas; ``bytes_sent`` grows with every call."""

    size: int
    rank: int
    bytes_sent: int
    gate: PostingGate | None  # set by an overlapped DiLoCo: each collective is issued through it


    def all_reduce(self, tensor: torch.Tensor) -> None: ...

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def start_round(self) -> None:
        """Called before the collectives of one DiLoCo outer round."""

    def commit_round(self) -> bool:
        """Called after them: whether every replica completed the round (fault-tolerant groups may not)."""


class GroupCollective:
    """Collectives over a torch.distributed process group (gloo or NCCL), optionally over a ``SimulatedLink``."""

    def __init__(self, group: dist.ProcessGroup, link: SimulatedLink | None = None):
        self.group, self.link = group, link
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.bytes_sent = 0
        self.gate: PostingGate | None = None

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the group, in place."""
        with issuing(self.gate):
            work = dist.all_reduce(tensor, group=self.group, async_op=True)
        work.wait()
        self._sent(all_reduce_wire_bytes(_nbytes(tensor), self.size), wait=True)

    def all_reduce_async(self, tensor: torch.Tensor) -> dist.Work | LinkedWork:
        """Start summing ``tensor`` over the group in place; the sum is there once the work is waited on."""
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        arrives = self._sent(all_reduce_wire_bytes(_nbytes(tensor), self.size), wait=False)
        return work if self.link is None else LinkedWork(work, self.link, arrives)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` stacked along a new first dimension, in group-rank order."""
        out = torch.empty(self.size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        with issuing(self.gate):
            work = all_gather_single(out, tensor.reshape(-1).contiguous(), group=self.group, async_op=True)
        work.wait()
        self._sent(all_gather_wire_bytes(_nbytes(tensor), self.size), wait=True)
        return out.view(self.size, *tensor.shape)

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """Chunk ``i`` of the first dimension goes to group rank ``i``; chunk ``j`` of the result came from ``j``."""
        out = torch.empty_like(tensor)
        with issuing(self.gate):
            work = dist.all_to_all_single(out, tensor.contiguous(), group=self.group, async_op=True)
        work.wait()
        self._sent(all_to_all_wire_bytes(_nbytes(tensor), self.size), wait=True)
        return out

    def _sent(self, nbytes: int, wait: bool) -> float:
        """Count ``nbytes`` on the wire; on a simulated link, post them (and wait for them unless ``wait`` is off)."""
        self.bytes_sent += nbytes
        if self.link is None:
            return 0.0
        arrives = self.link.post(nbytes)
        if wait:
            self.link.wait(arrives)
        return arrives

    def start_round(self) -> None:
        pass

    def commit_round(self) -> bool:
        return True  # a failed collective raises: the job stops rather than drop the round


def issuing(gate: PostingGate | None) -> contextlib.AbstractContextManager:
    """Around issuing one collective: through ``gate`` where one is set (an overlapped DiLoCo round)."""
    return gate.posting() if gate is not None else contextlib.nullcontext()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
