"""The three collectives compressed exchanges use, with the bytes each puts on the wire counted.

Bytes follow the ring algorithms NCCL and gloo use for large messages: an all-reduce of ``B`` bytes sends
``2 (n-1)/n · B`` from every rank (reduce-scatter, then all-gather); an all-gather of ``B`` bytes from each
rank sends ``(n-1) · B``; an all-to-all of ``B`` bytes (``B/n`` to each peer) sends ``(n-1)/n · B``. The
fp32 all-reduce every ratio is measured against is counted the same way, so ratios compare like with like.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

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

    def all_reduce(self, tensor: torch.Tensor) -> None: ...

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def start_round(self) -> None:
        """Called before the collectives of one DiLoCo outer round."""

    def commit_round(self) -> bool:
        """Called after them: whether every replica completed the round (fault-tolerant groups may not)."""


class GroupCollective:
    """Collectives over a torch.distributed process group (gloo or NCCL)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.bytes_sent = 0

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the group, in place."""
        dist.all_reduce(tensor, group=self.group)
        self.bytes_sent += all_reduce_wire_bytes(_nbytes(tensor), self.size)

    def all_reduce_async(self, tensor: torch.Tensor) -> dist.Work:
        """Start summing ``tensor`` over the group in place; the sum is there once the work is waited on."""
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        self.bytes_sent += all_reduce_wire_bytes(_nbytes(tensor), self.size)
        return work

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` stacked along a new first dimension, in group-rank order."""
        out = torch.empty(self.size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        all_gather_single(out, tensor.reshape(-1).contiguous(), group=self.group)
        self.bytes_sent += all_gather_wire_bytes(_nbytes(tensor), self.size)
        return out.view(self.size, *tensor.shape)

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """Chunk ``i`` of the first dimension goes to group rank ``i``; chunk ``j`` of the result came from ``j``."""
        out = torch.empty_like(tensor)
        dist.all_to_all_single(out, tensor.contiguous(), group=self.group)
        self.bytes_sent += all_to_all_wire_bytes(_nbytes(tensor), self.size)
        return out


    def start_round(self) -> None:
        pass

    def commit_round(self) -> bool:
        return True  # a failed collective raises: the job stops rather than drop the round


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
