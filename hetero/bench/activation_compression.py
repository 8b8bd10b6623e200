"""Compressed pipeline and boundary traffic side by side: bytes per step, final loss over seeds, memory.

    hetero bench activation-compression [--tasks llm_pp2 vlm] [--seeds 0 1 2] [--steps 240]

Every method trains the same model from the same seeds in this one run (``activation_tasks``: the LLM
with pp2, the VLM with a non-colocated boundary). Methods: fp32 (uncompressed, a fresh batch every step),
fp32 with lazy sampling (each batch reused for ``--reuse`` steps, to tell the sampling's effect from the
codec's), each codec with Clapping-style compensation under lazy sampling (2-bit forward also with a
4-bit first send of each fresh batch), and for 2-bit forward / 4-bit backward the two references:
direct quantization without compensation, and an AQ-SGD-style per-sample delta cache (fresh sampling);
last, 4-bit both ways without compensation. ``fewer`` is fp32's bytes on the compressed edge (both directions, summed
over ranks) divided by the method's; the gap is paired (``seed_stats``): the mean over seeds of each seed's
held-out loss minus fp32's on the same seed, also in units of the std of those differences; memory is the error-compensation state on the
rank holding the most at the end of training.

``--memory-samples`` then trains the LLM for ``--memory-steps`` steps on text sets of several sizes with
the lazy and the per-sample compensation and prints their memory: the first must not depend on the
dataset's size, the second grows with the samples seen (the whole set once it has seen an epoch).
"""

from __future__ import annotations

import argparse
import time

from hetero.bench.activation_tasks import TASKS, Method
from hetero.bench.compression_tasks import ensure_data
from hetero.bench.seed_stats import compare, paired_gap
from hetero.parallel.compression.edge_config import ActivationCodecConfig, EdgeCompressionConfig
from hetero.testing.multiprocess import run_ranks

BASELINE = "fp32"
LAZY_BASELINE = "fp32, lazy sampling"
TARGET = "int2 fwd / int4 bwd, Clapping"
TARGET_REFRESH = "int2 (int4 refresh) / int4, Clapping"


def edge(forward: str, backward: str, compensation: str = "lazy", refresh: str = "none") -> EdgeCompressionConfig:
    return EdgeCompressionConfig(
        ActivationCodecConfig(forward), ActivationCodecConfig(backward), compensation, ActivationCodecConfig(refresh)
    )


def methods(reuse: int) -> list[Method]:
    return [
        Method(BASELINE),
        Method(LAZY_BASELINE, reuse=reuse),
        Method("bf16, Clapping", edge("bf16", "bf16"), reuse),
        Method("int8, Clapping", edge("int8", "int8"), reuse),
        Method("int4, Clapping", edge("int4", "int4"), reuse),
        Method(TARGET, edge("int2", "int4"), reuse),
        Method(TARGET_REFRESH, edge("int2", "int4", refresh="int4"), reuse),
        Method("top-k 10% fwd / int4 bwd, Clapping", edge("topk", "int4"), reuse),
        Method("int2 / int4 direct", edge("int2", "int4", "none")),
        Method("int2 / int4 AQ-SGD per-sample cache", edge("int2", "int4", "per_sample")),
        Method("int4 / int4 direct", edge("int4", "int4", "none")),
    ]


def run_task(task: str, chosen: list[Method], seeds: list[int], steps: int) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {m.name: [] for m in chosen}
    for seed in seeds:
        start = time.perf_counter()
        per_method = run_ranks(TASKS[task], 2, chosen, seed, steps, timeout_s=3600)[0]
        for name, result in per_method.items():
            results[name].append(result | {"seed": seed})
        losses = ", ".join(f"{name}: {r['loss']:.4f}" for name, r in per_method.items())
        print(f"[{task}] seed {seed} ({time.perf_counter() - start:.0f} s): {losses}", flush=True)
    return results


