"""The vision encoder's model FLOPs (``hetero.kinds.flops``'s conventions)."""

from __future__ import annotations

from hetero.kinds.flops import projector_forward_flops_per_image
from hetero.models.vit.config import ViTConfig


def vit_forward_flops_per_image(config: ViTConfig) -> float:
    """Forward FLOPs per image of the vision encoder: patch embedding, the blocks up to the feature
    layer (patches and any class token), and the projector into the LLM's width where it holds one, over
    the tokens it hands on (the class token's too under ``class_feature``), or the merger of ``merge`` ×
    ``merge`` patches. A Qwen tower's images vary: counted at ``max_patches``, every block attending to them all
    (a bound: windows cost less) and each block's MLP at two matmuls (Qwen2.5-VL's SwiGLU has three)."""
    h, s, p = config.hidden_size, config.seq_len, config.num_patches
    patch_dim = config.channels * config.patch_size**2
    if config.qwen:  # an image of max_patches patches, attending to all of them (an upper bound under windows)
        s = p = config.max_patches
        patch_dim = config.patch_values
    per_block = s * (2 * 4 * h * h + 2 * 2 * h * config.ffn_size) + 2 * 2 * s * s * h
    projector = projector_forward_flops_per_image(h, config.out_size, config.feature_tokens) if config.projector else 0
    if config.merge > 1:  # the merger's two matmuls over the merged tokens
        width = h * config.merge**2
        projector = 2 * (p // config.merge**2) * (width * width + width * config.out_size)
    return 2 * p * patch_dim * h + config.used_layers * per_block + projector
