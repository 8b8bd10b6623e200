"""Every rank agrees, before a step, that every rank has its batch.

A rank that reads only its own rows and images (``train.data.per_rank``), or builds its batches in
worker processes, can fail alone: an image whose header read but whose pixels do not, a worker that
died, a row only this rank holds that a module cannot take (the job checks each batch inside
``agreed``). Its partners would go on into the step and wait on it until the fault guard stops them.
Instead each rank builds its batch inside ``agreed``, which all-reduces one flag: when any rank failed, every
rank raises before the step's first message, the failing rank its own error and the others a
``DataError`` that names that rank and carries its message. One integer per step on the world's group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from hetero.data.sample_batches import DataError

T = TypeVar("T")


def agreed(build: Callable[[], T], device: torch.device, what: str) -> T:
    """``build()`` on every rank; raises on every rank when it raised on any (``what``: what was built)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    error: Exception | None = None
    try:
        result = build()
    except Exception as err:  # any rank's failure: its partners must not go on without it
        error = err
    first = torch.tensor([rank if error is not None else world], dtype=torch.long, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    failed = int(first.item())
    if failed == world:
        return result
    message = [f"{type(error).__name__}: {error}" if rank == failed else None]
    dist.broadcast_object_list(message, src=failed)
    if rank == failed:
        raise error
    raise DataError(f"rank {failed} could not build {what}, so no rank starts it: {message[0]}")
