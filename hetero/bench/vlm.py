"""Throughput of one vision-language model under homogeneous, colocated and non-colocated layouts.

    hetero bench vlm [--steps 10]

Each shipped experiment (homogeneous_vlm, colocated_vlm, non_colocated_vlm) trains the same model on
the same digits batches, in one run, one after the other; the table gives the median step time,
tokens/s and tokens/s per rank, and each as a ratio to the homogeneous layout. On this 2-core machine
every rank shares the same two cores, so the ratios say more about overheads than about a cluster.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch.distributed as dist

from hetero.config import load_experiment, validate
from hetero.data.digits import DigitBatches, ensure_digit_shards
from hetero.parallel.mesh import build_module_meshes
from hetero.testing.multiprocess import run_ranks
from hetero.train.vlm import ModuleSetup, VLMTrainer

EXPERIMENTS = ("homogeneous_vlm", "colocated_vlm", "non_colocated_vlm")


def measure(rank: int, world_size: int, name: str, steps: int, warmup: int) -> float:
    experiment = load_experiment(name)
    placement = validate(experiment)
    meshes = build_module_meshes(placement)
    vision, llm = experiment.model_config("vision"), experiment.model_config("llm")
    data = DigitBatches(experiment.train.data_dir, "train", experiment.batch.global_batch_size,
                        vision.num_patches, llm.seq_len, experiment.seed)
    trainer = VLMTrainer(
        placement, meshes, vision, llm,
        num_microbatches=experiment.num_microbatches("llm", placement.layouts["llm"].dp),
        setups={n: ModuleSetup(m.parallel, m.optim, m.compression) for n, m in experiment.modules.items()},
        grad_clip=experiment.train.grad_clip, seed=experiment.seed,
    )
    times = []
    for step in range(warmup + steps):
        batch = data.batch(step)
        dist.barrier()
        start = time.perf_counter()
        trainer.train_step(batch)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per layout (after 3 warmup steps)")
    args = parser.parse_args(argv)
    rows = []
    for name in EXPERIMENTS:
        experiment = load_experiment(name)
        placement = validate(experiment)
        ensure_digit_shards(experiment.train.data_dir)
        step_s = run_ranks(measure, placement.world_size, name, args.steps, 3, timeout_s=600)[0]
        tokens = experiment.batch.global_batch_size * experiment.model_config("llm").seq_len
        rows.append((name, placement.world_size, step_s, tokens / step_s, tokens / step_s / placement.world_size))
    base = rows[0]
    print(f"{'experiment':<20} {'ranks':>5} {'step ms':>9} {'tokens/s':>10} {'ratio':>6} {'tok/s/rank':>11} {'ratio':>6}")
    for name, ranks, step_s, tps, per_rank in rows:
        print(f"{name:<20} {ranks:>5} {step_s * 1e3:9.1f} {tps:10.0f} {tps / base[3]:6.2f} {per_rank:11.0f} "
              f"{per_rank / base[4]:6.2f}")


if __name__ == "__main__":
    main()
