"""hetero's single-rank training step (the runtime on a world of one process) against a plain PyTorch loop
on the same model and data.

    python -m hetero.bench.overhead [--steps 150]

The loops run in this process, taking turns step by step so that machine noise hits them alike. The
plain loop does the math hetero's step does: hetero's default ``optim.grad_clip=1.0`` takes the gradient
norm and clips at it, as nanoGPT's and torchtitan's loops do with ``clip_grad_norm_``. The headline ratio
(target: at most 1.02) is the median over steps of hetero's step time over that loop's in the same step;
the ratio against a loop without the norm is printed beside it, and the largest differences of the
losses and gradient norms show that the loops trained the same model.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hetero.config import OptimizerConfig, TrainConfig
from hetero.data.text import VOCAB_SIZE, load_stdlib_corpus, sample_batch
from hetero.models import default_registry
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.model import GPT, token_loss_sum
from hetero.parallel.mesh import init_single_process
from hetero.runtime import build_runtime
from hetero.testing.experiments import experiment, module

MODEL = GPTConfig(vocab_size=VOCAB_SIZE, hidden_size=128, num_layers=2, num_heads=4, seq_len=128)
BATCH = 8
LR = 1e-3


class PlainLoop:
    """What a user would write by hand: forward, loss, backward, ``clip_grad_norm_`` (unless ``grad_clip``
    is 0), AdamW step, read the loss (and the norm)."""

    def __init__(self, config: GPTConfig, seed: int, grad_clip: float):
        torch.manual_seed(seed)
        self.model = GPT(config)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
        self.grad_clip = grad_clip

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        loss = token_loss_sum(self.model(batch["tokens"]), batch["labels"]) / batch["tokens"].numel()
        loss.backward()
        out = {"loss": loss.item()}
        if self.grad_clip > 0:
            out["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip).item()
        self.optimizer.step()
        return out


def measure(steps: int, warmup: int = 5, seed: int = 0) -> dict[str, float]:
    corpus = load_stdlib_corpus()
    init_single_process()
    grad_clip = TrainConfig().grad_clip  # hetero's default
    lone = {"llm": module("gpt", MODEL, {}, OptimizerConfig(lr=LR))}
    loops = {
        "plain": PlainLoop(MODEL, seed, grad_clip),
        "plain_no_norm": PlainLoop(MODEL, seed, 0.0),
        "hetero": build_runtime(experiment(1, lone, global_batch=BATCH, microbatches=1, seed=seed,
                                               grad_clip=grad_clip), default_registry()),
    }
    names = list(loops)
    times: dict[str, list[float]] = {name: [] for name in loops}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in loops}
    for step in range(warmup + steps):
        tokens, labels = sample_batch(corpus.train, BATCH, MODEL.seq_len, step, seed)
        for name in names[step % len(names):] + names[: step % len(names)]:  # each loop first in turn
            start = time.perf_counter()
            results[name].append(loops[name].train_step({"tokens": tokens, "labels": labels}))
            if step >= warmup:
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}

    def paired(base: str) -> float:
        return statistics.median(h / p for h, p in zip(times["hetero"], times[base]))

    def largest_difference(key: str, base: str) -> float:
        return max(abs(a[key] - b[key]) for a, b in zip(results[base], results["hetero"]))

    return {
        "plain_ms": medians["plain"] * 1e3,
        "plain_no_norm_ms": medians["plain_no_norm"] * 1e3,
        "hetero_ms": medians["hetero"] * 1e3,
        "ratio": paired("plain"),
        "ratio_of_medians": medians["hetero"] / medians["plain"],
        "ratio_no_norm": paired("plain_no_norm"),
        "max_loss_difference": largest_difference("loss", "plain"),
        "max_grad_norm_difference": largest_difference("grad_norm", "plain"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150, help="timed steps per loop (after 5 warmup steps)")
    args = parser.parse_args(argv)
    result = measure(args.steps)
    print(f"model {MODEL.num_layers} layers x {MODEL.hidden_size}, batch {BATCH} x {MODEL.seq_len} bytes, "
          f"{args.steps} timed steps each, taking turns")
    print(f"plain PyTorch loop, clip_grad_norm_  median step {result['plain_ms']:8.2f} ms")
    print(f"plain PyTorch loop, no norm          median step {result['plain_no_norm_ms']:8.2f} ms")
    print(f"hetero single rank                   median step {result['hetero_ms']:8.2f} ms")
    print(f"ratio hetero / plain {result['ratio']:.3f} per step (of the medians {result['ratio_of_medians']:.3f}; "
          f"against the loop without the norm {result['ratio_no_norm']:.3f})")
    print(f"largest differences from the plain loop: loss {result['max_loss_difference']:.2e}, "
          f"gradient norm {result['max_grad_norm_difference']:.2e}")


if __name__ == "__main__":
    main()
