"""``torch.distributed`` calls under the names of the torch in use: 2.11 (the GPU image's) to 2.13 (the pin).

torch 2.13 renamed ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` to ``all_gather_single`` and
``reduce_scatter_single`` (the old names warn with a ``FutureWarning`` on every call); torch 2.11 and 2.12
have only the old names. Each function here looks its collective up on ``torch.distributed`` at call time,
so a wrapper installed there (``hetero.testing.comm_rules.Recorder``) still sees the call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None,
                      async_op: bool = False) -> dist.Work | None:
    """Every rank's ``input`` into ``output`` (concatenated along dim 0, in group-rank order)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM,
                          group: dist.ProcessGroup | None = None, async_op: bool = False) -> dist.Work | None:
    """``input`` reduced with ``op`` over the group; this rank's chunk of dim 0 into ``output``."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, op=op, group=group, async_op=async_op)
