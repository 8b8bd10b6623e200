"""Compression methods side by side on real data: bytes per step, final loss over seeds, gap to fp32.

    hetero bench compression [--tasks text vlm] [--seeds 0 1 2] [--steps 320] [--ranks 2]
    hetero bench compression --ef-steps 1000     # error-feedback residuals over a long run
    hetero bench compression --fan-in            # bytes per worker at 4 to 64 workers (compression_fan_in)
    hetero bench compression --ceiling           # uncompressed DiLoCo's gap by H and outer lr (diloco_ceiling)
    hetero bench compression --link              # step time on a slow simulated link (compression_link)

Every method trains the same model from the same seeds on the same batches, in this one run: hetero's
fp32 all-reduce, top-k (of the gradient with EF or EF21, or of each AdamW update with EF), shared top-k
(``--fan-in``), random-k, int8,
int4 (with error feedback, and int4 without), PowerSGD and DiLoCo (plain and with compressed
pseudo-gradients), and the peers: torch's DDP PowerSGD hook and torchft's DiLoCo (same H, same outer
Nesterov SGD). Bytes are what each rank put on the wire for data-parallel sync (ring model,
``compression.collective``: values, indices and scales as encoded, the all-gather's fan-in), per step and
as bits per parameter per step; ``fewer`` is the fp32 all-reduce's bytes divided by the method's. The gap is
paired (``seed_stats``): the mean over seeds of each seed's held-out loss minus fp32's on the same seed, ±
the std of those differences.
"""

from __future__ import annotations

import argparse
import os
import time

from hetero.bench.compression_fan_in import print_fan_in
from hetero.bench.compression_link import print_link
from hetero.bench.compression_tasks import Method, ensure_data, run_text, run_vlm
from hetero.bench.diloco_ceiling import OUTER_LRS, print_ceiling
from hetero.bench.seed_stats import compare, paired_gap
from hetero.parallel.compression.config import CompressionConfig, CompressorConfig, DiLoCoConfig
from hetero.testing.multiprocess import run_ranks

TASKS = {"text": run_text, "vlm": run_vlm}
INNER_STEPS = 32
OVERLAP = 4  # inner steps a round runs in the background (overlap_steps): shared top-k issues 3 collectives, one a step
LINK_METHODS = (f"H={INNER_STEPS} union 1.5% 2-bit + decayed EF",
                f"H={INNER_STEPS} union 1.5% 2-bit + decayed EF, overlap {OVERLAP}")


def per_step(method: str, error_feedback: str = "auto", **options) -> CompressionConfig:
    return CompressionConfig(grad=CompressorConfig(method=method, error_feedback=error_feedback, **options))


def diloco(method: str = "none", error_feedback: str = "auto", outer: dict | None = None, **options
           ) -> CompressionConfig:
    """DiLoCo at H=INNER_STEPS, its pseudo-gradients compressed by ``method``; ``outer``: DiLoCoConfig fields."""
    pseudo = CompressorConfig(method=method, error_feedback=error_feedback, **options)
    return CompressionConfig(diloco=DiLoCoConfig(inner_steps=INNER_STEPS, pseudo_grad=pseudo, **(outer or {})))


def per_update(method: str, **options) -> CompressionConfig:
    """Compress each step's AdamW update instead of the gradient: DiLoCo with H=1 and a plain outer step."""
    pseudo = CompressorConfig(method=method, error_feedback="ef", **options)
    return CompressionConfig(diloco=DiLoCoConfig(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, pseudo_grad=pseudo))


