"""The vision encoder's model FLOPs (``hetero.kinds.flops``'s conventions)."""

from __future__ import annotations

import math

from hetero.kinds.flops import projector_forward_flops_per_image
from hetero.models.vit.config import ViTConfig


def qwen_window_lengths(config: ViTConfig, t: int, h: int, w: int) -> list[int]:
    """Qwen2.5-VL's attention windows over one image of ``t × h × w`` patches, in patches: squares of
    ``window_size`` pixels in merge blocks, the last of a row or column taking what is left."""
    m, side = config.merge, config.window_size // (config.merge * config.patch_size)
    spans = lambda blocks: [min(side, blocks - start) for start in range(0, blocks, side)]  # noqa: E731
    return [a * b * m * m for _ in range(t) for a in spans(h // m) for b in spans(w // m)]


def qwen_tower_forward_flops(config: ViTConfig, grids: list[tuple[int, int, int]]) -> float:
    """Forward matmul FLOPs of a Qwen tower (``qwen_tower.py``) over images of ``grids`` (t, h, w) patches:
    the patch embedding, per block the qkv and output projections, attention within each window (Qwen2.5-VL's
    windowed blocks) or temporal patch (the others), the MLP's two matmuls (three for SwiGLU), then the merger
    and each DeepStack merger over the merged tokens."""
    h, ffn, merge = config.hidden_size, config.ffn_size, config.merge
    patches = sum(t * gh * gw for t, gh, gw in grids)
    frames = [gh * gw for t, gh, gw in grids for _ in range(t)]
    windows = [n for grid in grids for n in qwen_window_lengths(config, *grid)] if config.tower == "qwen2.5-vl" else frames
    mlp_matmuls = 2 if config.tower == "qwen3-vl" else 3
    linear = patches * (2 * 4 * h * h + mlp_matmuls * 2 * h * ffn)
    blocks = 0.0
    for index in range(config.num_layers):
        groups = frames if config.tower == "qwen3-vl" or index in config.full_attention_blocks else windows
        blocks += linear + sum(2 * 2 * n * n * h for n in groups)
    width, merged = h * merge**2, patches // merge**2
    mergers = (1 + len(config.deepstack_layers)) * 2 * merged * (width * width + width * config.out_size)
    return 2 * patches * config.patch_values * h + blocks + mergers


def vit_forward_flops_per_image(config: ViTConfig) -> float:
    """Forward FLOPs per image of the vision encoder: patch embedding, the blocks up to the feature
    layer (patches and any class token), and the projector into the LLM's width where it holds one, over
    the tokens it hands on (the class token's too under ``class_feature``), or the merger of ``merge`` ×
    ``merge`` patches. A Qwen tower's images vary: counted for its largest, a square of ``max_patches``
    patches in whole merge blocks (``qwen_tower_forward_flops``)."""
    if config.qwen:
        side = config.merge * math.isqrt(config.max_patches // config.merge**2)
        return qwen_tower_forward_flops(config, [(1, side, side)])
    h, s, p = config.hidden_size, config.seq_len, config.num_patches
    patch_dim = config.channels * config.patch_size**2
    per_block = s * (2 * 4 * h * h + 2 * 2 * h * config.ffn_size) + 2 * 2 * s * s * h
    projector = projector_forward_flops_per_image(h, config.out_size, config.feature_tokens) if config.projector else 0
    if config.merge > 1:  # the merger's two matmuls over the merged tokens
        width = h * config.merge**2
        projector = 2 * (p // config.merge**2) * (width * width + width * config.out_size)
    return 2 * p * patch_dim * h + config.used_layers * per_block + projector
