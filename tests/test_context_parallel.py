"""Context-parallel attention on real gloo ranks equals single-process causal attention, forward and backward.

The reference is plain SDPA with is_causal=True on the full sequence (K/V heads repeated for GQA); each CP
rank's output and q/k/v gradients must equal the reference's at the rank's zigzag positions, for the ring
and the all-gather, with the fused CPU kernel and the math path (what runs off CPU). The block kernels
alone are checked against SDPA with a mask in one process.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hetero.kernels.attention import causal_attention
from hetero.kernels.block_attention import block_backward, block_forward, merge_blocks
from hetero.parallel.context import ContextParallelAttention, gather_from_cp, split_for_cp, zigzag_indices
from hetero.testing.multiprocess import run_ranks

RTOL, ATOL = 1e-5, 1e-6
BATCH, HEADS, SEQ, HEAD_DIM = 2, 4, 32, 8


def test_zigzag_indices_by_hand():
    assert zigzag_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert [zigzag_indices(8, 4, r).tolist() for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert zigzag_indices(4, 1, 0).tolist() == [0, 1, 2, 3]
    assert zigzag_indices(8, 2, 0).dtype == torch.long


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_indices_partition_the_sequence(cp):
    seq_len = 12 * cp
    held = torch.cat([zigzag_indices(seq_len, cp, r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(seq_len))


@pytest.mark.parametrize("seq_len, cp", [(6, 2), (10, 4), (3, 1)])
def test_zigzag_indices_rejects_uneven_split(seq_len, cp):
    with pytest.raises(ValueError, match="divisible"):
        zigzag_indices(seq_len, cp, 0)


def test_split_for_cp_selects_along_dim():
    x = torch.arange(2 * 8 * 3).reshape(2, 8, 3)
    torch.testing.assert_close(split_for_cp(x, 1, 2, 1), x[:, [2, 3, 4, 5], :])


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_cp1_is_plain_causal_sdpa(kv_heads):
    torch.manual_seed(0)
    q = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM)
    k, v = torch.randn(2, BATCH, kv_heads, SEQ, HEAD_DIM)
    expected = F.scaled_dot_product_attention(q, *_repeat_kv(k, v, HEADS), is_causal=True)
    assert torch.equal(causal_attention(q, k, v), expected)
    assert torch.equal(ContextParallelAttention(None, 1, 0)(q, k, v), expected)


def _repeat_kv(k, v, heads):
    return k.repeat_interleave(heads // k.shape[1], dim=1), v.repeat_interleave(heads // v.shape[1], dim=1)


def _max_errors(actual, expected):
    """Max abs difference, and that divided by the reference's largest magnitude."""
    abs_err = (actual - expected).abs().max().item()
    return abs_err, abs_err / expected.abs().max().item()


@pytest.mark.parametrize("kernel", ["flash", "math"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_blocks_merged_by_log_sum_exp_are_exact_attention(kernel, dtype):
    """Queries of chunk 2 (of 3 chunks of 6) over keys 0..11 (a full block) and 12..17 (causal), GQA 4:2."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=gen, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, 2, 18, 8, generator=gen, dtype=dtype, requires_grad=True) for _ in range(2))
    mask = torch.arange(18)[None, :] <= torch.arange(12, 18)[:, None]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    grad = torch.randn(expected.shape, generator=gen, dtype=dtype)
    expected.backward(grad)
    q_, k_, v_ = q.detach(), k.detach(), v.detach()
    blocks = ((slice(0, 12), False), (slice(12, 18), True))
    out, lse = merge_blocks([block_forward(q_, k_[:, :, s], v_[:, :, s], causal, kernel) for s, causal in blocks])
    grads = [block_backward(grad, q_, k_[:, :, s], v_[:, :, s], out, lse, causal, kernel) for s, causal in blocks]
    tolerance = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 2e-6}
    torch.testing.assert_close(out, expected.detach(), **tolerance)
    torch.testing.assert_close(grads[0][0] + grads[1][0], q.grad, **tolerance)
    torch.testing.assert_close(torch.cat([grads[0][1], grads[1][1]], 2), k.grad, **tolerance)
    torch.testing.assert_close(torch.cat([grads[0][2], grads[1][2]], 2), v.grad, **tolerance)


def cp_attention_matches_reference(rank, world_size, method, kernel):
    group = dist.new_group(list(range(world_size)))
    attn = ContextParallelAttention(group, world_size, rank, method, kernel)
    errors = {}
    for kv_heads in (2, 4):
        torch.manual_seed(kv_heads)  # identical full tensors on every rank
        q = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, requires_grad=True)
        k = torch.randn(BATCH, kv_heads, SEQ, HEAD_DIM, requires_grad=True)
        v = torch.randn(BATCH, kv_heads, SEQ, HEAD_DIM, requires_grad=True)
        grad_out = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM)

        ref_out = F.scaled_dot_product_attention(q, *_repeat_kv(k, v, HEADS), is_causal=True)
        ref_out.backward(grad_out)

        local = [split_for_cp(t.detach(), 2, world_size, rank).requires_grad_() for t in (q, k, v)]
        out = attn(*local)
        out.backward(split_for_cp(grad_out, 2, world_size, rank))

        pairs = {"out": (out, ref_out)}
        pairs.update({f"d{n}": (t.grad, full.grad) for n, t, full in zip("qkv", local, (q, k, v))})
        for name, (actual, full) in pairs.items():
            expected = split_for_cp(full.detach(), 2, world_size, rank)
            torch.testing.assert_close(
                actual.detach(), expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}"
            )
            errors[(kv_heads, name)] = _max_errors(actual.detach(), expected)
    return errors


@pytest.mark.parametrize("kernel", ["flash", "math"])
@pytest.mark.parametrize("method", ["ring", "allgather"])
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_matches_single_process(cp, method, kernel):
    per_rank = run_ranks(cp_attention_matches_reference, cp, method, kernel, timeout_s=120)
    worst_abs = max(abs_err for errors in per_rank for abs_err, _ in errors.values())
    worst_rel = max(rel_err for errors in per_rank for _, rel_err in errors.values())
    print(f"cp={cp} {method} {kernel}: max abs error {worst_abs:.2e}, max rel error {worst_rel:.2e}")


def split_gather_round_trip(rank, world_size):
    group = dist.new_group(list(range(world_size)))
    full = torch.arange(3 * 16 * 5, dtype=torch.float32).reshape(3, 16, 5)
    local = split_for_cp(full, 1, world_size, rank).requires_grad_()
    gathered = gather_from_cp(local, 1, group)
    assert torch.equal(gathered, full)
    # Every rank sends the same upstream gradient, so each local slice receives world_size times it.
    upstream = torch.ones_like(full) + full
    gathered.backward(upstream)
    assert torch.equal(local.grad, world_size * split_for_cp(upstream, 1, world_size, rank))


@pytest.mark.parametrize("cp", [2, 4])
def test_split_gather_round_trip(cp):
    run_ranks(split_gather_round_trip, cp, timeout_s=120)
