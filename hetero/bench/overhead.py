"""hetero's single-rank training step (the runtime on a world of one process) against a plain PyTorch loop
on the same model and data.

    python -m hetero.bench.overhead [--steps 30]

Both loops run in this process, alternating step by step so that machine noise hits both alike. The
printed ratio is the median over steps of hetero's step time over the plain loop's in the same step
(target: at most 1.02); the ratio of the two medians is printed beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hetero.config import OptimizerConfig
from hetero.data.text import VOCAB_SIZE, load_stdlib_corpus, sample_batch
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.model import GPT, token_loss_sum
from hetero.parallel.mesh import init_single_process
from hetero.runtime import build_runtime
from hetero.testing.experiments import experiment, module

MODEL = GPTConfig(vocab_size=VOCAB_SIZE, hidden_size=128, num_layers=2, num_heads=4, seq_len=128)
BATCH = 8
LR = 1e-3


class PlainLoop:
    """What a user would write by hand: forward, loss, backward, AdamW step, read the loss."""

    def __init__(self, config: GPTConfig, seed: int):
        torch.manual_seed(seed)
        self.model = GPT(config)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        loss = token_loss_sum(self.model(batch["tokens"]), batch["labels"]) / batch["tokens"].numel()
        loss.backward()
        self.optimizer.step()
        return {"loss": loss.item()}


def measure(steps: int, warmup: int = 5, seed: int = 0) -> dict[str, float]:
    corpus = load_stdlib_corpus()
    init_single_process()
    lone = {"llm": module("gpt", MODEL, {}, OptimizerConfig(lr=LR))}
    loops = {
        "plain": PlainLoop(MODEL, seed),
        "hetero": build_runtime(experiment(1, lone, global_batch=BATCH, microbatches=1, seed=seed)),
    }
    times: dict[str, list[float]] = {name: [] for name in loops}
    losses: dict[str, list[float]] = {name: [] for name in loops}
    for step in range(warmup + steps):
        tokens, labels = sample_batch(corpus.train, BATCH, MODEL.seq_len, step, seed)
        order = list(loops) if step % 2 == 0 else list(reversed(loops))
        for name in order:
            start = time.perf_counter()
            losses[name].append(loops[name].train_step({"tokens": tokens, "labels": labels})["loss"])
            if step >= warmup:
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {
        "plain_ms": medians["plain"] * 1e3,
        "hetero_ms": medians["hetero"] * 1e3,
        "ratio": statistics.median(h / p for h, p in zip(times["hetero"], times["plain"])),
        "ratio_of_medians": medians["hetero"] / medians["plain"],
        "max_loss_difference": max(abs(a - b) for a, b in zip(losses["plain"], losses["hetero"])),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="timed steps per loop (after 5 warmup steps)")
    args = parser.parse_args(argv)
    result = measure(args.steps)
    print(f"model {MODEL.num_layers} layers x {MODEL.hidden_size}, batch {BATCH} x {MODEL.seq_len} bytes, "
          f"{args.steps} timed steps each, alternating")
    print(f"plain PyTorch loop   median step {result['plain_ms']:8.2f} ms")
    print(f"hetero single rank   median step {result['hetero_ms']:8.2f} ms")
    print(f"ratio hetero / plain {result['ratio']:.3f} per step (of the medians {result['ratio_of_medians']:.3f}; "
          f"largest loss difference {result['max_loss_difference']:.2e})")


if __name__ == "__main__":
    main()
