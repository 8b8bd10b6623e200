"""Data-parallel gradient synchronization behind a small pluggable interface.

A ``GradSync`` is called once per optimizer step, after every microbatch's backward, with the module's
parameters; it leaves every replica holding the sum of the replicas' gradients. The default buckets
gradients into flat buffers and all-reduces them over the module's dp×cp group (context-parallel ranks
hold different tokens of the same samples, so their gradients are summed too). Compression plugs in by
implementing the same interface. Bytes are counted here, in hetero's own code, for metrics and benchmarks.
"""

from __future__ import annotations

from typing import Iterable, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def local_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The gradient this rank holds for ``param`` (its shard, for a DTensor parameter)."""
    grad = param.grad
    if grad is None:
        return None
    return grad.to_local() if isinstance(grad, DTensor) else grad


class GradSync(Protocol):
    bytes_sent: int

    def sync(self, params: Iterable[nn.Parameter]) -> None: ...


class AllReduceGradSync:
    """Sum gradients over ``group`` in flat buckets of at most ``bucket_bytes`` (one dtype per bucket)."""

    def __init__(self, group: dist.ProcessGroup, bucket_bytes: int = 25 * 2**20):
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.bytes_sent = 0  # payload handed to all-reduce, summed over calls

    def sync(self, params: Iterable[nn.Parameter]) -> None:
        grads = [g for g in (local_grad(p) for p in params) if g is not None]
        for bucket in self._buckets(grads):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=self.group)
            self.bytes_sent += flat.numel() * flat.element_size()
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def _buckets(self, grads: list[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
        bucket: list[torch.Tensor] = []
        size = 0
        for g in grads:
            nbytes = g.numel() * g.element_size()
            if bucket and (size + nbytes > self.bucket_bytes or g.dtype != bucket[0].dtype):
                yield bucket
                bucket, size = [], 0
            bucket.append(g)
            size += nbytes
        if bucket:
            yield bucket