METHODS = [
    Method("fp32 all-reduce"),
    Method("top-k 1% + EF", compression=per_step("topk", ratio=0.01)),
    Method("top-k 1% + EF21", compression=per_step("topk", "ef21", ratio=0.01)),
    Method("top-k 1% + EF, AdamW update", compression=per_update("topk", ratio=0.01)),
    Method("shared top-k 1% + EF", compression=per_step("shared_topk", ratio=0.01)),
    Method("random-k 1% + EF", compression=per_step("randomk", ratio=0.01)),
    Method("int8 + EF", compression=per_step("int8")),
    Method("int4 + EF", compression=per_step("int4")),
    Method("int4, no EF", compression=per_step("int4", "none")),
    Method("PowerSGD r1 + EF", compression=per_step("powersgd", rank=1)),
    Method("PowerSGD r4 + EF", compression=per_step("powersgd", rank=4)),
    Method("peer: DDP PowerSGD r1", engine="ddp_powersgd", rank=1),
    Method("peer: DDP PowerSGD r4", engine="ddp_powersgd", rank=4),
    Method(f"DiLoCo H={INNER_STEPS}", compression=diloco()),
    Method(f"DiLoCo H={INNER_STEPS} int4", compression=diloco("int4")),
    Method(f"DiLoCo H={INNER_STEPS} int4 + EF", compression=diloco("int4", "ef")),
    Method(f"DiLoCo H={INNER_STEPS} top-k 10% + EF", compression=diloco("topk", "ef", ratio=0.1)),
    Method(f"DiLoCo H={INNER_STEPS} shared top-k 10% + EF", compression=diloco("shared_topk", "ef", ratio=0.1)),
    Method(f"H={INNER_STEPS} shared 10% + decayed EF",  # SparseLoCo's structure: DiLoCo without outer momentum
           compression=diloco("shared_topk", "ef", {"outer_lr": 1.0, "outer_momentum": 0.0, "error_decay": 0.95},
                              ratio=0.1)),
    Method(f"H={INNER_STEPS} shared 1% int4 + decayed EF",
           compression=diloco("shared_topk", "ef", {"outer_lr": 1.0, "outer_momentum": 0.0, "error_decay": 0.95},
                              ratio=0.01, value_bits=4)),
    Method(f"H={INNER_STEPS} shared 1% 2-bit + decayed EF",
           compression=diloco("shared_topk", "ef", {"outer_lr": 1.0, "outer_momentum": 0.0, "error_decay": 0.95},
                              ratio=0.01, value_bits=2)),
    Method(f"H={INNER_STEPS} shared 2% 2-bit + decayed EF",  # SparseLoCo's bytes at 2 workers
           compression=diloco("shared_topk", "ef", {"outer_lr": 1.0, "outer_momentum": 0.0, "error_decay": 0.95},
                              ratio=0.02, value_bits=2)),
    Method(f"H={INNER_STEPS} shared 3% 2-bit + decayed EF",  # 18% fewer bytes than SparseLoCo's at 4 workers
           compression=diloco("shared_topk", "ef", {"outer_lr": 1.0, "outer_momentum": 0.0, "error_decay": 0.95},
                              ratio=0.03, value_bits=2)),
    Method(f"H={INNER_STEPS} union 1.5% 2-bit + decayed EF",  # SparseLoCo's selection, values summed
           compression=diloco("shared_topk", "ef", {"outer_lr": 1.0, "outer_momentum": 0.0, "error_decay": 0.95},
                              ratio=0.015, value_bits=2, indices="union")),
    Method(f"H={INNER_STEPS} union 1.5% 2-bit + decayed EF, overlap {OVERLAP}",
           compression=diloco("shared_topk", "ef", {"outer_lr": 1.0, "outer_momentum": 0.0, "error_decay": 0.95,
                                                    "overlap_steps": OVERLAP},
                              ratio=0.015, value_bits=2, indices="union")),
    Method(f"H={INNER_STEPS} shared 1% 2-bit + decayed EF, overlap {OVERLAP}",
           compression=diloco("shared_topk", "ef", {"outer_lr": 1.0, "outer_momentum": 0.0, "error_decay": 0.95,
                                                    "overlap_steps": OVERLAP}, ratio=0.01, value_bits=2)),
    # SparseLoCo's structure: each worker's own top-k of its decayed EF buffer (64 of every 4,096: 12-bit
    # indices), 2-bit values, all-gathered and averaged, outer lr 1 without momentum (the bench's decay 0.95)
    Method(f"SparseLoCo reference H={INNER_STEPS}",
           compression=diloco("topk", "ef", {"outer_lr": 1.0, "outer_momentum": 0.0, "error_decay": 0.95},
                              ratio=64 / 4096, segment=4096, value_bits=2)),
    Method(f"peer: torchft DiLoCo H={INNER_STEPS}", engine="torchft_diloco", inner_steps=INNER_STEPS),
]


