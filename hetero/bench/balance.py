"""Vision-encoder load across DP replicas: images split by patch count (hetero's) against by image count.

    python -m hetero.bench.balance [--steps 100] [--dp 4] [--samples 16] [--timed 20]

Each step's batch holds ``samples`` samples of 1-4 photographs each (scikit-image's, random crops of
many sizes and aspect ratios, at native resolution up to ``--max-patches`` patches of 16×16 pixels), so
an image holds 1 to ``max_patches`` patches. Both splits of every step's images over ``dp`` replicas:
``patches`` (``hetero.runtime.rows.balanced_split``: the largest first, onto the least loaded) and
``count`` (contiguous runs of equal image counts, as rows split). Per step the max/mean patches per
replica; on ``--timed`` of the steps, each replica's encoder forward and backward (packed, one replica
after another in this process, alternating the two splits), and the slowest replica's time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hetero.parallel.sharding import dp_rows
from hetero.data.native_images import fit_to_patches, load_photos, patchify, photo_crops
from hetero.models.vit.config import ViTConfig
from hetero.models.vit.model import VisionEncoder
from hetero.runtime.rows import balanced_split

PATCH = 16


def step_images(photos, samples: int, max_patches: int, generator: torch.Generator):
    """One step's images: (patches (n, 3·16·16), grid) each."""
    images = []
    for _ in range(samples):
        for crop in photo_crops(photos, int(torch.randint(1, 5, (), generator=generator)), generator):
            fitted = fit_to_patches(crop, PATCH, max_patches)
            images.append((patchify(fitted, PATCH), (fitted.shape[1] // PATCH, fitted.shape[2] // PATCH)))
    return images


def splits(costs: torch.Tensor, dp: int) -> dict[str, list[torch.Tensor]]:
    everything = torch.arange(len(costs))
    return {"patches": balanced_split(costs, dp), "count": [everything[dp_rows(len(costs), d, dp)] for d in range(dp)]}


def replica_time(model: VisionEncoder, images, chosen: torch.Tensor) -> float:
    if len(chosen) == 0:
        return 0.0
    patches = torch.cat([images[i][0] for i in chosen.tolist()])
    grids = [images[i][1] for i in chosen.tolist()]
    started = time.perf_counter()
    model.forward_packed(patches, grids).square().mean().backward()
    return time.perf_counter() - started


def measure(steps: int, dp: int, samples: int, timed: int, max_patches: int, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    photos = load_photos(3)
    torch.manual_seed(seed)
    model = VisionEncoder(ViTConfig(image_size=PATCH * 16, patch_size=PATCH, channels=3, hidden_size=64, num_layers=2,
                                    num_heads=4, out_size=64, class_token=False, max_patches=max_patches))
    ratios = {"patches": [], "count": []}
    slowest = {"patches": [], "count": []}
    images_per_step, patches_per_image = [], []
    for step in range(steps):
        images = step_images(photos, samples, max_patches, generator)
        costs = torch.tensor([len(p) for p, _ in images])
        images_per_step.append(len(images))
        patches_per_image += costs.tolist()
        for name, parts in splits(costs, dp).items():
            loads = [float(costs[p].sum()) for p in parts]
            ratios[name].append(max(loads) / statistics.mean(loads))
        if step < timed:
            order = ("patches", "count") if step % 2 == 0 else ("count", "patches")
            for name in order:
                parts = splits(costs, dp)[name]
                slowest[name].append(max(replica_time(model, images, p) for p in parts))
                model.zero_grad()
    return {"ratios": ratios, "slowest": slowest, "images_per_step": images_per_step,
            "patches_per_image": patches_per_image}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--timed", type=int, default=20)
    parser.add_argument("--max-patches", type=int, default=256)
    args = parser.parse_args(argv)
    result = measure(args.steps, args.dp, args.samples, args.timed, args.max_patches)
    sizes = result["patches_per_image"]
    print(f"{args.steps} steps of {args.samples} samples: {statistics.mean(result['images_per_step']):.1f} images a "
          f"step, {min(sizes)}-{max(sizes)} patches an image (mean {statistics.mean(sizes):.1f}), over dp{args.dp}")
    print("split by   | max/mean patches per replica: mean   worst | slowest replica's encoder step (ms)")
    for name in ("patches", "count"):
        ratios, slowest = result["ratios"][name], result["slowest"][name]
        print(f"{name:10s} | {statistics.mean(ratios):37.3f} {max(ratios):7.3f} | "
              f"{1000 * statistics.mean(slowest):.1f} (mean of {len(slowest)} steps)")
    speedup = statistics.mean(result["slowest"]["count"]) / statistics.mean(result["slowest"]["patches"])
    print(f"slowest replica, count split / patch split: {speedup:.2f}x")


if __name__ == "__main__":
    main()
