"""The Triton kernels against their torch references, bit for bit, and the references on hand-worked cases.

Without a GPU the Triton kernels run under Triton's interpreter. ``TRITON_INTERPRET`` is read when
``@triton.jit`` decorates a kernel, that is when the kernel module is first imported, and a module imported
that way would then serve every later caller in the process (CUDA tensors included). So the interpreted
kernels run in one subprocess with ``TRITON_INTERPRET=1``: it reads the inputs from a file, writes the
Triton outputs back, and this process compares them with the references. On a machine with a GPU the same
cases also go through the public dispatchers on CUDA tensors, compiled for real.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetero.kernels.dispatch import use_triton
from hetero.kernels.quantize import (
    dequantize_blocks,
    dequantize_blocks_torch,
    quantize_blocks,
    quantize_blocks_torch,
)
from hetero.kernels.segment_topk import segment_topk, segment_topk_torch

ROOT = Path(__file__).resolve().parents[1]

RUNNER = """
import sys
import torch
from hetero.kernels.triton_quantize import dequantize_blocks_triton, quantize_blocks_triton
from hetero.kernels.triton_segment_topk import segment_topk_triton

out = {}
for name, case in torch.load(sys.argv[1]).items():
    if case["kind"] == "quantize":
        out[name] = quantize_blocks_triton(case["x"], case["bits"], case["block_size"])
    elif case["kind"] == "dequantize":
        args = case["codes"], case["scales"], case["bits"], case["block_size"]
        out[name] = (dequantize_blocks_triton(*args),)
    else:
        residual = case["residual"].clone()
        values, indices = segment_topk_triton(case["grad"], residual, case["k"], case["segment"])
        out[name] = (values, indices, residual)
torch.save(out, sys.argv[2])
"""


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, so that -0.0 differs from 0.0 and a NaN equals itself."""
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16)
    return t


