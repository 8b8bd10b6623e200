"""The wire formats the kernels share between their torch path and their Triton kernels: quantized
blocks (codes and bf16 scales) and top-k segments (uint16 indices)."""

from __future__ import annotations

import torch

SCALE_DTYPE = torch.bfloat16
MAX_SEGMENT = 2**16  # in-segment indices are uint16


def qmax(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"quantization bits must be 4 or 8, got {bits}")
    return 2 ** (bits - 1) - 1


def code_bytes(numel: int, bits: int) -> int:
    return numel * bits // 8
