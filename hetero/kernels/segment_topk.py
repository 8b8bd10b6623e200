"""Segmented top-k with the error-feedback residual update fused in.

The vector ``v = grad + residual`` is cut into segments of ``segment`` elements; in each segment the ``k``
entries of largest magnitude are kept (ties go to the lower index), their values and in-segment indices
(uint16, so segments hold at most 65536 elements) are returned, and ``residual`` becomes ``v`` with the
kept entries zeroed: what was not sent is carried to the next step. Selecting per segment keeps indices
short and the work parallel; the contraction ``||C(v) - v||^2 <= (1 - k/segment) ||v||^2`` holds per
segment and so for the whole vector. This torch code is the CPU path and the oracle of the Triton kernel.
"""

from __future__ import annotations

import torch

from hetero.kernels.dispatch import use_triton
from hetero.kernels.formats import MAX_SEGMENT


def segment_topk(
    grad: torch.Tensor, residual: torch.Tensor, k: int, segment: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Values (fp32, segments × k) and in-segment indices (uint16, segments × k); updates ``residual``."""
    _check(grad, residual, k, segment)
    if use_triton(grad):
        from hetero.kernels.triton_segment_topk import segment_topk_triton

        return segment_topk_triton(grad, residual, k, segment)
    return segment_topk_torch(grad, residual, k, segment)


def segment_topk_torch(
    grad: torch.Tensor, residual: torch.Tensor, k: int, segment: int
) -> tuple[torch.Tensor, torch.Tensor]:
    v = residual.add_(grad).view(-1, segment)
    indices = segment_topk_indices(v, k)
    values = v.gather(1, indices)
    v.scatter_(1, indices, 0.0)
    return values, indices.to(torch.uint16)


def segment_topk_indices(segments: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's ``k`` largest magnitudes' indices, ascending (int64). A stable descending sort on
    magnitude: equal magnitudes keep index order, so ties go to the lower index."""
    order = torch.sort(segments.abs(), dim=1, descending=True, stable=True).indices[:, :k]
    return order.sort(dim=1).values


def scatter_segments(values: torch.Tensor, indices: torch.Tensor, numel: int, segment: int) -> torch.Tensor:
    """The dense fp32 vector of length ``numel`` holding ``values`` at their segments' ``indices``."""
    dense = torch.zeros(numel // segment, segment, dtype=torch.float32, device=values.device)
    dense.scatter_(1, indices.long(), values)
    return dense.view(-1)


def _check(grad: torch.Tensor, residual: torch.Tensor, k: int, segment: int) -> None:
    if grad.dim() != 1 or grad.dtype != torch.float32 or residual.shape != grad.shape:
        raise ValueError("segment_topk takes 1-D fp32 grad and residual of the same length")
    if not 0 < segment <= MAX_SEGMENT or grad.numel() % segment:
        raise ValueError(f"length {grad.numel()} must be a multiple of the segment size {segment} (<= 65536)")
    if not 0 < k <= segment:
        raise ValueError(f"k={k} must be in 1..segment={segment}")
