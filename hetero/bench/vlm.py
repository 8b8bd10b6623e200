"""Throughput of one vision-language model under homogeneous, colocated and non-colocated layouts.

    hetero bench vlm [--steps 10]
    torchrun --nproc_per_node 4 -m hetero.bench.vlm [--steps 10]   (the layouts of 4 ranks, NCCL on GPUs)

Each shipped experiment (homogeneous_vlm, colocated_vlm, non_colocated_vlm) trains the same model on
the same digits batches, in one run, one after the other (``hetero.bench.throughput.measure``: the
slowest rank's time per step); the table gives the median step time,
tokens/s and tokens/s per rank, and each as a ratio to the first layout measured. Under torchrun the
layouts of the launched world size run (homogeneous and colocated on 4, non-colocated on 6). On this 2-core machine
every rank shares the same two cores, so the ratios say more about overheads than about a cluster.
"""

from __future__ import annotations

import argparse
import os
import statistics

from hetero.bench.ranks import each_rank, launched_by_torchrun
from hetero.bench.throughput import absolute_paths, measure
from hetero.config import load_experiment
from hetero.graph import build_graph
from hetero.models import default_registry

EXPERIMENTS = ("homogeneous_vlm", "colocated_vlm", "non_colocated_vlm")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per layout (after 3 warmup steps)")
    args = parser.parse_args(argv)
    rows, kinds = [], default_registry()
    world_size = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else None
    for name in EXPERIMENTS:
        experiment = absolute_paths(load_experiment(name))
        placement = build_graph(experiment, kinds).placement
        if world_size is not None and placement.world_size != world_size:
            if int(os.environ["RANK"]) == 0:
                print(f"{name}: skipped, it runs on {placement.world_size} ranks and torchrun started {world_size}")
            continue
        per_rank = each_rank(measure, experiment, args.steps, 3, timeout_s=600)
        if per_rank is None:
            continue
        step_s = statistics.median(max(step) for step in zip(*(r["times"] for r in per_rank)))
        tokens = experiment.batch.global_batch_size * experiment.model_config("llm", kinds).seq_len
        rows.append((name, placement.world_size, step_s, tokens / step_s, tokens / step_s / placement.world_size))
    if not rows:
        return
    base = rows[0]
    print(f"{'experiment':<20} {'ranks':>5} {'step ms':>9} {'tokens/s':>10} {'ratio':>6} {'tok/s/rank':>11} {'ratio':>6}")
    for name, ranks, step_s, tps, per_rank_tps in rows:
        print(f"{name:<20} {ranks:>5} {step_s * 1e3:9.1f} {tps:10.0f} {tps / base[3]:6.2f} {per_rank_tps:11.0f} "
              f"{per_rank_tps / base[4]:6.2f}")


if __name__ == "__main__":
    main()
