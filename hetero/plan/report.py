"""What ``hetero plan`` prints, writes as JSON and plots."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from hetero.plan.cluster import ClusterSpec
from hetero.plan.search import BASELINES, MODES, Plan
from hetero.plan.workload import Workload


BASELINE_NAMES = {
    "megatron": "the Megatron-style baseline (every module on the LLM's grid, the encoders in its first stage, "
                "the layers split evenly)",
    "homogeneous": "the best homogeneous plan (its first stage's layers tuned)",
}


def heterogeneous_gain(plans: dict[str, list[Plan]], baseline: str = "homogeneous") -> float | None:
    """``baseline``'s best step time over the best heterogeneous one (> 1: heterogeneous is faster)."""
    hetero = [p[0].step_s for mode, p in plans.items() if mode not in BASELINES and p]
    if not plans.get(baseline) or not hetero:
        return None
    return plans[baseline][0].step_s / min(hetero)


def plan_row(plan: Plan, cluster: ClusterSpec) -> str:
    mfu = plan.tflops_per_gpu / cluster.device.peak_tflops
    parts = plan.breakdown()
    shares = " ".join(f"{parts[key] / plan.step_s:5.0%}" for key in ("compute_s", "comm_s", "idle_s"))
    return (f"{plan.mode:<14} {plan.step_s:9.4g} {plan.tflops_per_gpu:12.4g} {mfu:6.1%} {plan.memory_gib:8.3g} "
            f"{shares}   {plan.describe()}")


def format_context(context: int, workload: Workload, plans: dict[str, list[Plan]], cluster: ClusterSpec, top: int) -> str:
    images = ", ".join(f"{workload.samples(n)} {n} samples" for n in workload.others)
    lines = [
        f"context {context}: {workload.sequences} sequences{', ' + images if images else ''} per step, "
        f"{workload.model_flops / 1e15:.3g} PFLOP (model FLOPs) on {cluster.world_size} devices of {cluster.name}",
        f"{'placement':<14} {'step s':>9} {'TFLOP/s/GPU':>12} {'MFU':>6} {'mem GiB':>8} {'comp.':>5} {'comm':>5} "
        f"{'idle':>5}   layouts",
    ]
    for mode in MODES:
        lines.append(plan_row(plans[mode][0], cluster) if plans[mode] else f"{mode:<14} (no layout fits)")
    for baseline in BASELINES:
        if (gain := heterogeneous_gain(plans, baseline)) is not None:
            lines.append(f"best heterogeneous is {gain:.3f}x the throughput of {BASELINE_NAMES[baseline]}")
    ranked = sorted((p for ps in plans.values() for p in ps[:top]), key=lambda p: p.step_s)[:top]
    if top > 1 and ranked:
        lines.append(f"the {len(ranked)} fastest plans:")
        lines += [f"  {plan_row(p, cluster)}" for p in ranked]
    return "\n".join(lines)


def plan_json(plan: Plan) -> dict:
    return {
        "mode": plan.mode, "step_s": plan.step_s, "tflops_per_gpu": plan.tflops_per_gpu,
        "memory_gib": plan.memory_gib, "boundary_s": plan.boundary_s, "host_s": plan.host_s, "ranks": plan.ranks,
        "breakdown": plan.breakdown(),
        "layouts": {n: asdict(c) for n, c in plan.choices.items()},
        "modules": {n: asdict(c) for n, c in plan.costs.items()},
    }


def plot(results: list[tuple[int, dict[str, list[Plan]]]], cluster: ClusterSpec, title: str, path: Path) -> None:
    """Predicted TFLOP/s per GPU of each placement mode's best plan, and the heterogeneous gain, per context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = [c for c, _ in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in MODES:
        points = [(c, p[mode][0].tflops_per_gpu) for c, p in results if p[mode]]
        if points:
            left.plot(*zip(*points), marker="o", label=mode.replace("_", "-"))
    left.set(xscale="log", xlabel="LLM context (tokens)", ylabel="predicted TFLOP/s per GPU",
             title=f"best plan per placement ({cluster.world_size} devices)")
    left.set_xticks(contexts, [f"{c // 1024}k" for c in contexts])
    left.legend()
    for baseline, color in zip(BASELINES, ("black", "grey")):
        gains = [(c, g) for c, p in results if (g := heterogeneous_gain(p, baseline)) is not None]
        if gains:
            right.plot(*zip(*gains), marker="o", color=color, label=f"over {baseline}")
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set(xscale="log", xlabel="LLM context (tokens)", ylabel="baseline step / heterogeneous step",
              title="gain of the best heterogeneous plan")
    right.legend()
    right.set_xticks(contexts, [f"{c // 1024}k" for c in contexts])
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