def assert_bitwise(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
        assert torch.equal(bits(g.cpu()), bits(w)), f"{(bits(g.cpu()) != bits(w)).sum()} elements differ"


# ---------------------------------------------------------------------------------------------- the cases


def quantize_input(gen: torch.Generator, bits_: int, block_size: int, n_blocks: int) -> torch.Tensor:
    """Random blocks over a wide range of magnitudes (fp32 subnormals to 1e30), after some special ones."""
    limit = 2 ** (bits_ - 1) - 1
    blocks = torch.randn(n_blocks, block_size, generator=gen)
    blocks *= 10.0 ** torch.empty(n_blocks, 1).uniform_(-42, 30, generator=gen)
    blocks[0] = 0.0
    blocks[1] = -0.0
    blocks[2] = 0.0
    blocks[2, -1] = -3e-39  # a lone subnormal
    # Exact halves of the scale, 1.0 here: the rounding of ties to +inf and the clamp.
    halves = torch.arange(block_size) - block_size / 2 + 0.5
    blocks[3] = halves.clamp(-limit, limit)
    blocks[3, 0] = limit
    return blocks.reshape(-1).contiguous()


def build_cases() -> dict[str, dict]:
    gen = torch.Generator().manual_seed(1234)
    cases: dict[str, dict] = {}
    # (block size, blocks): odd widths exercise the masks; 12 blocks of 512 and 40 of 100 span two programs.
    for bits_ in (4, 8):
        for block_size, n_blocks in ((2, 8), (6, 9), (32, 12), (100, 40), (512, 12)):
            x = quantize_input(gen, bits_, block_size, n_blocks)
            cases[f"quantize-{bits_}bit-block{block_size}"] = dict(
                kind="quantize", x=x, bits=bits_, block_size=block_size
            )
            # Any bytes (the int8 code -128 included) and any bf16 scales (negative, zero, subnormal).
            scales = torch.randn(n_blocks, generator=gen)
            scales *= 10.0 ** torch.empty(n_blocks).uniform_(-40, 30, generator=gen)
            scales[0] = 0.0
            n_codes = n_blocks * block_size * bits_ // 8
            codes = torch.randint(0, 256, (n_codes,), generator=gen, dtype=torch.uint8)
            cases[f"dequantize-{bits_}bit-block{block_size}"] = dict(
                kind="dequantize", codes=codes, scales=scales.to(torch.bfloat16), bits=bits_,
                block_size=block_size,
            )
    for segment, k in ((8, 1), (8, 8), (16, 5), (48, 7), (256, 256), (1024, 10), (4096, 100)):
        n = 3 * segment
        # Small integers: many equal magnitudes of both signs, zeros and negative zeros.
        grad = torch.randint(-3, 4, (n,), generator=gen).float()
        residual = torch.randint(-2, 3, (n,), generator=gen).float() * 0.5
        residual[::5] = -0.0
        grad[:segment] = 0.0  # a segment of equal magnitudes: the first k are kept
        residual[:segment] = 0.0
        cases[f"topk-seg{segment}-k{k}-ties"] = dict(
            kind="topk", grad=grad, residual=residual, k=k, segment=segment
        )
        grad = torch.randn(n, generator=gen)
        residual = torch.randn(n, generator=gen) * 1e-3
        cases[f"topk-seg{segment}-k{k}-random"] = dict(
            kind="topk", grad=grad, residual=residual, k=k, segment=segment
        )
    grad = torch.tensor([1.0, float("nan"), float("inf"), -2.0, float("-inf"), float("nan"), 0.0, 3.0])
    cases["topk-nan-inf"] = dict(kind="topk", grad=grad, residual=torch.zeros(8), k=3, segment=8)
    return cases


CASES = build_cases()


def reference(case: dict) -> tuple[torch.Tensor, ...]:
    if case["kind"] == "quantize":
        return quantize_blocks_torch(case["x"], case["bits"], case["block_size"])
    if case["kind"] == "dequantize":
        return (dequantize_blocks_torch(case["codes"], case["scales"], case["bits"], case["block_size"]),)
    residual = case["residual"].clone()
    values, indices = segment_topk_torch(case["grad"], residual, case["k"], case["segment"])
    return values, indices, residual


def dispatched(case: dict, device: str) -> tuple[torch.Tensor, ...]:
    """The case through the public dispatchers, on ``device``."""
    if case["kind"] == "quantize":
        return quantize_blocks(case["x"].to(device), case["bits"], case["block_size"])
    if case["kind"] == "dequantize":
        codes, scales = case["codes"].to(device), case["scales"].to(device)
        return (dequantize_blocks(codes, scales, case["bits"], case["block_size"]),)
    residual = case["residual"].to(device)
    values, indices = segment_topk(case["grad"].to(device), residual, case["k"], case["segment"])
    return values, indices, residual


# ------------------------------------------------------------------------------------ the references pinned


def test_quantize_reference_8bit_by_hand():
    x = torch.tensor([127.0, -63.5, 63.5, 0.49, 0.0, -0.0, 0.0, 0.0])
    codes, scales = quantize_blocks_torch(x, 8, 4)
    # scale 127/127 = 1: floor(x + 0.5) rounds halves up; an all-zero block has scale 0 and codes 0.
    assert torch.equal(scales, torch.tensor([1.0, 0.0], dtype=torch.bfloat16))
    assert codes.dtype == torch.uint8
    assert codes.tolist() == [127, 256 - 63, 64, 0, 0, 0, 0, 0]
    assert dequantize_blocks_torch(codes, scales, 8, 4).tolist() == [127, -63, 64, 0, 0, 0, 0, 0]


def test_quantize_reference_4bit_by_hand():
    x = torch.tensor([1.0, -2.0, 0.0, 4.0, 5.0, 0.0, 0.0, 0.0])
    codes, scales = quantize_blocks_torch(x, 4, 4)
    # 4/7 = 0.5714 is 1.142857 * 2^-1 -> bf16 146/128 * 2^-1 = 0.5703125; 5/7 -> 182.86/256 -> 183/256.
    assert scales.float().tolist() == [0.5703125, 0.71484375]
    # Block 0: 1/s + 0.5 = 2.25, -2/s + 0.5 = -3.007, 4/s + 0.5 = 7.51 -> codes 2, -4, 0, 7;
    # block 1: 5/s + 0.5 = 7.49 -> codes 7, 0, 0, 0.
    # Stored as code + 8, element 2i in the low nibble of byte i.
    assert codes.tolist() == [10 | 4 << 4, 8 | 15 << 4, 15 | 8 << 4, 8 | 8 << 4]
    assert dequantize_blocks_torch(codes, scales, 4, 4).tolist() == [
        2 * 0.5703125, -4 * 0.5703125, 0.0, 7 * 0.5703125, 7 * 0.71484375, 0.0, 0.0, 0.0
    ]


def test_quantize_reference_rounds_scales_to_nearest_even():
    # absmax / 7 = 1 + 2^-8 and 1 + 3 * 2^-8 lie halfway between bf16 neighbours: ties go to the even one.
    x = torch.tensor([7 * (1 + 2**-8), 0.0, 7 * (1 + 3 * 2**-8), 0.0])
    _, scales = quantize_blocks_torch(x, 4, 2)
    assert scales.float().tolist() == [1.0, 1 + 2**-6]


def test_segment_topk_reference_by_hand():
    grad = torch.tensor([2.5, -1.0, 2.0, -3.0, 0.0, 1.0, 1.0, -1.0])
    residual = torch.tensor([0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    values, indices = segment_topk_torch(grad, residual, 2, 4)
    # v = [3, -1, 2, -3 | 0, 1, 1, -1]: |3| ties with |-3|; in the second segment three 1s tie and the
    # lowest two indices win.
    assert values.tolist() == [[3.0, -3.0], [1.0, 1.0]]
    assert indices.dtype == torch.uint16
    assert indices.tolist() == [[0, 3], [1, 2]]
    assert residual.tolist() == [0.0, -1.0, 2.0, 0.0, 0.0, 0.0, 0.0, -1.0]


# --------------------------------------------------------------------------- Triton against the references


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.Tensor, ...]]:
    """Every case's Triton outputs, from one interpreter run in a subprocess."""
    folder = tmp_path_factory.mktemp("kernels")
    torch.save(CASES, folder / "cases.pt")
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(folder / "cases.pt"), str(folder / "out.pt")],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(folder / "out.pt")


@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_matches_reference(interpreted, name):
    assert_bitwise(interpreted[name], reference(CASES[name]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dispatchers_on_cuda_match_reference(monkeypatch):
    monkeypatch.setenv("HETERO_TRITON", "1")
    assert use_triton(torch.empty(0, device="cuda"))
    for name in sorted(CASES):
        assert_bitwise(dispatched(CASES[name], "cuda"), reference(CASES[name]))