def run_method(task: str, method: Method, seeds: list[int], steps: int, ranks: int, log_every: int) -> list[dict]:
    out = []
    for seed in seeds:
        results = run_ranks(TASKS[task], ranks, method, seed, steps, log_every, timeout_s=900)
        out.append(results[0] | {"seed": seed, "bytes": sum(r["bytes"] for r in results) / ranks})
    return out


def summarize(task: str, results: dict[str, list[dict]], steps: int) -> list[dict]:
    rows = compare(results, "fp32 all-reduce", steps)
    for row in rows:
        runs = results[row["method"]]
        residual = [n for r in runs for _, n in r["residual"]]
        row.update(task=task, residual_max=max(residual) if residual else None,
                   residual_last=runs[0]["residual"][-1][1] if runs[0]["residual"] else None)
    return rows


def print_table(rows: list[dict], seeds: int) -> None:
    print(f"\n{'method':<34} {'MB/step':>9} {'bits/param':>10} {'fewer':>8} {'loss mean ± std':>17} {'paired gap ± std':>18} "
          f"{'gap/std':>8} {'acc':>6} {'EF resid max/last':>18}")
    for r in rows:
        acc = f"{r['accuracy']:.3f}" if r["accuracy"] is not None else "-"
        resid = f"{r['residual_max']:.3g}/{r['residual_last']:.3g}" if r["residual_max"] is not None else "-"
        print(f"{r['method']:<34} {r['bytes_per_step'] / 2**20:9.4f} {r['bits_per_param']:10.4f} {r['fewer']:8.1f} "
              f"{r['loss']:9.4f} ± {r['std']:.4f} {r['gap']:+9.4f} ± {r['gap_std']:.4f} {r['gap_in_std']:+8.2f} "
              f"{acc:>6} {resid:>18}")
    print(f"({seeds} seeds; paired gap: each seed's loss minus fp32's on the same seed, mean and std over seeds)")


def verdicts(rows: list[dict], results: dict[str, list[dict]]) -> list[str]:
    """The issue's targets, checked on the measured rows of one task (``results``: its runs by method)."""
    by = {r["method"]: r for r in rows}
    lines = []
    topk, int4 = by["top-k 1% + EF"], by["int4 + EF"]
    lines.append(_verdict("top-k 1% + EF: >= 50x fewer bytes, paired gap within one paired std",
                          topk["fewer"] >= 50 and abs(topk["gap_in_std"]) <= 1, topk))
    lines.append(_verdict("int4 + EF: >= 7x fewer bytes, no measurable gap (within one paired std)",
                          int4["fewer"] >= 7 and abs(int4["gap_in_std"]) <= 1, int4))
    plain = results[f"DiLoCo H={INNER_STEPS}"]
    for name in (f"DiLoCo H={INNER_STEPS} int4", f"DiLoCo H={INNER_STEPS} int4 + EF",
                 f"DiLoCo H={INNER_STEPS} top-k 10% + EF"):
        row = by[name]
        mean, std = paired_gap(results[name], plain)
        gap = mean / std if std else 0.0
        lines.append(_verdict(f"{name}: >= 200x fewer bytes than per-step fp32, paired gap to DiLoCo within one "
                              f"paired std (gap {gap:+.2f} std)", row["fewer"] >= 200 and abs(gap) <= 1, row))
    for peer in [r for r in rows if r["method"].startswith("peer:")]:
        ours = [r for r in rows if not r["method"].startswith("peer:") and r["bytes_per_step"] <= peer["bytes_per_step"]
                and r["loss"] < peer["loss"]]
        best = min(ours, key=lambda r: r["loss"], default=None)
        detail = (f"{best['method']} at {best['fewer']:.0f}x fewer: loss {best['loss']:.4f} vs {peer['loss']:.4f}"
                  if best else "no hetero method with as few bytes has a lower loss")
        lines.append(_verdict(f"beat {peer['method'][6:]} ({peer['fewer']:.0f}x) at equal or fewer bytes: {detail}",
                              best is not None, peer))
    return lines


