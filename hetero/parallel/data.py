"""Data-parallel gradient synchronization behind a small pluggable interface.

A ``GradSync`` is built over a module's named parameters and called once per optimizer step, after every
microbatch's backward; it leaves every replica holding the sum of the replicas' gradients. The default
buckets gradients into flat buffers and all-reduces them over the module's dp×cp group (context-parallel
ranks hold different tokens of the same samples, so their gradients are summed too). Compressed syncs
(``hetero.parallel.compression``) implement the same interface. Bytes are counted here, in hetero's own
code, with the ring model of ``compression.collective``.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hetero.parallel.compression.collective import Collective, GroupCollective

Key = TypeVar("Key")


def local_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The gradient this rank holds for ``param`` (its shard, for a DTensor parameter)."""
    grad = param.grad
    if grad is None:
        return None
    return grad.to_local() if isinstance(grad, DTensor) else grad


def local_data(param: nn.Parameter) -> torch.Tensor:
    """The values this rank holds for ``param`` (its shard, for a DTensor), as a plain tensor sharing storage."""
    return param.data.to_local() if isinstance(param.data, DTensor) else param.data


def split_like(flat: torch.Tensor, like: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Consecutive views of ``flat`` shaped like each tensor of ``like``: the inverse of flattening them."""
    offset = 0
    for t in like:
        yield flat[offset : offset + t.numel()].view_as(t)
        offset += t.numel()


def bucketed(
    grads: Iterable[tuple[Key, torch.Tensor]], bucket_bytes: int
) -> Iterable[list[tuple[Key, torch.Tensor]]]:
    """Consecutive runs of ``grads`` of one dtype and at most ``bucket_bytes`` (or one larger tensor)."""
    bucket: list[tuple[Key, torch.Tensor]] = []
    size = 0
    for key, g in grads:
        nbytes = g.numel() * g.element_size()
        if bucket and (size + nbytes > bucket_bytes or g.dtype != bucket[0][1].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append((key, g))
        size += nbytes
    if bucket:
        yield bucket


class GradSync(Protocol):
    @property
    def bytes_sent(self) -> int: ...

    def sync(self) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class AllReduceGradSync:
    """Sum gradients over ``group`` in flat buckets of at most ``bucket_bytes`` (one dtype per bucket)."""

    def __init__(
        self,
        named_params: Iterable[tuple[str, nn.Parameter]],
        group: dist.ProcessGroup | Collective,
        bucket_bytes: int = 25 * 2**20,
    ):
        self.params = [p for _, p in named_params]
        self.comm = GroupCollective(group) if isinstance(group, dist.ProcessGroup) else group
        self.bucket_bytes = bucket_bytes

    @property
    def bytes_sent(self) -> int:
        return self.comm.bytes_sent

    def sync(self) -> None:
        grads = [(None, g) for g in (local_grad(p) for p in self.params) if g is not None]
        for bucket in bucketed(grads, self.bucket_bytes):
            flat = torch.cat([g.reshape(-1) for _, g in bucket])
            self.comm.all_reduce(flat)
            grads = [g for _, g in bucket]
            for g, piece in zip(grads, split_like(flat, grads)):
                g.copy_(piece)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
