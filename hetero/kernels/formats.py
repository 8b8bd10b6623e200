"""The wire formats the kernels share between their torch path and their Triton kernels: quantized
blocks (codes and bf16 scales) and top-k segments (uint16 indices)."""

from __future__ import annotations

import torch

SCALE_DTYPE = torch.bfloat16
MAX_SEGMENT = 2**16  # in-segment indices are uint16


FITTED_BITS = 2  # sign and one of two magnitudes fitted per block (``quantize``), not a symmetric grid


def qmax(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"quantization bits must be 4 or 8, got {bits}")
    return 2 ** (bits - 1) - 1


def scales_per_block(bits: int) -> int:
    """bf16 scales a block carries: two fitted magnitudes at 2 bits, else its absmax step."""
    return 2 if bits == FITTED_BITS else 1


def code_bytes(numel: int, bits: int) -> int:
    return numel * bits // 8
