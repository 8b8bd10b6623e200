"""hetero's Qwen-VL vision tower against transformers' on the same weights and images, side by side in one
process: the median forward + backward time over ``--repeats`` after a warm-up, alternating the two.

    hetero bench qwen-tower [--family qwen3-vl|qwen2.5-vl] [--repeats 5] [--json]

The tower is Qwen3-VL-2B's shape cut to ``--depth`` blocks (hidden 1024, 16 heads, patch 16); the images a
mixed batch of native-resolution grids (``GRIDS``, in patches). The cost model's FLOPs of the batch
(``qwen_tower_forward_flops``) give each side's achieved rate. Information, not a gate: fp32 on the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hetero.models.vit.config import ViTConfig
from hetero.models.vit.flops import qwen_tower_forward_flops
from hetero.models.vit.qwen_tower import QwenVisionTower
from hetero.models.vit.qwen_tower_hf import tower_state

GRIDS = [(1, 32, 48), (1, 24, 24), (1, 40, 28), (1, 16, 64)]  # 4,256 patches: landscape, square, portrait, wide


def towers(family: str, depth: int) -> tuple[torch.nn.Module, QwenVisionTower]:
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    sizes = dict(depth=depth, hidden_size=1024, num_heads=16, intermediate_size=4096, out_hidden_size=2048,
                 temporal_patch_size=2, in_channels=3, spatial_merge_size=2)
    ours = dict(hidden_size=1024, num_layers=depth, num_heads=16, ffn_hidden_size=4096, out_size=2048, channels=3,
                temporal_patch=2, merge=2, max_patches=4096, class_token=False, projector=False, feature_norm=False)
    if family == "qwen2.5-vl":
        vision = Qwen2_5_VLConfig(vision_config=dict(sizes, patch_size=14, window_size=112,
                                                     fullatt_block_indexes=[depth - 1])).vision_config
        theirs = Qwen2_5_VisionTransformerPretrainedModel(vision)
        config = ViTConfig(**ours, patch_size=14, tower=family, window_size=112, full_attention_blocks=[depth - 1])
    else:
        vision = Qwen3VLConfig(vision_config=dict(sizes, patch_size=16, num_position_embeddings=2304,
                                                  deepstack_visual_indexes=[0, depth // 2])).vision_config
        theirs = Qwen3VLVisionModel(vision)
        config = ViTConfig(**ours, patch_size=16, tower=family, position_grid=48, deepstack_layers=[0, depth // 2])
    tower = QwenVisionTower(config)
    tower.load_state_dict(tower_state(theirs.state_dict(), config), strict=True)
    return theirs, tower


def _step(forward) -> float:
    start = time.perf_counter()
    outputs = forward()
    sum(out.float().square().mean() for out in outputs).backward()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hetero bench qwen-tower")
    parser.add_argument("--family", choices=("qwen3-vl", "qwen2.5-vl"), default="qwen3-vl")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    theirs, ours = towers(args.family, args.depth)
    cpu = torch.device("cpu")
    patches = torch.randn(sum(t * h * w for t, h, w in GRIDS), ours.config.patch_values, device=cpu)
    grid_thw = torch.tensor(GRIDS, device=cpu)

    def transformers_forward():
        out = theirs(patches, grid_thw=grid_thw)
        return [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]

    def hetero_forward():
        merged, taps = ours(patches, GRIDS)
        return [merged, *taps]

    times = {"transformers": [], "hetero": []}
    for side, forward in (("transformers", transformers_forward), ("hetero", hetero_forward)):
        _step(forward)  # warm-up
    for _ in range(args.repeats):
        for side, forward in (("transformers", transformers_forward), ("hetero", hetero_forward)):
            times[side].append(_step(forward))
    flops = 3 * qwen_tower_forward_flops(ours.config, GRIDS)  # forward and backward
    report = {"family": args.family, "depth": args.depth, "patches": len(patches), "grids": GRIDS,
              "training_gflops": flops / 1e9}
    for side, seconds in times.items():
        median = statistics.median(seconds)
        report[side] = {"median_s": median, "gflops_per_s": flops / median / 1e9}
    report["hetero_over_transformers"] = report["hetero"]["median_s"] / report["transformers"]["median_s"]
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{args.family} tower, {args.depth} blocks, {len(patches)} patches in {len(GRIDS)} images "
              f"({report['training_gflops']:.1f} GFLOP a step), median of {args.repeats} forward + backward:")
        for side in times:
            print(f"  {side:>12}: {report[side]['median_s']:.3f} s ({report[side]['gflops_per_s']:.1f} GFLOP/s)")
        print(f"  hetero / transformers: {report['hetero_over_transformers']:.2f}")
