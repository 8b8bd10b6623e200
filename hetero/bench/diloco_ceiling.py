"""The ceiling of every DiLoCo-based compressor: uncompressed DiLoCo's paired gap to per-step fp32 DP.

    hetero bench compression --ceiling [--seeds 0 1 2 3 4] [--steps 2048] [--ranks 4] [--outer-lrs 0.3 0.5]

No compressor of the pseudo-gradients can beat its own DiLoCo's gap, so this table comes first: for H in
``INNER_STEPS`` and each outer learning rate (``OUTER_LRS`` by default; Nesterov, momentum 0.9), the text
task's held-out loss per seed against per-step fp32 AdamW DP from the same initialization on the same
batches (``seed_stats.paired_gap``), and the best outer learning rate of each H.
"""

from __future__ import annotations

from hetero.bench.compression_tasks import Method, run_text
from hetero.bench.seed_stats import mean_std, paired_gap
from hetero.parallel.compression.config import CompressionConfig, DiLoCoConfig
from hetero.testing.multiprocess import run_ranks

INNER_STEPS = (4, 8, 16, 32)
OUTER_LRS = (0.5, 0.7, 1.0)


def text_runs(method: Method, seeds: list[int], steps: int, ranks: int) -> list[dict]:
    """The text task trained by ``method`` once per seed: each seed's held-out loss."""
    return [run_ranks(run_text, ranks, method, seed, steps, steps, timeout_s=3600)[0] | {"seed": seed}
            for seed in seeds]


def print_ceiling(seeds: list[int], steps: int, ranks: int, outer_lrs: tuple[float, ...] = OUTER_LRS) -> list[dict]:
    """Run and print the table; its rows (``inner_steps``, ``outer_lr``, ``loss``, ``gap``, ``gap_std``)."""
    base = text_runs(Method("fp32 all-reduce"), seeds, steps, ranks)
    rows = []
    for inner in INNER_STEPS:
        for lr in outer_lrs:
            compression = CompressionConfig(diloco=DiLoCoConfig(inner_steps=inner, outer_lr=lr))
            runs = text_runs(Method(f"DiLoCo H={inner}, outer lr {lr}", compression=compression), seeds, steps, ranks)
            gap, gap_std = paired_gap(runs, base)
            rows.append({"inner_steps": inner, "outer_lr": lr, "loss": mean_std([r["loss"] for r in runs])[0],
                         "gap": gap, "gap_std": gap_std})
            print(f"[ceiling] H={inner} outer lr {lr}: paired gap {gap:+.4f} ± {gap_std:.4f}", flush=True)
    print(f"\nDiLoCo against per-step fp32 DP: text task, {ranks} ranks, {steps} steps, {len(seeds)} seeds "
          f"(fp32 loss {mean_std([r['loss'] for r in base])[0]:.4f})")
    print(f"{'H':>4} {'outer rounds':>12}" + "".join(f"{f'outer lr {lr}':>24}" for lr in outer_lrs) + f"{'best':>10}")
    for inner in INNER_STEPS:
        mine = [r for r in rows if r["inner_steps"] == inner]
        best = min(mine, key=lambda r: r["gap"])
        print(f"{inner:>4} {steps // inner:>12}" + "".join(f"{r['gap']:+14.4f} ± {r['gap_std']:.4f}" for r in mine)
              + f"{best['outer_lr']:>10}")
    return rows
