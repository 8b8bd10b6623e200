"""The four-module graph under its mixed and its colocated placement, side by side in one run.

    hetero bench graph [--steps 5] [--warmup 2] [--json]
    torchrun --nproc_per_node 8 -m hetero.bench.graph [...]     (one launched job of 8 ranks, NCCL on GPUs)

Each placement (``full_graph``: encoders on ranks 0-1, LLM tp2·pp2 on 2-5, generator dp2 on 6-7;
``full_graph_colocated``: every module on all 8 ranks) trains the same models on the same batches for
warmup + timed steps. Reported per placement: the step time (median over timed steps of the slowest
rank's), each module's compute time per step (the largest over its ranks; the rest of a step is edges,
stage links, gradient syncs and waiting), and the bytes per step of every communicator: each edge per
direction, the LLM's stage links and each module's gradient sync (``hetero.train.job``'s counts). On this 2-core machine 8 ranks share
two cores, so times say more about overheads than about a cluster; bytes are exact.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch.distributed as dist

from hetero.bench.throughput import absolute_paths
from hetero.config import ExperimentConfig, load_experiment
from hetero.graph import build_graph
from hetero.bench.ranks import each_rank
from hetero.models import default_registry

PLACEMENTS = ("full_graph", "full_graph_colocated")


def measure(rank: int, world_size: int, experiment: ExperimentConfig, steps: int, warmup: int) -> dict[str, Any]:
    """One rank's run: its step times and the world's bytes and module seconds per timed step."""
    from hetero.runtime import build_runtime
    from hetero.data.splits import load_splits
    from hetero.train.job import communicator_bytes, module_seconds

    trainer = build_runtime(experiment, default_registry())
    data = load_splits(experiment, trainer.graph, ("train",))
    times: list[float] = []
    bytes_before: dict[str, int] = {}
    seconds_before: dict[str, float] = {}
    for step in range(warmup + steps):
        if step == warmup:
            bytes_before, seconds_before = communicator_bytes(trainer), module_seconds(trainer)
        batch = data["train"].batch(step)
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step(batch)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    bytes_after, seconds_after = communicator_bytes(trainer), module_seconds(trainer)
    return {
        "times": times,
        "bytes": {name: (bytes_after[name] - bytes_before[name]) / steps for name in bytes_after},
        "module_s": {name: (seconds_after[name] - seconds_before[name]) / steps for name in seconds_after},
    }


def run(steps: int, warmup: int, overrides: list[str]) -> dict[str, dict[str, Any]] | None:
    """Both placements' figures (None on a torchrun rank other than 0)."""
    results = {}
    for name in PLACEMENTS:
        experiment = absolute_paths(load_experiment(name, overrides))
        placement = build_graph(experiment, default_registry()).placement
        per_rank = each_rank(measure, experiment, steps, warmup)
        if per_rank is None:
            continue
        results[name] = {
            "ranks": placement.world_size,
            "layouts": {m: f"tp{l.tp}·pp{l.pp}·dp{l.dp} ranks {l.describe_ranks()}" for m, l in placement.layouts.items()},
            "step_s": statistics.median(max(step) for step in zip(*(r["times"] for r in per_rank))),
            "module_s": per_rank[0]["module_s"],
            "bytes": per_rank[0]["bytes"],
        }
    return results or None


def print_table(results: dict[str, dict[str, Any]]) -> None:
    names = list(results)
    width = max(len(key) for r in results.values() for key in [*r["bytes"], *r["module_s"]]) + 2
    print(f"{'':<{width}}" + "".join(f"{n:>24}" for n in names))
    print(f"{'step ms':<{width}}" + "".join(f"{r['step_s'] * 1e3:24.1f}" for r in results.values()))
    for module in results[names[0]]["module_s"]:
        print(f"{'time/step ' + module:<{width}}"
              + "".join(f"{r['module_s'][module] * 1e3:21.1f} ms" for r in results.values()))
    for key in results[names[0]]["bytes"]:
        print(f"{key + ' /step':<{width}}" + "".join(f"{r['bytes'][key] / 1024:21.1f} KB" for r in results.values()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per placement")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both placements, e.g. train.data_dir=...")
    args = parser.parse_args(argv)
    results = run(args.steps, args.warmup, args.overrides)
    if results is None:
        return
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_table(results)


if __name__ == "__main__":
    main()
