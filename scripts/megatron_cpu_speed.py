"""Steps per second of one process training the main job's LLM (``colocated_vlm``'s gpt: 256 tokens,
hidden 64, 2 layers, 40 positions, 16 rows a step, fp32) on the native backend and on megatron-core's,
in alternating rounds in one run (this machine is noisy). Information, not a target: megatron-core runs
on CPU only under the tests' substitutions (``hetero.testing.megatron_cpu``).

    python scripts/megatron_cpu_speed.py [--rounds 5] [--steps 20]
"""

import argparse
import statistics
import time
from dataclasses import replace

import torch

from hetero.config import OptimizerConfig
from hetero.models.gpt.config import GPTConfig
from hetero.testing.kinds import build_runtime  # the built-in kinds
from hetero.testing.experiments import experiment, module
from hetero.testing.megatron_cpu import megatron_on_cpu
from hetero.testing.multiprocess import run_ranks

LLM = GPTConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, seq_len=40)
ROWS = 16


def measure(rank, world_size, rounds: int, steps: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    tokens = torch.randint(0, LLM.vocab_size, (ROWS, LLM.seq_len + 1), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}
    rates: dict[str, list[float]] = {"native": [], "megatron": []}
    with megatron_on_cpu():
        runtimes = {backend: build_runtime(experiment(1, {"llm": module("gpt", replace(LLM, backend=backend), {},
                                                                        OptimizerConfig(lr=3e-4))},
                                                      global_batch=ROWS, microbatches=1))
                    for backend in rates}
        for runtime in runtimes.values():  # warm-up
            for _ in range(3):
                runtime.train_step(batch)
        for _ in range(rounds):
            for backend, runtime in runtimes.items():
                started = time.perf_counter()
                for _ in range(steps):
                    runtime.train_step(batch)
                rates[backend].append(steps / (time.perf_counter() - started))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    (rates,) = run_ranks(measure, 1, args.rounds, args.steps, timeout_s=1200)
    native, megatron = statistics.median(rates["native"]), statistics.median(rates["megatron"])
    print(f"one process, 1 thread, median of {args.rounds} rounds of {args.steps} steps: native {native:.1f} steps/s, "
          f"megatron {megatron:.1f} steps/s, megatron/native {megatron / native:.2f}")


if __name__ == "__main__":
    main()