def summarize(results: dict[str, list[dict]], steps: int) -> list[dict]:
    rows = compare(results, BASELINE, steps)
    for row in rows:
        row["memory"] = max(r["memory"] for r in results[row["method"]])
    lazy = next((r for r in rows if r["method"] == LAZY_BASELINE), None)
    for row in rows:  # the paired gap to fp32 trained on the same lazily sampled batches
        if lazy is not None:
            gap, std = paired_gap(results[row["method"]], results[LAZY_BASELINE])
            row["lazy_gap"], row["lazy_gap_in_std"] = gap, gap / std if std else 0.0
    return rows


def print_table(rows: list[dict], seeds: int) -> None:
    print(f"\n{'method':<38} {'KB/step':>8} {'fewer':>6} {'loss mean ± std':>17} {'gap':>8} {'gap/std':>8} "
          f"{'lazy gap/std':>12} {'acc':>6} {'EC memory':>10}")
    for r in rows:
        acc = f"{r['accuracy']:.3f}" if r["accuracy"] is not None else "-"
        lazy = f"{r['lazy_gap_in_std']:+.2f}" if "lazy_gap_in_std" in r else "-"
        print(f"{r['method']:<38} {r['bytes_per_step'] / 1024:8.1f} {r['fewer']:6.2f} "
              f"{r['loss']:9.4f} ± {r['std']:.4f} {r['gap']:+8.4f} {r['gap_in_std']:+8.2f} {lazy:>12} {acc:>6} "
              f"{r['memory'] / 1024:8.0f}KB")
    print(f"({seeds} seeds; gap: each seed's loss minus fp32's on the same seed, mean over seeds; gap/std in units "
          f"of those differences' std; lazy gap/std: the same against fp32 on the same lazily sampled batches)")


def verdicts(rows: list[dict]) -> list[str]:
    lines = []
    for name in (TARGET, TARGET_REFRESH):
        row = next((r for r in rows if r["method"] == name), None)
        if row is None:
            continue
        for label, gap, in_std in (("fp32", row["gap"], row["gap_in_std"]),
                                    ("fp32 on the same lazy batches", row.get("lazy_gap"), row.get("lazy_gap_in_std"))):
            if gap is None:
                continue
            ok = row["fewer"] >= 9 and abs(in_std) <= 1
            lines.append(f"  [{'met' if ok else 'MISSED'}] {name}: ≈10x fewer bytes, gap to {label} within one "
                         f"paired std (measured {row['fewer']:.2f}x, gap {gap:+.4f} = {in_std:+.2f} std)")
    return lines


def memory_by_dataset_size(sizes: list[int], steps: int, reuse: int) -> None:
    chosen = [Method("lazy", edge("int2", "int4"), reuse), Method("per_sample", edge("int2", "int4", "per_sample"))]
    print(f"\n== error-compensation memory by training-set size (llm_pp2, {steps} steps, largest rank) ==")
    for size in sizes:
        result = run_ranks(TASKS["llm_pp2"], 2, chosen, 0, steps, timeout_s=3600, train_samples=size)[0]
        print(f"  {size:6d} samples: Clapping (lazy) {result['lazy']['memory'] / 1024:8.0f} KB   "
              f"AQ-SGD (per sample) {result['per_sample']['memory'] / 1024:8.0f} KB", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="*", default=list(TASKS), choices=list(TASKS), help="none: memory only")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--reuse", type=int, default=4, help="lazy sampling: steps each batch serves")
    parser.add_argument("--methods", nargs="+", help="parts of method names to run (fp32 always runs)")
    parser.add_argument("--memory-samples", nargs="*", type=int, default=[256, 1024, 4096])
    parser.add_argument("--memory-steps", type=int, default=256, help="one epoch of 4096 samples in batches of 16")
    args = parser.parse_args(argv)
    ensure_data()
    chosen = [m for m in methods(args.reuse)
              if m.name == BASELINE or not args.methods or any(w in m.name for w in args.methods)]
    for task in args.tasks:
        rows = summarize(run_task(task, chosen, args.seeds, args.steps), args.steps)
        print(f"\n== {task}: 2 ranks, {args.steps} steps ==")
        print_table(rows, len(args.seeds))
        print("\n".join(verdicts(rows)), flush=True)
    if args.memory_samples:
        memory_by_dataset_size(args.memory_samples, args.memory_steps, args.reuse)


if __name__ == "__main__":
    main()
