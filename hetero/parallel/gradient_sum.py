"""A tensor every rank of a group uses in part, whose gradient each rank holds in part: identity forward,
the gradient summed over the group backward (Megatron's copy to the tensor-parallel region)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def summed(grad: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``grad`` summed over ``group`` (a copy)."""
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


class _SumGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return summed(grad, ctx.group), None


def sum_gradient(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` itself; backward, its gradient summed over ``group``."""
    return _SumGradient.apply(x, group)
