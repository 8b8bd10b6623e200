"""GeneZip's de-chunking EMA on the worst routing, a token at every base: the parallel scan the model runs
(``smooth_chunks``) against the sequential loop over chunks it replaced, forward and backward, side by side.

    hetero bench dechunk [--lengths 512 4096] [--batch 16] [--hidden 64] [--repeats 3]

The loop's backward grows with the square of the chunks (each chunk's slice hands autograd a gradient
as large as the whole sequence), so the 4096-base row takes a few minutes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from hetero.models.genezip.model import smooth_chunks

Smoother = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def smooth_chunks_loop(states: torch.Tensor, rate: torch.Tensor) -> torch.Tensor:
    """The EMA one chunk after another: the reference the scan must match."""
    rate = rate.unsqueeze(-1).to(states.dtype)
    smoothed, previous = [], torch.zeros_like(states[:, 0])
    for j in range(states.shape[1]):
        previous = rate[:, j] * states[:, j] + (1 - rate[:, j]) * previous
        smoothed.append(previous)
    return torch.stack(smoothed, dim=1)


def worst_case(batch: int, length: int, hidden: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk states and rates of a sequence routed to a chunk at every base (the first rate is 1)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    states = torch.randn(batch, length, hidden, generator=generator, device="cpu")
    rate = torch.rand(batch, length, generator=generator, device="cpu")
    rate[:, 0] = 1.0
    return states.requires_grad_(), rate.requires_grad_()


def timed(smoother: Smoother, states: torch.Tensor, rate: torch.Tensor, repeats: int) -> tuple[float, float]:
    """Median forward and backward milliseconds."""
    forward, backward = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        out = smoother(states, rate)
        forward.append(time.perf_counter() - started)
        started = time.perf_counter()
        torch.autograd.grad(out, (states, rate), torch.ones_like(out))
        backward.append(time.perf_counter() - started)
    return statistics.median(forward) * 1e3, statistics.median(backward) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hetero bench dechunk", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 4096], help="bases (= chunks) per window")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print("chunks | loop fwd ms | loop bwd ms | scan fwd ms | scan bwd ms | loop/scan (fwd+bwd) | max |scan - loop|")
    for length in args.lengths:
        states, rate = worst_case(args.batch, length, args.hidden)
        loop_fwd, loop_bwd = timed(smooth_chunks_loop, states, rate, args.repeats)
        scan_fwd, scan_bwd = timed(smooth_chunks, states, rate, args.repeats)
        with torch.no_grad():
            gap = float((smooth_chunks(states, rate) - smooth_chunks_loop(states, rate)).abs().max())
        print(f"{length:6d} | {loop_fwd:11.1f} | {loop_bwd:11.1f} | {scan_fwd:11.1f} | {scan_bwd:11.1f} | "
              f"{(loop_fwd + loop_bwd) / (scan_fwd + scan_bwd):19.1f} | {gap:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
