"""Context-parallel attention side by side: the masked all-gather hetero used to run, the block-causal
all-gather and the ring, per sequence length and CP degree, on real gloo ranks.

    hetero bench cp-attention [--seq 8192 16384 32768] [--cp 2 4] [--repeats 2] [--json]

Each rank holds its zigzag share of one sequence's q (``--heads`` heads) and k/v (``--kv-heads``, GQA),
``--head-dim`` wide, fp32, and runs the attention forward and backward. Reported per rank, worst over
ranks: the median time of a forward and backward after one warm-up (barrier to barrier), and the peak
memory it allocates on top of its inputs (``torch.distributed._tools.mem_tracker.MemTracker``, a separate
pass). Ratios are against the masked all-gather, measured in the same run. The masked method lives here
only, as the baseline: it all-gathers K/V and hands SDPA an explicit (S/cp)×S boolean mask, which SDPA
turns into a float mask of the same shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hetero.parallel.context import ContextParallelAttention, gather_from_cp, split_for_cp, zigzag_indices
from hetero.testing.multiprocess import run_ranks

METHODS = ("masked all-gather", "block all-gather", "ring")


class MaskedAllGather(torch.nn.Module):
    """The baseline: K/V all-gathered, GQA heads repeated, one SDPA call with an explicit causal mask."""

    def __init__(self, group: dist.ProcessGroup, cp: int, rank: int):
        super().__init__()
        self.group, self.cp, self.rank = group, cp, rank

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = gather_from_cp(k, 2, self.group), gather_from_cp(v, 2, self.group)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        q_pos = zigzag_indices(k.shape[2], self.cp, self.rank, device=q.device)
        mask = torch.arange(k.shape[2], device=q.device)[None, :] <= q_pos[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _attention(method: str, group, cp: int, rank: int) -> torch.nn.Module:
    if method == "masked all-gather":
        return MaskedAllGather(group, cp, rank)
    return ContextParallelAttention(group, cp, rank, "ring" if method == "ring" else "allgather")


def _inputs(seq: int, heads: int, kv_heads: int, head_dim: int, cp: int, rank: int):
    gen = torch.Generator().manual_seed(seq)
    full = [torch.randn(1, h, seq, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads)]
    return [split_for_cp(t, 2, cp, rank).requires_grad_() for t in full]


def _step(attention, q, k, v) -> None:
    out = attention(q, k, v)
    out.backward(torch.ones_like(out))
    for t in (q, k, v):
        t.grad = None


def measure(rank: int, world_size: int, seqs, heads, kv_heads, head_dim, repeats) -> dict:
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.set_num_threads(1)
    group = dist.new_group(list(range(world_size)))
    results = {}
    for seq in seqs:
        q, k, v = _inputs(seq, heads, kv_heads, head_dim, world_size, rank)
        for method in METHODS:
            attention = _attention(method, group, world_size, rank)
            tracker = MemTracker()
            with tracker:
                _step(attention, q, k, v)
            peak = tracker.get_tracker_snapshot("peak")[q.device]["Total"]
            times = []
            for _ in range(repeats + 1):
                dist.barrier(group)
                start = time.perf_counter()
                _step(attention, q, k, v)
                dist.barrier(group)
                times.append(time.perf_counter() - start)
            results[(seq, method)] = {"seconds": statistics.median(times[1:]), "peak_bytes": peak}
    return results


def run(seqs, cps, heads: int, kv_heads: int, head_dim: int, repeats: int) -> list[dict]:
    rows = []
    for cp in cps:
        per_rank = run_ranks(measure, cp, seqs, heads, kv_heads, head_dim, repeats, timeout_s=3600)
        for seq in seqs:
            worst = {m: {key: max(r[(seq, m)][key] for r in per_rank) for key in ("seconds", "peak_bytes")}
                     for m in METHODS}
            base = worst[METHODS[0]]
            for method in METHODS:
                rows.append({"seq": seq, "cp": cp, "method": method, **worst[method],
                             "time_ratio": worst[method]["seconds"] / base["seconds"],
                             "memory_ratio": worst[method]["peak_bytes"] / base["peak_bytes"]})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = run(args.seq, args.cp, args.heads, args.kv_heads, args.head_dim, args.repeats)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"heads {args.heads}, kv heads {args.kv_heads}, head dim {args.head_dim}, fp32, batch 1; per rank, worst rank")
    print(f"{'S':>6} {'cp':>3} {'method':<18} {'fwd+bwd s':>9} {'peak MiB':>9} {'time x':>7} {'memory x':>8}")
    for row in rows:
        print(f"{row['seq']:>6} {row['cp']:>3} {row['method']:<18} {row['seconds']:>9.3f} "
              f"{row['peak_bytes'] / 2**20:>9.1f} {row['time_ratio']:>7.2f} {row['memory_ratio']:>8.3f}")


if __name__ == "__main__":
    main()
