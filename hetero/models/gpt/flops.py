"""The GPT's model FLOPs (``hetero.kinds.flops``'s conventions): Megatron's per-layer count."""

from __future__ import annotations

from hetero.models.gpt.config import GPTConfig


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
    dense = len(set(config.dense_layers)) * (2 * 3 * h * config.ffn_size - mlp)  # those layers' MLP instead
    logits = 2 * h * config.vocab_size
    return config.num_layers * (projections + attention + mlp) + dense + logits


def active_ffn_size(config: GPTConfig) -> int:
    """The SwiGLU units a token goes through in a layer: the MLP's, or its top_k and shared experts'."""
    return config.expert_size * (config.top_k + config.shared_experts) if config.moe else config.ffn_size
