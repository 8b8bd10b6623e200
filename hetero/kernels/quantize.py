"""Block-wise quantization of a flat fp32 vector: symmetric integers (8 and 4 bits, nibble-packed), or 2 bits
over two fitted magnitudes.

Each block of ``block_size`` consecutive elements shares one scale, ``absmax / qmax`` stored in bf16 (the
range of fp32 in two bytes; gradients can be far below fp16's smallest normal). Codes are
``floor(x / scale + 0.5)`` clamped to ``[-qmax, qmax]`` (qmax 127 for 8 bits, 7 for 4 bits): 8-bit codes
are int8 bytes; 4-bit codes are stored as ``code + 8`` in a nibble, element ``2i`` in the low nibble of
byte ``i`` and element ``2i + 1`` in the high one. This torch code is the CPU path and the oracle of the
Triton kernels, which run instead on CUDA tensors.

At 2 bits a block keeps each element's sign and one of two magnitudes fitted to the block (two rounds of
Lloyd's 1-D k-means on ``|x|``, started from a split at the mean magnitude), stored as two bf16 scales
(low, high); code ``2·high + negative``, element ``4i + j`` in bits ``2j .. 2j + 1`` of byte ``i``. It runs in
torch on any device.
"""

from __future__ import annotations

import torch

from hetero.kernels.dispatch import use_triton
from hetero.kernels.formats import FITTED_BITS, SCALE_DTYPE, qmax

LLOYD_ROUNDS = 2


def quantize_blocks(x: torch.Tensor, bits: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8, packed) and per-block scales (bf16) of a 1-D fp32 ``x`` whose length divides into blocks."""
    _check(x, bits, block_size)
    if bits == FITTED_BITS:
        return quantize_fitted(x, block_size)
    if use_triton(x):
        from hetero.kernels.triton_quantize import quantize_blocks_triton

        return quantize_blocks_triton(x, bits, block_size)
    return quantize_blocks_torch(x, bits, block_size)


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    """The fp32 vector that ``codes`` and ``scales`` stand for."""
    if bits == FITTED_BITS:
        return dequantize_fitted(codes, scales, block_size)
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


def quantize_fitted(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """2-bit codes (4 a byte) and (blocks, 2) bf16 magnitudes of ``x`` (the module docstring)."""
    blocks = x.view(-1, block_size)
    size = blocks.abs()
    split = size.mean(dim=1, keepdim=True)
    for _ in range(LLOYD_ROUNDS):
        high = size > split
        low_level = _mean_where(size, ~high)
        high_level = _mean_where(size, high)
        split = torch.where(high.any(dim=1, keepdim=True), (low_level + high_level) / 2, split)
    high = size > split
    levels = torch.cat([_mean_where(size, ~high), _mean_where(size, high)], dim=1).to(SCALE_DTYPE)
    codes = (high.to(torch.uint8) << 1 | (blocks < 0).to(torch.uint8)).view(-1, 4)
    return codes[:, 0] | codes[:, 1] << 2 | codes[:, 2] << 4 | codes[:, 3] << 6, levels


def dequantize_fitted(codes: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    fields = torch.stack([(codes >> shift) & 3 for shift in (0, 2, 4, 6)], dim=1).view(-1, block_size)
    levels = scales.view(-1, 2).float()
    magnitude = torch.where((fields >> 1).bool(), levels[:, 1:], levels[:, :1])
    return torch.where((fields & 1).bool(), -magnitude, magnitude).view(-1)


def _mean_where(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Each row's mean of ``values`` where ``where`` (0 where none), as a column."""
    count = where.sum(dim=1, keepdim=True)
    total = torch.where(where, values, torch.zeros_like(values)).sum(dim=1, keepdim=True)
    return total / count.clamp(min=1)


def _check(x: torch.Tensor, bits: int, block_size: int) -> None:
    if bits != FITTED_BITS:
        qmax(bits)
    if x.dim() != 1 or x.dtype != torch.float32:
        raise ValueError(f"quantize_blocks takes a 1-D fp32 tensor, got {tuple(x.shape)} {x.dtype}")
    packed = 4 if bits == FITTED_BITS else 2  # codes a byte
    if block_size % packed or x.numel() % block_size:
        raise ValueError(f"length {x.numel()} must be a multiple of the block size {block_size} (a multiple of {packed})")
