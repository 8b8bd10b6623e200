"""Decoder-only GPT (RoPE, RMSNorm, SwiGLU MLP)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hetero.kernels.attention import CausalAttention, merge_heads, split_heads
from hetero.kinds.gpt.config import GPTConfig




def rope_tables(head_dim: int, positions: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of rotary angles for the given absolute positions: each (len(positions), head_dim)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, heads, seq, head_dim) by the position tables (seq, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_heads
        self.wq = nn.Linear(config.hidden_size, config.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, config.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.hidden_size, config.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.core = CausalAttention()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = split_heads(self.wq(x), self.head_dim)
        k = split_heads(self.wk(x), self.head_dim)
        v = split_heads(self.wv(x), self.head_dim)
        out = self.core(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        return self.wo(merge_heads(out))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.ffn_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.ffn_size, bias=False)
        self.w2 = nn.Linear(config.ffn_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    """Decoder-only transformer. A pipeline stage keeps a subset of ``layers`` and sets the parts it does
    not own (embedding, final norm, output) to None; layer names stay global so checkpoints line up."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleDict({str(i): Block(config) for i in range(config.num_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.output: nn.Linear | None = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.reset_parameters()
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        return_hidden: bool = False,
        inserts: Sequence[tuple[int, torch.Tensor, torch.Tensor]] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Token ids (batch, seq) or embeddings (batch, seq, hidden) on the first stage, hidden states on
        later stages.

        ``positions`` are the absolute positions of the sequence this rank holds (needed when the
        sequence is split, e.g. by context parallelism); by default 0..seq-1. ``inserts``: other modules'
        embeddings, each ``(index, values, rows)``, replacing local positions ``index`` of rows ``rows``
        of the token embeddings (placeholders). ``return_hidden``: also return the final
        (normed) hidden states, e.g. for a module conditioned on them.
        """
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        cos, sin = rope_tables(self.config.hidden_size // self.config.num_heads, positions, self.config.rope_theta)
        cos, sin = cos.to(x.device), sin.to(x.device)
        # Float input is already embedded: hidden states from the previous stage, or the first stage's
        # embeddings with other modalities merged in.
        h = x if torch.is_floating_point(x) else self.tok_embeddings(x)  # type: ignore[misc]
        for index, values, rows in inserts:
            h = place_rows(h, index, values, rows)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        out = self.output(h) if self.output is not None else h
        return (out, h) if return_hidden else out


def place_rows(h: torch.Tensor, index: torch.Tensor, values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``h`` (batch, seq, hidden) with positions ``index`` of rows ``rows`` replaced by ``values``
    (len(rows), len(index), hidden); other rows unchanged. Differentiable in both."""
    out = h.clone()
    out[rows[:, None], index[None, :]] = values.to(h.dtype)
    return out


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over every position (the caller divides by the global count)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")
