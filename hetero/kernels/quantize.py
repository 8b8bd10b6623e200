"""Block-wise symmetric integer quantization of a flat fp32 vector, with nibble packing for 4 bits.

Each block of ``block_size`` consecutive elements shares one scale, ``absmax / qmax`` stored in bf16 (the
range of fp32 in two bytes; gradients can be far below fp16's smallest normal). Codes are
``floor(x / scale + 0.5)`` clamped to ``[-qmax, qmax]`` (qmax 127 for 8 bits, 7 for 4 bits): 8-bit codes
are int8 bytes; 4-bit codes are stored as ``code + 8`` in a nibble, element ``2i`` in the low nibble of
byte ``i`` and element ``2i + 1`` in the high one. This torch code is the CPU path and the oracle of the
Triton kernels, which run instead on CUDA tensors.
"""

from __future__ import annotations

import torch

from hetero.kernels.dispatch import use_triton
from hetero.kernels.formats import SCALE_DTYPE, qmax


def quantize_blocks(x: torch.Tensor, bits: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8, packed) and per-block scales (bf16) of a 1-D fp32 ``x`` whose length divides into blocks."""
    _check(x, bits, block_size)
    if use_triton(x):
        from hetero.kernels.triton_quantize import quantize_blocks_triton

        return quantize_blocks_triton(x, bits, block_size)
    return quantize_blocks_torch(x, bits, block_size)


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    """The fp32 vector that ``codes`` and ``scales`` stand for."""
    if use_triton(codes):
        from hetero.kernels.triton_quantize import dequantize_blocks_triton

        return dequantize_blocks_triton(codes, scales, bits, block_size)
    return dequantize_blocks_torch(codes, scales, bits, block_size)


def quantize_blocks_torch(x: torch.Tensor, bits: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    limit = qmax(bits)
    blocks = x.view(-1, block_size)
    scales = (blocks.abs().amax(dim=1) / limit).to(SCALE_DTYPE)
    divisor = scales.float().unsqueeze(1)
    divisor = torch.where(divisor == 0, torch.ones_like(divisor), divisor)
    codes = torch.floor(blocks / divisor + 0.5).clamp_(-limit, limit).to(torch.int8).view(-1)
    if bits == 8:
        return codes.view(torch.uint8), scales
    nibbles = (codes + 8).to(torch.uint8).view(-1, 2)
    return nibbles[:, 0] | (nibbles[:, 1] << 4), scales


def dequantize_blocks_torch(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    qmax(bits)
    if bits == 8:
        values = codes.view(torch.int8).float()
    else:
        low = (codes & 0x0F).to(torch.int16) - 8
        high = (codes >> 4).to(torch.int16) - 8
        values = torch.stack([low, high], dim=1).view(-1).float()
    return (values.view(-1, block_size) * scales.float().unsqueeze(1)).view(-1)


def _check(x: torch.Tensor, bits: int, block_size: int) -> None:
    qmax(bits)
    if x.dim() != 1 or x.dtype != torch.float32:
        raise ValueError(f"quantize_blocks takes a 1-D fp32 tensor, got {tuple(x.shape)} {x.dtype}")
    if block_size % 2 or x.numel() % block_size:
        raise ValueError(f"length {x.numel()} must be a multiple of the (even) block size {block_size}")
