"""Multi-head latent attention (DeepSeek-V2 and V3): keys and values from one small latent per token.

Each token's ``kv_lora_rank``-wide latent (``wkv_a``'s first part, RMS-normed) is expanded per head into
the key's un-rotated channels and the value (``wkv_b``); the key's rotary channels (``wkv_a``'s last
``rotary_dim``) are one set shared by every head. Queries come straight from the hidden state (``wq``)
or through a latent of their own (``wq_a``, RMS-normed, ``wq_b``), each head's last ``rotary_dim`` channels
turned. A head's q and k are ``head_dim`` wide, its v ``v_head_dim``. With ``rope_interleaved`` the
rotary channels come as pairs (x0, y0, x1, y1, ...), regrouped to halves before RoPE turns them, as
transformers' DeepSeek-V3 does with ``rope_interleave``. The logits are scaled by ``softmax_scale``
beyond 1/sqrt(head_dim) (YaRN's mscale squared), applied to q. The two latent norms take eps 1e-6
whatever the model's ``norm_eps``, as DeepSeek's code (and transformers') builds them. Under TP each rank
holds some heads, so the rotary key they share gets part of its gradient on each: ``group`` (the plan sets
it) sums that gradient over the TP ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hetero.kernels.attention import CausalAttention, merge_heads, split_heads
from hetero.kernels.documents import Documents
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.rope import apply_rope
from hetero.parallel.gradient_sum import sum_gradient

LATENT_NORM_EPS = 1e-6


def halves(x: torch.Tensor) -> torch.Tensor:
    """Rotary channels given as pairs (x0, y0, x1, y1, ...) regrouped as halves (x0, x1, ..., y0, y1, ...)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class LatentAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        heads, hidden = config.num_heads, config.hidden_size
        self.head_dim, self.rotary, self.v_dim = config.head_size, config.rotary_size, config.v_size
        self.latent, self.interleaved, self.scale = config.kv_lora_rank, config.rope_interleaved, config.softmax_scale
        if config.q_lora_rank:
            self.wq_a = nn.Linear(hidden, config.q_lora_rank, bias=False)
            self.q_a_norm = nn.RMSNorm(config.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(config.q_lora_rank, heads * self.head_dim, bias=False)
        else:
            self.wq = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.wkv_a = nn.Linear(hidden, self.latent + self.rotary, bias=False)
        self.kv_a_norm = nn.RMSNorm(self.latent, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.latent, heads * (self.head_dim - self.rotary + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, hidden, bias=False)
        self.core = CausalAttention()
        self.group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        q = self.wq_b(self.q_a_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        q_plain, q_turned = split_heads(q, self.head_dim).split([self.head_dim - self.rotary, self.rotary], -1)
        latent, k_turned = self.wkv_a(x).split([self.latent, self.rotary], -1)
        kv = split_heads(self.wkv_b(self.kv_a_norm(latent)), self.head_dim - self.rotary + self.v_dim)
        k_plain, v = kv.split([self.head_dim - self.rotary, self.v_dim], -1)
        k_turned = k_turned[:, None]  # (batch, 1, seq, rotary): one for every head
        if self.group is not None:
            k_turned = sum_gradient(k_turned, self.group)
        if self.interleaved:
            q_turned, k_turned = halves(q_turned), halves(k_turned)
        q = torch.cat([q_plain, apply_rope(q_turned, cos, sin)], -1)
        k = torch.cat([k_plain, apply_rope(k_turned, cos, sin).expand(-1, k_plain.shape[1], -1, -1)], -1)
        if self.scale != 1.0:
            q = q * self.scale
        out = self.core(q, k, v) if documents is None else self.core(q, k, v, documents)
        return self.wo(merge_heads(out))
