"""Model FLOPs of a training step, the figure MFU divides: Megatron's per-layer count.

Every matmul costs 2·m·n·k; attention adds the score and value products over the whole s×s matrix
(causal masking is not discounted, as in Megatron and PaLM); a mixture of experts counts the experts a
token goes through (active parameters) and its router; backward costs twice the forward, so a
training step is 3× the forward. Recomputed activations are not counted again (model FLOPs, not
hardware FLOPs). Modules without a closed form (GeneZip's dynamic chunking, the video generator) are
counted by running one forward under ``torch.utils.flop_counter`` with attention included.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from hetero.models.gpt.config import GPTConfig
from hetero.models.vit.config import ViTConfig

TRAINING_MULTIPLIER = 3  # forward + backward (input and weight gradients)


def gpt_forward_flops_per_token(config: GPTConfig, seq_len: int | None = None) -> float:
    """Forward FLOPs per token of the GPT at sequence length ``seq_len`` (default: the config's)."""
    h, s = config.hidden_size, seq_len or config.seq_len
    head_dim = config.head_size
    q_width, kv_width = config.num_heads * head_dim, config.kv_heads * head_dim
    projections = 2 * h * (q_width + 2 * kv_width) + 2 * q_width * h
    attention = 2 * 2 * s * q_width  # QK^T and attention·V, per query position
    mlp = 2 * 3 * h * active_ffn_size(config)  # SwiGLU: gate, up and down projections
    if config.moe:
        mlp += 2 * h * config.num_experts  # the router
    logits = 2 * h * config.vocab_size
    return config.num_layers * (projections + attention + mlp) + logits


def active_ffn_size(config: GPTConfig) -> int:
    """The SwiGLU units a token goes through in a layer: the MLP's, or its top_k and shared experts'."""
    return config.expert_size * (config.top_k + config.shared_experts) if config.moe else config.ffn_size


def vit_forward_flops_per_image(config: ViTConfig) -> float:
    """Forward FLOPs per image of the vision encoder: patch embedding, the blocks up to the feature
    layer (patches and any class token), and the projector into the LLM's width where it holds one (or
    the merger of ``merge`` × ``merge`` patches)."""
    h, s, p = config.hidden_size, config.seq_len, config.num_patches
    patch_dim = config.channels * config.patch_size**2
    per_block = s * (2 * 4 * h * h + 2 * 2 * h * config.ffn_size) + 2 * 2 * s * s * h
    projector = projector_forward_flops_per_image(h, config.out_size, p) if config.projector else 0
    if config.merge > 1:  # the merger's two matmuls over the merged tokens
        width = h * config.merge**2
        projector = 2 * (p // config.merge**2) * (width * width + width * config.out_size)
    return 2 * p * patch_dim * h + config.used_layers * per_block + projector


def projector_forward_flops_per_image(in_size: int, out_size: int, tokens: int) -> float:
    """Forward FLOPs of an MLP projector (two matmuls) over one image's ``tokens``."""
    return 2 * tokens * (in_size * out_size + out_size * out_size)


def counted_forward_flops(model: torch.nn.Module, *inputs: torch.Tensor) -> float:
    """FLOPs of one forward of ``model`` as torch's flop counter sees them, CPU attention kernels included."""
    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops}
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        model(*inputs)
    return float(counter.get_total_flops())


def _attention_flops(query: torch.Size, key: torch.Size, value: torch.Size, *args, out_shape=None, **kwargs) -> int:
    """Scores and weighted values of (batch, heads, seq, head_dim) attention, from the operands' shapes
    (torch's counter knows only the GPU attention kernels)."""
    batch, heads, queries, head_dim = query
    return 2 * batch * heads * queries * key[-2] * (head_dim + value[-1])
