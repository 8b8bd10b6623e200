"""KV-cache memory policies of the video generator side by side, at one frame budget.

    hetero bench video-memory [--budget 8] [--pretrain-steps 1500] [--router-steps 150] [--student-steps 50]

Clips revisit their first scene A after a gap of other scenes longer than the budget
(``hetero.data.video_clips``, written to webdataset shards). One generator is trained by flow matching
on the true frames, each clip under a memory drawn from every policy (the learned one with random
router scores, so the generator learns to use any frames a router may keep). The learned policy's
router is then trained on that frozen generator (L2M): soft memory, distillation from the same
generator with the full context as teacher, a sparsity penalty, corrupted context and rollouts.
Then Context Forcing, for every bounded policy alike (``--student-steps``; 0 skips it): a copy of the
generator is fine-tuned under that policy's memory (the learned one with its router) to match the
full-context teacher on long rollouts.

Reported per policy on held-out clips: the error of each frame denoised (fixed noise, Euler steps) from
the true frame noised to flow time ``--start``, given the true earlier frames the memory keeps, over the
revisited frames and over all frames (MSE and PSNR, pixels in [0, 1]); and the KV cache's bytes at the end of a clip of the training
length and of one ``--long``× longer. ``closed`` is the share of the revisit-error gap between the
sliding window and the full context that the policy closes; ``A kept`` the frames of scene A in memory
when the first revisited frame is made (mean over clips).
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import time
from pathlib import Path

import torch

from hetero.data.video_clips import ClipOptions, VideoClips, ensure_video_shards, make_clips, video_shards
from hetero.models.video.model import FrameCache, VideoGenerator, context_schedule, patchify
from hetero.models.video.config import VideoConfig
from hetero.models.video.memory import MemoryConfig
from hetero.models.video.objectives import (
    distillation_loss,
    flow_matching_loss,
    next_frame_errors,
    rollout,
    to_model,
)
from hetero.models.video.router import ImportanceRouter

ORDER = ("full", "sliding", "sink_window", "slow_fast", "learned")


def memories(budget: int, sink: int, window: int) -> dict[str, MemoryConfig]:
    return {
        "full": MemoryConfig(policy="full"),
        "sliding": MemoryConfig(policy="sliding", budget=budget),
        "sink_window": MemoryConfig(policy="sink_window", budget=budget, sink=sink),
        "slow_fast": MemoryConfig(policy="slow_fast", budget=budget, sink=sink, window=window),
        "learned": MemoryConfig(policy="learned", budget=budget, window=window),
    }


def pretrain(model: VideoGenerator, clips: VideoClips, policies: dict[str, MemoryConfig], steps: int, lr: float) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=steps, pct_start=0.1)
    cycle = list(policies.values())
    losses = []
    for step in range(steps):
        frames = to_model(clips.batch(step)["frames"])
        chosen = [cycle[(step * len(frames) + b) % len(cycle)] for b in range(len(frames))]
        loss = flow_matching_loss(model, frames, chosen, torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    return losses


def rollouts(model, frames, memory, router, rng: random.Random, generator: torch.Generator) -> torch.Tensor:
    """Each clip with its frames from a random prompt length on generated under ``memory`` (some clips
    stay true: prompt = the clip's length)."""
    count = frames.shape[1]
    return torch.stack([
        rollout(model, clip, memory, rng.randint(count // 2, count), router, generator) for clip in frames
    ])


def distill(
    student: VideoGenerator,
    teacher: VideoGenerator,
    clips: VideoClips,
    memory: MemoryConfig,
    router: ImportanceRouter | None,
    steps: int,
    lr: float,
    sparsity_weight: float,
    corruption: tuple[float, float],
    seed: int,
) -> list[float]:
    """Context Forcing / L2M: the student (and router) learn the full-context teacher's velocities on
    rollouts, seeing only the student's memory."""
    params = [p for p in student.parameters() if p.requires_grad]
    if router is not None:
        params += list(router.parameters())
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    rng, losses = random.Random(seed), []
    for step in range(steps):
        generator = torch.Generator().manual_seed(seed * 100003 + step)
        frames = rollouts(student, to_model(clips.batch(step)["frames"]), memory, router, rng, generator)
        loss, penalty = distillation_loss(student, teacher, frames, memory, router, generator, corruption)
        optimizer.zero_grad()
        (loss + sparsity_weight * penalty).backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def scene_a_kept(model, frames, scene, revisit, memory, router) -> float:
    """Frames of scene A the memory holds when the first revisited frame is made, mean over clips."""
    summaries = model.frame_summary(patchify(frames, model.config.patch_size))
    first = int(revisit[0].nonzero()[0])
    counts = []
    for b in range(frames.shape[0]):
        scores = router.clip_scores(summaries[b]) if router is not None else None
        kept = context_schedule(summaries[b], memory, scores)[first]
        counts.append(sum(int(scene[b, j]) == 0 for j in kept))
    return sum(counts) / len(counts)


def evaluate(model, frames, revisit, memory, router, start: float) -> dict[str, float]:
    errors = next_frame_errors(model, frames, memory, router, torch.Generator().manual_seed(12345), start)
    errors = errors / 4  # back to pixels in [0, 1]
    revisit = revisit[:, 1:]
    mse_all, mse_revisit = errors.mean().item(), errors[revisit].mean().item()
    return {
        "revisit_mse": mse_revisit,
        "all_mse": mse_all,
        "revisit_psnr": 10 * math.log10(1 / mse_revisit),
        "all_psnr": 10 * math.log10(1 / mse_all),
    }


@torch.no_grad()
def kv_bytes(model, clip: torch.Tensor, memory: MemoryConfig, router, at: int) -> tuple[int, int]:
    """KV-cache bytes after the first ``at`` frames of a clip, and the most at any point of the clip,
    as its true frames are appended one by one."""
    cache = FrameCache(model, memory, router)
    largest = early = 0
    for t, frame in enumerate(patchify(clip, model.config.patch_size)):
        cache.append(frame[None])
        largest = max(largest, cache.kv_bytes())
        if t + 1 == at:
            early = cache.kv_bytes()
    return early, largest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hetero bench video-memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=8, help="KV budget in frames (below the gap)")
    parser.add_argument("--sink", type=int, default=1)
    parser.add_argument("--window", type=int, default=2, help="fast window of slow_fast and learned")
    parser.add_argument("--frames", type=int, default=32)
    parser.add_argument("--a-len", type=int, default=8)
    parser.add_argument("--gap", type=int, default=16)
    parser.add_argument("--revisit-motion", choices=("continue", "restart"), default="continue",
                        help="the returning A replays its first frames (restart) or continues its motion")
    parser.add_argument("--train-clips", type=int, default=512)
    parser.add_argument("--heldout-clips", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--pretrain-steps", type=int, default=1500)
    parser.add_argument("--router-steps", type=int, default=150)
    parser.add_argument("--student-steps", type=int, default=50, help="Context Forcing fine-tuning per policy")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--router-lr", type=float, default=3e-3)
    parser.add_argument("--student-lr", type=float, default=1e-4, help="Context Forcing fine-tuning")
    parser.add_argument("--sparsity", type=float, default=0.002)
    parser.add_argument("--corrupt", type=float, nargs=2, default=(0.3, 0.05), metavar=("PROB", "STD"))
    parser.add_argument("--start", type=float, default=0.5,
                        help="evaluated frames are denoised from the true frame noised to this flow time")
    parser.add_argument("--long", type=int, default=10, help="the long clip is this many times --frames")
    parser.add_argument("--patch", type=int, default=8, help="patch size (frames are 16×16)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default="data/video_clips",
                        help="clip sets, one per shape, counts and seed under it (as train.clip_dir)")
    parser.add_argument("--generator", help="load the pretrained generator from this file if it exists, "
                        "else save it there (to rerun the memory stages alone)")
    args = parser.parse_args(argv)
    if args.budget >= args.gap:
        parser.error(f"--budget={args.budget} must be below --gap={args.gap}: otherwise sliding keeps scene A")

    torch.manual_seed(args.seed)
    options = ClipOptions(frames=args.frames, gap=args.gap, a_len=args.a_len, revisit_motion=args.revisit_motion)
    shard_dir = video_shards(args.data, args.train_clips, args.heldout_clips, options, args.seed)
    ensure_video_shards(shard_dir, args.train_clips, args.heldout_clips, options, seed=args.seed)
    train = VideoClips(shard_dir, "train", args.batch, seed=args.seed)
    heldout = VideoClips(shard_dir, "heldout", args.heldout_clips, seed=args.seed).batch(0)
    policies = memories(args.budget, args.sink, args.window)
    config = VideoConfig(patch_size=args.patch, hidden_size=args.hidden, num_layers=args.layers, max_distance=args.frames)

    start = time.time()
    model = VideoGenerator(config)
    if args.generator and Path(args.generator).exists():
        model.load_state_dict(torch.load(args.generator))
        print(f"pretrain: generator loaded from {args.generator}", flush=True)
    else:
        losses = pretrain(model, train, policies, args.pretrain_steps, args.lr)
        print(f"pretrain: {args.pretrain_steps} steps, loss {sum(losses[:20]) / 20:.4f} -> "
              f"{sum(losses[-20:]) / 20:.4f} ({time.time() - start:.0f} s)", flush=True)
        if args.generator:
            torch.save(model.state_dict(), args.generator)
    model.requires_grad_(False)

    start = time.time()
    router = ImportanceRouter(config.hidden_size)
    losses = distill(model, model, train, policies["learned"], router, args.router_steps, args.router_lr,
                     args.sparsity, tuple(args.corrupt), args.seed + 1)
    print(f"router: {args.router_steps} steps, distillation loss {sum(losses[:20]) / 20:.4f} -> "
          f"{sum(losses[-20:]) / 20:.4f} ({time.time() - start:.0f} s)", flush=True)

    students = {name: model for name in ORDER}
    if args.student_steps:
        for name in ORDER[1:]:
            start = time.time()
            student = copy.deepcopy(model).requires_grad_(True)
            losses = distill(student, model, train, policies[name], router if name == "learned" else None,
                             args.student_steps, args.student_lr, args.sparsity, tuple(args.corrupt), args.seed + 2)
            students[name] = student.requires_grad_(False)
            print(f"context forcing {name}: {args.student_steps} steps, loss {sum(losses[:10]) / 10:.4f} -> "
                  f"{sum(losses[-10:]) / 10:.4f} ({time.time() - start:.0f} s)", flush=True)

    long_clip = torch.from_numpy(make_clips(1, frames=args.frames * args.long, gap=args.gap, a_len=args.a_len,
                                            seed=args.seed, split="heldout",
                                            revisit_motion=args.revisit_motion)[0]["frames"])
    long_clip = to_model(long_clip)
    rows = {}
    for name in ORDER:
        chosen = router if name == "learned" else None
        frames = to_model(heldout["frames"])
        rows[name] = evaluate(students[name], frames, heldout["revisit"], policies[name], chosen, args.start)
        rows[name]["a_kept"] = scene_a_kept(students[name], frames, heldout["scene"], heldout["revisit"],
                                            policies[name], chosen)
        rows[name]["kv"], rows[name]["kv_long"] = kv_bytes(students[name], long_clip, policies[name], chosen,
                                                           args.frames)
    print_table(rows, args)
    return 0


def print_table(rows: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    gap = rows["sliding"]["revisit_mse"] - rows["full"]["revisit_mse"]
    print(f"\nbudget {args.budget} frames; A {args.a_len} frames, gap {args.gap}, clips of {args.frames}; "
          f"{args.heldout_clips} held-out clips")
    print(f"{'policy':<12} {'revisit MSE':>12} {'PSNR':>6} {'all MSE':>9} {'PSNR':>6} {'closed':>7} "
          f"{'A kept':>7} {'KV@' + str(args.frames):>9} {'max KV@' + str(args.frames * args.long):>11}")
    for name in ORDER:
        r = rows[name]
        closed = (rows["sliding"]["revisit_mse"] - r["revisit_mse"]) / gap if gap > 0 else float("nan")
        print(f"{name:<12} {r['revisit_mse']:>12.5f} {r['revisit_psnr']:>6.2f} {r['all_mse']:>9.5f} "
              f"{r['all_psnr']:>6.2f} {closed:>7.1%} {r['a_kept']:>7.2f} {r['kv'] / 1024:>8.0f}K "
              f"{r['kv_long'] / 1024:>10.0f}K")
    revisit = {name: rows[name]["revisit_mse"] for name in ORDER}
    checks = {
        "learned <= slow_fast": revisit["learned"] <= revisit["slow_fast"],
        "slow_fast <= sink_window": revisit["slow_fast"] <= revisit["sink_window"],
        "sink_window < sliding": revisit["sink_window"] < revisit["sliding"],
        "learned closes >= 50% of sliding -> full": gap > 0 and (revisit["sliding"] - revisit["learned"]) / gap >= 0.5,
        "bounded KV flat over the long clip": all(rows[n]["kv_long"] <= rows[n]["kv"] for n in ORDER[1:]),
    }
    for check, held in checks.items():
        print(f"  {'holds' if held else 'FAILS'}: {check}")


if __name__ == "__main__":
    raise SystemExit(main())