def _verdict(text: str, ok: bool, row: dict) -> str:
    return f"  [{'met' if ok else 'MISSED'}] {text}  (measured {row['fewer']:.1f}x, gap {row['gap']:+.4f})"


def ef_run(steps: int, ranks: int) -> None:
    """One long run per error-feedback method on the text task; the residual norm every steps/10 steps."""
    every = max(1, steps // 10)
    for name in ("top-k 1% + EF", "int4 + EF", "PowerSGD r1 + EF", f"DiLoCo H={INNER_STEPS} top-k 10% + EF"):
        method = next(m for m in METHODS if m.name == name)
        result = run_ranks(run_text, ranks, method, 0, steps, every, timeout_s=3600)[0]
        series = "  ".join(f"{s}:{n:.3g}" for s, n in result["residual"])
        print(f"{name:<34} residual norm by step  {series}  (held-out loss {result['loss']:.4f})", flush=True)


def _selected(name: str, wanted: list[str] | None) -> bool:
    """Every method without a selection; else those named exactly, or containing a part that names none."""
    if not wanted:
        return True
    names = {m.name for m in METHODS}
    return any(w == name or (w not in names and w in name) for w in wanted)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=320, help=f"training steps (a multiple of H={INNER_STEPS})")
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel ranks (2-4 on a small machine)")
    parser.add_argument("--methods", nargs="+", help="method names, or parts of names, to run (fp32 always runs)")
    parser.add_argument("--ef-steps", type=int, default=0, help="instead: one long run logging EF residuals")
    parser.add_argument("--fan-in", action="store_true", help="instead: bytes per worker at 4 to 64 workers")
    parser.add_argument("--params", type=int, default=1_000_000, help="with --fan-in: the parameters synced")
    parser.add_argument("--ceiling", action="store_true",
                        help="instead: uncompressed DiLoCo's paired gap for H in 4..32 and three outer learning rates")
    parser.add_argument("--outer-lrs", nargs="+", type=float, default=list(OUTER_LRS), help="with --ceiling")
    parser.add_argument("--link", action="store_true",
                        help="instead: step times on a simulated link where per-step fp32 DP mostly communicates")
    parser.add_argument("--latency-ms", type=float, default=5.0, help="with --link: the link's latency")
    parser.add_argument("--comm-factor", type=float, default=10.0,
                        help="with --link: fp32's all-reduce time on the link over the compute-only step")
    args = parser.parse_args(argv)
    if args.fan_in:
        print_fan_in(args.params)
        return
    if args.ceiling:
        print_ceiling(args.seeds, args.steps, args.ranks, tuple(args.outer_lrs))
        return
    if args.link:
        chosen = args.methods or list(LINK_METHODS)
        print_link([m for m in METHODS if _selected(m.name, chosen) and m.name != "fp32 all-reduce"],
                   args.seeds, args.steps, args.ranks, args.latency_ms, args.comm_factor)
        return
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and managers log every quorum at INFO
    if args.ef_steps:
        ef_run(args.ef_steps, args.ranks)
        return
    if args.steps % INNER_STEPS:
        parser.error(f"--steps={args.steps} must be a multiple of H={INNER_STEPS} so DiLoCo ends on a sync")
    ensure_data()
    methods = [m for m in METHODS if m.name == "fp32 all-reduce" or _selected(m.name, args.methods)]
    for task in args.tasks:
        results = {}
        for method in methods:
            start = time.perf_counter()
            results[method.name] = run_method(task, method, args.seeds, args.steps, args.ranks, max(1, args.steps // 10))
            losses = ", ".join(f"{r['loss']:.4f}" for r in results[method.name])
            print(f"[{task}] {method.name}: losses {losses} ({time.perf_counter() - start:.0f} s)", flush=True)
        rows = summarize(task, results, args.steps)
        print(f"\n== {task}: {args.ranks} ranks, {args.steps} steps ==")
        print_table(rows, len(args.seeds))
        if not args.methods:
            print("\n".join(verdicts(rows, results)), flush=True)


if __name__ == "__main__":
    main()
