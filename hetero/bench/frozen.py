"""``hetero bench frozen``: what freezing saves, trained against frozen side by side in one run.

``own_data_vlm`` on the example conversations (``hetero data example``), its tower at dp2 on ranks 0-1
and its projector (dp2) and LLM (tp2) on ranks 2-3, so the tower's edge crosses ranks. Five settings of
the same graph, one after the other: everything trained, LLaVA's stage 2 (the tower frozen) and stage 1
(the tower and the LLM frozen), each stage also with the tower computing the next step's first two
microbatches during this one (``vision.parallel.forward_ahead=2``). Per setting, after ``--warmup``
steps, over ``--steps``: the step time (the slowest rank's, median), per module its backward actions and
compute ms per step on one of its ranks (for the tower, alone on its ranks, also the share of the step
they sit idle), the gradient and optimizer-state MB one of its ranks holds, its gradient-sync bytes per
step, each edge's backward bytes per step (world-summed, as ``hetero train`` counts them), and how long
the projector's ranks wait in each step's first receive from the tower (median).
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hetero.bench.ranks import each_rank
from hetero.config import ExperimentConfig, load_experiment
from hetero.data.example import write_llava
from hetero.models import default_registry

PLACEMENT = ["projector.layout.offset=2"]  # the tower alone on ranks 0-1
AHEAD = ["vision.parallel.forward_ahead=2"]
FIRST_EDGE = "vision->projector"
SETTINGS = {"trained": [], "stage 2: tower frozen": ["vision.trainable=false"],
            "stage 2, tower 2 ahead": ["vision.trainable=false", *AHEAD],
            "stage 1: tower and LLM frozen": ["vision.trainable=false", "llm.trainable=false"],
            "stage 1, tower 2 ahead": ["vision.trainable=false", "llm.trainable=false", *AHEAD]}


def _local_bytes(tensors) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


def measure(rank: int, world_size: int, experiment: ExperimentConfig, steps: int, warmup: int) -> dict[str, Any]:
    """One rank's run: step times, its modules' backward actions, compute time and memory, and the
    world's bytes per communicator, per timed step."""
    from hetero.data.splits import load_splits
    from hetero.runtime import build_runtime
    from hetero.train.job import communicator_bytes

    runtime = build_runtime(experiment, default_registry())
    data = load_splits(experiment, runtime.graph, ("train",))["train"]
    times, before, seconds = [], {}, {}
    for step in range(warmup + steps):
        if step == warmup:
            before, seconds = communicator_bytes(runtime), runtime.timer.seconds()
            trace = runtime.start_trace()
        batch = data.batch(step)
        upcoming = data.batch(step + 1) if step + 1 < warmup + steps else None  # used where a module runs ahead
        dist.barrier()
        start = time.perf_counter()
        runtime.train_step(batch, upcoming)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    after, spent = communicator_bytes(runtime), runtime.timer.seconds()
    # the projector's ranks: how long each step's first receive from the tower waits
    waits = [span.end - span.start for span in trace.spans if span.name == f"EF {FIRST_EDGE} 0"]
    modules = {}
    for name, state in runtime.modules.items():
        state_tensors = [v for per_param in (state.optimizer.state.values() if state.optimizer else ())
                         for v in per_param.values() if torch.is_tensor(v) and v.dim() > 0]
        modules[name] = {
            "backwards": sum(a.op == "B" and a.target == name for a in runtime.actions[True]),
            "compute_ms": 1e3 * (spent[name] - seconds[name]) / steps,
            "grad_mb": _local_bytes(p.grad for p in state.model.parameters() if p.grad is not None) / 2**20,
            "optimizer_mb": _local_bytes(state_tensors) / 2**20,
        }
    return {"times": times, "modules": modules, "bytes": {k: (after[k] - before[k]) / steps for k in after},
            "first_wait_ms": 1e3 * statistics.median(waits) if "projector" in runtime.modules else None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hetero bench frozen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per setting")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--data", type=Path, default=None, help="the example conversations (default: written anew)")
    args = parser.parse_args(argv)
    path = args.data or write_llava(Path(tempfile.mkdtemp(prefix="bench_frozen.")), 400, seed=0)
    print(f"own_data_vlm: vision dp2 (ranks 0-1), projector dp2 and llm tp2 (ranks 2-3); {args.steps} steps each")
    print(f"{'setting':<30} {'step ms':>8} | {'module':<9} {'backwards':>9} {'compute ms':>10} {'idle %':>6} "
          f"{'grad MB':>8} {'optim MB':>8} {'sync KB':>8}")
    for setting, overrides in SETTINGS.items():
        experiment = load_experiment("own_data_vlm", [f"train.data.path={path}", *PLACEMENT, *overrides])
        per_rank = each_rank(measure, experiment, args.steps, args.warmup, timeout_s=1800)
        step_ms = 1e3 * statistics.median(max(step) for step in zip(*(r["times"] for r in per_rank)))
        first = {}  # each module's figures on the first rank that holds it
        for result in per_rank:
            for name, figures in result["modules"].items():
                first.setdefault(name, figures)
        world = per_rank[0]["bytes"]
        for i, (name, figures) in enumerate(first.items()):
            head = f"{setting:<30} {step_ms:8.1f}" if i == 0 else f"{'':<30} {'':>8}"
            idle = 100 * (1 - figures["compute_ms"] / step_ms) if name == "vision" else math.nan
            print(f"{head} | {name:<9} {figures['backwards']:9d} {figures['compute_ms']:10.1f} {idle:6.1f} "
                  f"{figures['grad_mb']:8.3f} {figures['optimizer_mb']:8.3f} {world[f'grad_sync.{name}'] / 1024:8.1f}")
        edges = ", ".join(f"{key.removeprefix('boundary.').removesuffix('.backward')} {value / 1024:.1f} KB"
                          for key, value in world.items() if key.startswith("boundary.") and key.endswith(".backward"))
        print(f"{'':<30} {'':>8} | gradients back per step: {edges}")
        wait = statistics.median(r["first_wait_ms"] for r in per_rank if r["first_wait_ms"] is not None)
        print(f"{'':<30} {'':>8} | the projector's wait for the tower's first microbatch: {wait:.1f} ms")


if __name__ == "__main__":
    main()
