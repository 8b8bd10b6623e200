"""Phased against one 1F1B over the graph, side by side on 2 ranks (one per core: an idle rank is an idle core).

    hetero bench schedules [--steps 4] [--alternations 3]

Placements:
- ``full graph``: the shipped ``full_graph`` experiment with the vision and DNA encoders and the video
  generator on rank 0, the LLM on rank 1 (phased, rank 1 waits for the encoders and rank 0 for the LLM);
- ``colocated VLM``: the shipped ``colocated_vlm`` with the LLM pp2 over ranks 0-1 and the vision encoder
  dp2 on both, 4 microbatches (phased, the encoder runs before and after the whole pipeline).

Each placement trains under both schedules, alternating ``--alternations`` times (one warmup step, then
``--steps`` timed steps each time). Reported per schedule: the median step time (the slowest rank's) over
every timed step, and each rank's busy fraction: its compute time (the forwards and backwards of its
modules, ``Runtime.timer``) over the step time. Ratios are measured side by side in one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch.distributed as dist

from hetero.bench.ranks import each_rank
from hetero.bench.throughput import absolute_paths
from hetero.config import ExperimentConfig, load_experiment

SCHEDULES = ("phased", "graph_1f1b")
PLACEMENTS = {
    "full graph (encoders + generator on rank 0, LLM on rank 1)": (
        "full_graph", ["world_size=2", "vision.layout.dp=1", "dna.layout.dp=1", "video.layout.dp=1",
                       "video.layout.offset=0", "llm.layout.tp=1", "llm.layout.pp=1", "llm.layout.offset=1",
                       "batch.global_batch_size=8", "batch.micro_batch_size=2", "llm.micro_batch_size=2"]),
    "colocated VLM (LLM pp2 on ranks 0-1, vision dp2)": (
        "colocated_vlm", ["world_size=2", "vision.layout.dp=2", "llm.layout.tp=1", "llm.layout.dp=1",
                          "llm.layout.pp=2", "batch.global_batch_size=16", "batch.micro_batch_size=4",
                          "vision.micro_batch_size=2"]),
}


def measure(rank: int, world_size: int, experiment: ExperimentConfig, steps: int) -> dict[str, Any]:
    """This rank's step times and compute seconds per timed step."""
    from hetero.runtime import build_runtime
    from hetero.train.datasets import load_splits

    runtime = build_runtime(experiment)
    data = load_splits(experiment, runtime.graph, ("train",))["train"]
    runtime.train_step(data.batch(0))  # warmup
    times, busy = [], []
    for step in range(1, steps + 1):
        before = sum(runtime.timer.seconds().values())
        dist.barrier()
        tick = time.perf_counter()
        runtime.train_step(data.batch(step))
        times.append(time.perf_counter() - tick)
        busy.append(sum(runtime.timer.seconds().values()) - before)
    return {"times": times, "busy": busy}


def run(steps: int, alternations: int) -> dict[str, dict[str, dict[str, Any]]] | None:
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for label, (name, overrides) in PLACEMENTS.items():
        runs: dict[str, list[list[dict[str, Any]]]] = {schedule: [] for schedule in SCHEDULES}
        for _ in range(alternations):
            for schedule in SCHEDULES:
                experiment = absolute_paths(load_experiment(name, [*overrides, f"schedule={schedule}"]))
                per_rank = each_rank(measure, experiment, steps, timeout_s=900)
                if per_rank is None:
                    return None
                runs[schedule].append(per_rank)
        results[label] = {}
        for schedule, repeats in runs.items():
            step_times = [max(step) for per_rank in repeats for step in zip(*(r["times"] for r in per_rank))]
            busy = [sum(b for per_rank in repeats for b in per_rank[rank]["busy"])
                    / sum(t for per_rank in repeats for t in per_rank[rank]["times"]) for rank in range(2)]
            results[label][schedule] = {"step_s": statistics.median(step_times), "busy": busy}
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--alternations", type=int, default=3, help="times each schedule runs, in turn")
    args = parser.parse_args(argv)
    results = run(args.steps, args.alternations)
    if results is None:
        return
    for label, by_schedule in results.items():
        print(label)
        base = by_schedule["phased"]["step_s"]
        for schedule, figures in by_schedule.items():
            busy = ", ".join(f"rank {r} {b:.0%}" for r, b in enumerate(figures["busy"]))
            print(f"  {schedule:<11} {figures['step_s'] * 1e3:8.1f} ms/step  x{base / figures['step_s']:.2f} "
                  f"vs phased   busy: {busy}")


if __name__ == "__main__":
    main()
