"""Attention kernels shared by the models and by context-parallel attention (plain, single-process)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hetero.kernels.documents import Documents


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(batch, seq, heads · head_dim) -> (batch, heads, seq, head_dim). The head count comes from the width,
    so it holds on a TP rank (its share of the heads) and for an empty batch alike."""
    return x.view(*x.shape[:-1], x.shape[-1] // head_dim, head_dim).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(batch, heads, seq, head_dim) -> (batch, seq, heads · head_dim)."""
    return x.transpose(1, 2).flatten(2)


def expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention: repeat each K/V head to serve its group of q heads (dim 1 is heads). v's
    heads may be another width than k's (multi-head latent attention)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if k.shape[:-1] != v.shape[:-1] or heads % kv_heads != 0:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must match but for their width, with heads dividing q's {heads}"
        )
    if kv_heads == heads:
        return k, v
    return k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     documents: Documents | None = None) -> torch.Tensor:
    """Causal attention on (batch, heads, seq, head_dim); k/v may have fewer heads (GQA). With
    ``documents`` (packed rows, the whole row held here) a token sees only its own document."""
    k, v = expand_kv(q, k, v)
    whole = slice(0, q.shape[2])
    mask = documents.block(whole, whole, True, q.dtype) if documents is not None else None
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.additive)


class CausalAttention(torch.nn.Module):
    """The attention kernel as a module, so a parallel plan can swap it (e.g. for context parallelism)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        return causal_attention(q, k, v, documents)


class LocalCausalAttention(torch.nn.Module):
    """Causal attention in which each position sees only the last ``window`` positions (itself included)."""

    def __init__(self, window: int):
        super().__init__()
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = expand_kv(q, k, v)
        positions = torch.arange(q.shape[2], device=q.device)
        behind = positions[:, None] - positions[None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(behind >= 0) & (behind < self.window))
