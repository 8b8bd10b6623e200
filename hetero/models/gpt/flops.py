"""The GPT's model FLOPs (``hetero.kinds.flops``'s conventions): Megatron's per-layer count."""

from __future__ import annotations

from hetero.models.gpt.config import GPTConfig


def gpt_forward_flops_per_token(config: GPTConfig, seq_len: int | None = None) -> float:
    """Forward FLOPs per token of the GPT at sequence length ``seq_len`` (default: the config's)."""
    h, s = config.hidden_size, seq_len or config.seq_len
    projections, attention = _attention_flops(config, s)
    mlp = 2 * 3 * h * active_ffn_size(config)  # SwiGLU: gate, up and down projections
    if config.moe:
        mlp += 2 * h * config.num_experts  # the router
    dense = len(set(config.dense_layers)) * (2 * 3 * h * config.ffn_size - mlp)  # those layers' MLP instead
    logits = 2 * h * config.vocab_size
    return config.num_layers * (projections + attention + mlp) + dense + logits


def _attention_flops(config: GPTConfig, s: int) -> tuple[int, int]:
    """A layer's attention per token: its projections, and QK^T with attention·V per query position."""
    h, heads, head_dim = config.hidden_size, config.num_heads, config.head_size
    if not config.kv_lora_rank:
        q_width, kv_width = heads * head_dim, config.kv_heads * head_dim
        return 2 * h * (q_width + 2 * kv_width) + 2 * q_width * h, 2 * 2 * s * q_width
    # multi-head latent attention: q (through its latent), the kv latent and shared rotary key, their
    # expansion per head, the output
    q = 2 * config.q_lora_rank * (h + heads * head_dim) if config.q_lora_rank else 2 * h * heads * head_dim
    kv = 2 * h * (config.kv_lora_rank + config.rotary_size)
    kv += 2 * config.kv_lora_rank * heads * (head_dim - config.rotary_size + config.v_size)
    return q + kv + 2 * heads * config.v_size * h, 2 * s * heads * (head_dim + config.v_size)


def active_ffn_size(config: GPTConfig) -> int:
    """The SwiGLU units a token goes through in a layer: the MLP's, or its top_k and shared experts'."""
    return config.expert_size * (config.top_k + config.shared_experts) if config.moe else config.ffn_size
