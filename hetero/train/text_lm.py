"""Train the small default GPT on real text (Python's standard library sources, byte-level) on one rank
and print the held-out learning curve in bits per byte.

    python -m hetero.train.text_lm --minutes 10
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict

import torch

from hetero.data.text import VOCAB_SIZE, bits_per_byte, heldout_batches, load_stdlib_corpus, sample_batch
from hetero.kinds.gpt.config import GPTConfig
from hetero.train.lm import LMTrainer
from hetero.train.optim import OptimizerConfig

DEFAULT_MODEL = GPTConfig(vocab_size=VOCAB_SIZE, hidden_size=192, num_layers=4, num_heads=6, seq_len=128)


def heldout_bpb(trainer: LMTrainer, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    return bits_per_byte(sum(trainer.eval_loss(x, y) for x, y in batches) / len(batches))


def train(
    minutes: float, batch_size: int, lr: float, eval_every: int, seed: int, max_steps: int, eval_batches: int = 16
) -> list[tuple[int, float, float, float]]:
    """Train until the time budget (or max_steps) runs out; return (step, seconds, train bpb, held-out bpb
    over ``eval_batches`` held-out batches of 32 windows)."""
    corpus = load_stdlib_corpus()
    config = DEFAULT_MODEL
    trainer = LMTrainer(
        config,
        None,
        micro_batch_size=batch_size,
        optimizer=OptimizerConfig(lr=lr, warmup_steps=50, weight_decay=0.1, decay_steps=max_steps),
        seed=seed,
    )
    evaluation = heldout_batches(corpus.heldout, 32, config.seq_len, eval_batches)
    params = sum(p.numel() for p in trainer.model.parameters())
    print(f"model {asdict(config)}: {params / 1e6:.2f} M parameters; train {corpus.train.numel() / 1e6:.1f} MB, "
          f"held-out {corpus.heldout.numel() / 1e3:.0f} kB", flush=True)
    curve = []
    start = time.perf_counter()
    step = 0
    while step < max_steps and time.perf_counter() - start < minutes * 60:
        tokens, labels = sample_batch(corpus.train, batch_size, config.seq_len, step, seed)
        loss = trainer.train_step(tokens, labels)
        step += 1
        if step % eval_every == 0 or step == max_steps:
            point = (step, time.perf_counter() - start, bits_per_byte(loss), heldout_bpb(trainer, evaluation))
            curve.append(point)
            print(f"step {point[0]:5d}  {point[1]:6.0f} s  train {point[2]:.3f} bpb  held-out {point[3]:.3f} bpb",
                  flush=True)
    if not curve or curve[-1][0] != step:
        point = (step, time.perf_counter() - start, bits_per_byte(loss), heldout_bpb(trainer, evaluation))
        curve.append(point)
        print(f"step {point[0]:5d}  {point[1]:6.0f} s  train {point[2]:.3f} bpb  held-out {point[3]:.3f} bpb")
    return curve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="wall-clock budget for training")
    parser.add_argument("--max-steps", type=int, default=1000, help="also the length of the cosine decay")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-batches", type=int, default=16, help="held-out batches of 32 windows per evaluation")
    args = parser.parse_args(argv)
    curve = train(args.minutes, args.batch_size, args.lr, args.eval_every, args.seed, args.max_steps, args.eval_batches)
    print(f"final held-out {curve[-1][3]:.3f} bits per byte after {curve[-1][0]} steps, {curve[-1][1]:.0f} s")


if __name__ == "__main__":
    main()
