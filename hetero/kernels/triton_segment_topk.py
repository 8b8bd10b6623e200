"""Triton kernel for segmented top-k with the error-feedback update, bitwise equal to ``segment_topk_torch``.

One program per segment loads ``grad`` and ``residual``, forms ``v = residual + grad``, finds the k-th
largest magnitude, keeps the entries above it plus the lowest-index entries equal to it (ties go to the
lower index), compacts the kept entries in index order with a cumulative sum, writes their values and
uint16 in-segment indices, and writes back ``residual`` with the kept entries zeroed: one pass over memory.

The k-th largest magnitude is found by a radix select on the bit patterns of ``|v|`` (for non-negative
floats the integer order is the float order), 31 counting passes over the segment held in registers
rather than a sort. Any segment size up to 65536 works; the segment is padded to a power of two in the
kernel, so it is cheapest when it is one. NaNs are ordered as the largest magnitudes, as torch does, but
NaNs with different payloads are not treated as equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hetero.kernels.formats import MAX_SEGMENT


@triton.jit
def _segment_topk_kernel(grad_ptr, residual_ptr, values_ptr, indices_ptr, segment, k, BLOCK: tl.constexpr):
    seg = tl.program_id(0).to(tl.int64)
    index = tl.arange(0, BLOCK)
    in_segment = index < segment
    offsets = seg * segment + index
    v = tl.load(residual_ptr + offsets, mask=in_segment, other=0.0) + tl.load(
        grad_ptr + offsets, mask=in_segment, other=0.0
    )
    # |v| as int32 bits, ordered like the magnitudes; padding lies below every real entry.
    magnitude = tl.where(in_segment, v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, -1)

    # The k-th largest magnitude: the largest t with at least k magnitudes >= t, built from the top bit down.
    threshold = tl.full([], 0, tl.int32)
    for bit in tl.static_range(30, -1, -1):
        candidate = threshold | (1 << bit)
        enough = tl.sum((magnitude >= candidate).to(tl.int32), axis=0) >= k
        threshold = tl.where(enough, candidate, threshold)

    above = magnitude > threshold
    tied = magnitude == threshold
    ties_kept = k - tl.sum(above.to(tl.int32), axis=0)
    keep = above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= ties_kept))
    slot = seg * k + tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(values_ptr + slot, v, mask=keep)
    tl.store(indices_ptr + slot, index.to(tl.uint16), mask=keep)
    tl.store(residual_ptr + offsets, tl.where(keep, 0.0, v), mask=in_segment)


def segment_topk_triton(
    grad: torch.Tensor, residual: torch.Tensor, k: int, segment: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Values (fp32, segments × k) and in-segment indices (uint16, segments × k); updates ``residual``.

    ``grad`` and ``residual`` are contiguous 1-D fp32 tensors whose length is a multiple of ``segment``
    (at most 65536), with ``0 < k <= segment``.
    """
    if not 0 < segment <= MAX_SEGMENT or grad.numel() % segment or not 0 < k <= segment:
        raise ValueError(f"need 0 < k={k} <= segment={segment} <= {MAX_SEGMENT} dividing {grad.numel()}")
    if not (grad.is_contiguous() and residual.is_contiguous()):
        raise ValueError("segment_topk_triton takes contiguous tensors")
    segments = grad.numel() // segment
    values = torch.empty(segments, k, dtype=torch.float32, device=grad.device)
    indices = torch.empty(segments, k, dtype=torch.uint16, device=grad.device)
    block = triton.next_power_of_2(segment)
    if segments:
        _segment_topk_kernel[(segments,)](
            grad, residual, values, indices, segment, k, BLOCK=block, num_warps=min(16, max(4, block // 256))
        )
    return values, indices
