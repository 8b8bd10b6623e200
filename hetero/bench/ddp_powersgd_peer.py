"""The peer for PowerSGD: torch's own DDP communication hook, with its traffic counted.

The hook's collectives are plain ``torch.distributed.all_reduce`` calls, so the peer counts them by
wrapping that function in its own process (ring model of ``compression.collective``): what is counted is
what the hook actually sent, including the vanilla all-reduces of its warm-up iterations.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from hetero.parallel.compression.collective import all_reduce_wire_bytes


class AllReduceCounter:
    def __init__(self) -> None:
        self.bytes_sent = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        original = dist.all_reduce

        def counted(tensor, *args, **kwargs):
            group = kwargs.get("group") or (args[1] if len(args) > 1 else None)
            size = dist.get_world_size(group)
            self.bytes_sent += all_reduce_wire_bytes(tensor.numel() * tensor.element_size(), size)
            return original(tensor, *args, **kwargs)

        dist.all_reduce = counted
        try:
            yield
        finally:
            dist.all_reduce = original


def ddp_with_powersgd(model: nn.Module, rank: int, seed: int) -> DistributedDataParallel:
    """``model`` under DDP with torch's PowerSGD hook (error feedback and warm start on, as ours).

    The hook runs plain all-reduces for its first two iterations, the fewest it allows. DDP gets one bucket:
    the hook chains its all-reduces from future callbacks, so with several buckets in flight gloo can see
    them in different orders on different ranks and deadlock (observed here with two buckets).
    """
    ddp = DistributedDataParallel(model, bucket_cap_mb=1024)
    state = powerSGD_hook.PowerSGDState(
        process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2, random_seed=seed
    )
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp
