"""Compressed gradient syncs on 2 and 4 gloo ranks give what the single-process oracle computes from every
replica's gradient at once, step after step (error-feedback state carried), and count their bytes."""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from compression_oracle import (owner_zeros, powersgd_sum, quant_sum, shared_entries, shared_topk_sum,
                                topk_sum)
from hetero.parallel.compression.bit_packing import packed_words
from hetero.parallel.compression.build import build_grad_sync
from hetero.parallel.compression.collective import (
    GroupCollective,
    all_gather_wire_bytes,
    all_reduce_wire_bytes,
    all_to_all_wire_bytes,
)
from hetero.parallel.compression.config import CompressorConfig
from hetero.parallel.compression.powersgd import initial_q
from hetero.testing.multiprocess import run_ranks

STEPS = 4
SHAPES = {"w1": (48, 40), "b1": (48,), "w2": (24, 48)}  # 3,120 entries: not a multiple of any block


def replica_grads(rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def params():
    return {n: nn.Parameter(torch.zeros(s)) for n, s in SHAPES.items()}


def sync_steps(rank, world_size, config):
    named = params()
    sync = build_grad_sync(config, named.items(), GroupCollective(dist.group.WORLD), 2**20, seed=5)
    out = []
    for step in range(STEPS):
        for name, g in replica_grads(rank, step).items():
            named[name].grad = g
        sync.sync()
        out.append({n: p.grad.clone() for n, p in named.items()})
    return out, sync.bytes_sent


def flat(grads):
    return torch.cat([grads[n].reshape(-1) for n in SHAPES])


@pytest.mark.parametrize("world_size,value_bits", [(2, 32), (4, 32), (3, 2)])
def test_topk_with_error_feedback_matches_the_oracle(world_size, value_bits):
    """Each replica's own top-k, all-gathered: 8-bit indices in segments of 256, packed in int32 words, and
    fp32 values or 2-bit codes with two bf16 magnitudes per 64 kept values (SparseLoCo's payload)."""
    config = CompressorConfig(method="topk", ratio=0.05, segment=256, value_bits=value_bits)
    results = run_ranks(sync_steps, world_size, config, timeout_s=120)
    residuals = [torch.zeros(3120) for _ in range(world_size)]
    for step in range(STEPS):
        expected = topk_sum([flat(replica_grads(r, step)) for r in range(world_size)], residuals, 0.05, 256,
                            None if value_bits == 32 else value_bits)
        for out, _ in results:
            torch.testing.assert_close(flat(out[step]), expected, rtol=1e-6, atol=1e-6)
    k_total = 13 * round(0.05 * 256)  # 13 segments of 256 after padding
    values = 4 * k_total if value_bits == 32 else math.ceil(k_total / 64) * (64 // 4 + 2 * 2)
    assert results[0][1] == STEPS * all_gather_wire_bytes(values + 4 * packed_words(k_total, 8), world_size)


@pytest.mark.parametrize("value_bits", [32, 4, 2])
def test_shared_topk_sums_every_replicas_values_at_one_replicas_choice_in_turn(value_bits):
    """3 replicas: step s's entries are replica s mod 3's top-k; the indices (8 bits each in segments of 256,
    packed end to end in int32 words) travel in an all-reduce, the values in another (fp32) or in the two-phase quantized sum (int4),
    bytes flat in the replica count."""
    config = CompressorConfig(method="shared_topk", ratio=0.05, segment=256, value_bits=value_bits)
    results = run_ranks(sync_steps, 3, config, timeout_s=120)
    residuals = [torch.zeros(3120) for _ in range(3)]
    kept = 13 * round(0.05 * 256)  # 13 segments of 256 after padding
    owners = owner_zeros(kept, 3, 64)
    for step in range(STEPS):
        expected = shared_topk_sum([flat(replica_grads(r, step)) for r in range(3)], residuals, 0.05, 256, step % 3,
                                   None if value_bits == 32 else value_bits, owners)
        for out, _ in results:
            assert torch.equal(flat(out[step]), flat(results[0][0][step]))  # every replica the same bits
            torch.testing.assert_close(flat(out[step]), expected, rtol=1e-6, atol=1e-6)
    indices = all_reduce_wire_bytes(4 * packed_words(kept, 8), 3)
    if value_bits == 32:
        values = all_reduce_wire_bytes(4 * kept, 3)
    else:  # codes and bf16 scales per 64 (int4: one; 2 bits: two), padded to 3 chunks of whole blocks:
        # all-to-all, then all-gather
        chunk = math.ceil(kept / (3 * 64)) * 64
        payload = chunk * value_bits // 8 + chunk // 64 * 2 * (2 if value_bits == 2 else 1)
        values = all_to_all_wire_bytes(3 * payload, 3) + all_gather_wire_bytes(payload, 3)
    assert [bytes_sent for _, bytes_sent in results] == [STEPS * (indices + values)] * 3


@pytest.mark.parametrize("value_bits", [32, 2])
def test_shared_topk_over_the_union_of_every_replicas_choice_matches_the_oracle(value_bits):
    """3 replicas each pick their own top-k (8-bit indices, all-gathered); every replica's values at the union
    of those entries travel in the sum, fp32 or through the two-phase 2-bit sum."""
    config = CompressorConfig(method="shared_topk", ratio=0.05, segment=256, value_bits=value_bits, indices="union")
    results = run_ranks(sync_steps, 3, config, timeout_s=120)
    residuals = [torch.zeros(3120) for _ in range(3)]
    picked = 13 * round(0.05 * 256)  # by each replica: 13 segments of 256 after padding
    owners, sent = [torch.zeros(0)], 0
    for step in range(STEPS):
        grads = [flat(replica_grads(r, step)) for r in range(3)]
        union = int(shared_entries(grads, residuals, 0.05, 256, "union").sum())
        assert 3 * picked / 2 < union <= 3 * picked  # the replicas chose partly different entries
        expected = shared_topk_sum(grads, residuals, 0.05, 256, "union", None if value_bits == 32 else 2, owners)
        for out, _ in results:
            torch.testing.assert_close(flat(out[step]), expected, rtol=1e-6, atol=1e-6)
        sent += all_gather_wire_bytes(4 * packed_words(picked, 8), 3)
        if value_bits == 32:
            sent += all_reduce_wire_bytes(4 * union, 3)
        else:  # 2-bit codes and two bf16 scales per 64, padded to 3 chunks of whole blocks
            chunk = math.ceil(union / (3 * 64)) * 64
            payload = chunk // 4 + chunk // 64 * 4
            sent += all_to_all_wire_bytes(3 * payload, 3) + all_gather_wire_bytes(payload, 3)
    assert [bytes_sent for _, bytes_sent in results] == [sent] * 3


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("world_size", [2, 4])
def test_two_phase_quantized_sum_matches_the_oracle(bits, world_size):
    config = CompressorConfig(method=f"int{bits}", block_size=32)
    results = run_ranks(sync_steps, world_size, config, timeout_s=120)
    residuals = [torch.zeros(3120) for _ in range(world_size)]
    owners = owner_zeros(3120, world_size, 32)
    for step in range(STEPS):
        grads = [flat(replica_grads(r, step)) for r in range(world_size)]
        expected = quant_sum(grads, residuals, owners, bits, 32)
        for out, _ in results:
            torch.testing.assert_close(flat(out[step]), expected, rtol=1e-6, atol=1e-6)
        exact = sum(grads)
        assert float((expected - exact).norm() / exact.norm()) < (0.02 if bits == 8 else 0.3)
    padded = -(-3120 // (world_size * 32)) * world_size * 32
    payload = padded * bits // 8 + padded // 32 * 2  # codes + one bf16 scale per block
    per_step = 2 * (world_size - 1) * payload // world_size
    assert abs(results[0][1] - STEPS * per_step) <= STEPS * world_size  # integer division per call


def test_ef21_tracks_the_sum_of_gradients():
    config = CompressorConfig(method="topk", ratio=0.05, segment=256, error_feedback="ef21")
    results = run_ranks(sync_steps, 2, config, timeout_s=120)
    local = [torch.zeros(3120) for _ in range(2)]
    total = torch.zeros(3120)
    zero = [torch.zeros(3120) for _ in range(2)]
    for step in range(STEPS):
        grads = [flat(replica_grads(r, step)) for r in range(2)]
        sent = topk_sum([g - h for g, h in zip(grads, local)], zero, 0.05, 256)
        for r in range(2):  # each replica's estimate moves by what it sent
            mine = topk_sum([grads[r] - local[r]], [torch.zeros(3120)], 0.05, 256)
            local[r] = local[r] + mine
        zero = [torch.zeros(3120) for _ in range(2)]
        total = total + sent
        for out, _ in results:
            torch.testing.assert_close(flat(out[step]), total, rtol=1e-6, atol=1e-6)


def test_randomk_sends_the_same_entries_from_every_replica():
    config = CompressorConfig(method="randomk", ratio=0.1, error_feedback="none")
    results = run_ranks(sync_steps, 2, config, timeout_s=120)
    for step in range(STEPS):
        got = flat(results[0][0][step])
        torch.testing.assert_close(got, flat(results[1][0][step]))
        chosen = got != 0
        assert int(chosen.sum()) == round(0.1 * 3120)
        exact = flat(replica_grads(0, step)) + flat(replica_grads(1, step))
        torch.testing.assert_close(got[chosen], exact[chosen])
    assert results[0][1] == STEPS * round(0.1 * 3120) * 4  # 2(n-1)/n = 1 at n = 2


def test_powersgd_starts_every_matrix_from_its_own_q():
    """Names whose characters sum alike (an anagram's digits and letters) still get different starts."""
    a, b = "layers.0.attention.wq.weight", "layers.2.attention.wo.weight"
    assert sum(map(ord, a)) == sum(map(ord, b))
    assert not torch.equal(initial_q(a, 16, 2, 0), initial_q(b, 16, 2, 0))
    assert torch.equal(initial_q(a, 16, 2, 0), initial_q(a, 16, 2, 0))  # every replica draws the same
    assert not torch.equal(initial_q(a, 16, 2, 0), initial_q(a, 16, 2, 1))


def test_powersgd_matches_the_oracle_with_warm_start_and_error_feedback():
    config = CompressorConfig(method="powersgd", rank=2)
    results = run_ranks(sync_steps, 2, config, timeout_s=120)
    residuals = {n: [torch.zeros(SHAPES[n]) for _ in range(2)] for n in ("w1", "w2")}
    qs = {}
    for n in ("w1", "w2"):
        qs[n] = [initial_q(n, SHAPES[n][1], 2, 5)]
    for step in range(STEPS):
        grads = [replica_grads(r, step) for r in range(2)]
        expected = {n: powersgd_sum([g[n] for g in grads], residuals[n], qs[n], 2) for n in ("w1", "w2")}
        for out, _ in results:
            torch.testing.assert_close(out[step]["b1"], grads[0]["b1"] + grads[1]["b1"])
            for n in ("w1", "w2"):
                torch.testing.assert_close(out[step][n], expected[n], rtol=1e-5, atol=1e-5)
    matrices = 2 * (48 + 40) + 2 * (24 + 48)
    assert results[0][1] == STEPS * (48 + matrices) * 4
