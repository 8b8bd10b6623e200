"""Triton kernels for block-wise int8/int4 quantization, bitwise equal to ``quantize_blocks_torch``.

``quantize_blocks_triton`` fuses the whole quantization into one pass: each program loads a tile of whole
blocks, takes each block's fp32 absmax, forms the bf16 scale, rounds ``floor(x / scale + 0.5)``, clamps and
writes the codes (packed two to a byte for 4 bits) and the scales. ``dequantize_blocks_triton`` unpacks and
multiplies by the scale in one pass. The layout is that of :mod:`hetero.kernels.quantize`.

Two choices keep the results bitwise equal to the torch reference: divisions use ``tl.math.div_rn`` (a
plain ``/`` compiles to an approximate division on NVIDIA GPUs), and the fp32 -> bf16 rounding of the
scale is done on the bit pattern (round to nearest even, as torch does) and the scales are moved as int16
bits, so no path depends on how a backend converts to or from bf16 (Triton's interpreter truncates).
Inputs are assumed finite: with a NaN or infinity in a block the codes are undefined, as in the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hetero.kernels.formats import SCALE_DTYPE, code_bytes, qmax

# Elements per program: small blocks are grouped so that each program handles about this many.
TILE_ELEMENTS = 4096


@triton.jit
def _bf16_bits(x):
    """The bf16 bit pattern (in the low 16 bits of an int32) of fp32 ``x`` rounded to nearest even."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, rounded & 0xFFFF)


@triton.jit
def _bf16_bits_to_fp32(bits):
    return ((bits & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _block_tile(n_blocks, block_size, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's ROWS blocks: block indices, which exist, the element mask and element offsets."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_blocks
    rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = row_ok[:, None] & (cols[None, :] < block_size)
    return rows, row_ok, mask, rows[:, None] * block_size + cols[None, :]


@triton.jit
def _quantize_kernel(
    x_ptr,
    codes_ptr,
    scale_bits_ptr,
    n_blocks,
    block_size,
    BITS: tl.constexpr,
    LIMIT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows, row_ok, mask, offsets = _block_tile(n_blocks, block_size, ROWS, BLOCK)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)

    absmax = tl.max(tl.abs(x), axis=1)
    scale_bits = _bf16_bits(tl.math.div_rn(absmax, tl.full([ROWS], LIMIT, tl.float32)))
    tl.store(scale_bits_ptr + rows, scale_bits.to(tl.int16), mask=row_ok)
    divisor = _bf16_bits_to_fp32(scale_bits)
    divisor = tl.where(divisor == 0.0, 1.0, divisor)

    codes = tl.floor(tl.math.div_rn(x, tl.broadcast_to(divisor[:, None], [ROWS, BLOCK])) + 0.5)
    codes = tl.minimum(tl.maximum(codes, -LIMIT), LIMIT).to(tl.int32)
    if BITS == 8:
        tl.store(codes_ptr + offsets, (codes & 0xFF).to(tl.uint8), mask=mask)
    else:
        low, high = tl.split(tl.reshape(codes + 8, [ROWS, BLOCK // 2, 2]))
        pairs = tl.arange(0, BLOCK // 2)
        half = block_size // 2
        pair_mask = row_ok[:, None] & (pairs[None, :] < half)
        packed = (low | (high << 4)).to(tl.uint8)
        tl.store(codes_ptr + rows[:, None] * half + pairs[None, :], packed, mask=pair_mask)


@triton.jit
def _dequantize_kernel(
    codes_ptr,
    scale_bits_ptr,
    out_ptr,
    n_blocks,
    block_size,
    BITS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows, row_ok, mask, offsets = _block_tile(n_blocks, block_size, ROWS, BLOCK)
    scale = _bf16_bits_to_fp32(tl.load(scale_bits_ptr + rows, mask=row_ok, other=0).to(tl.int32))

    if BITS == 8:
        codes = tl.load(codes_ptr + offsets, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    else:
        pairs = tl.arange(0, BLOCK // 2)
        half = block_size // 2
        pair_mask = row_ok[:, None] & (pairs[None, :] < half)
        packed = tl.load(codes_ptr + rows[:, None] * half + pairs[None, :], mask=pair_mask, other=0)
        packed = packed.to(tl.int32)
        low = ((packed & 0x0F) - 8).to(tl.float32)
        high = ((packed >> 4) - 8).to(tl.float32)
        codes = tl.reshape(tl.join(low, high), [ROWS, BLOCK])
    tl.store(out_ptr + offsets, codes * scale[:, None], mask=mask)


def _tiling(block_size: int) -> tuple[int, int]:
    """(blocks per program, padded block width), both powers of two."""
    block = triton.next_power_of_2(block_size)
    return max(1, TILE_ELEMENTS // block), block


def quantize_blocks_triton(x: torch.Tensor, bits: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8, packed) and per-block bf16 scales of a contiguous 1-D fp32 ``x``, in one fused kernel."""
    limit = qmax(bits)
    if not x.is_contiguous():
        raise ValueError("quantize_blocks_triton takes a contiguous tensor")
    n_blocks = x.numel() // block_size
    codes = torch.empty(code_bytes(x.numel(), bits), dtype=torch.uint8, device=x.device)
    scales = torch.empty(n_blocks, dtype=SCALE_DTYPE, device=x.device)
    rows, block = _tiling(block_size)
    if n_blocks:
        _quantize_kernel[(triton.cdiv(n_blocks, rows),)](
            x, codes, scales.view(torch.int16), n_blocks, block_size,
            BITS=bits, LIMIT=limit, ROWS=rows, BLOCK=block,
        )
    return codes, scales


def dequantize_blocks_triton(
    codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int
) -> torch.Tensor:
    """The fp32 vector that ``codes`` and ``scales`` stand for, in one fused kernel."""
    qmax(bits)
    if not (codes.is_contiguous() and scales.is_contiguous()):
        raise ValueError("dequantize_blocks_triton takes contiguous tensors")
    n_blocks = scales.numel()
    out = torch.empty(n_blocks * block_size, dtype=torch.float32, device=codes.device)
    rows, block = _tiling(block_size)
    if n_blocks:
        _dequantize_kernel[(triton.cdiv(n_blocks, rows),)](
            codes, scales.view(torch.int16), out, n_blocks, block_size, BITS=bits, ROWS=rows, BLOCK=block
        )
    return out
