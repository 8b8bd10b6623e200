"""Attention over one block of keys, returning the log-sum-exp, and its exact backward (single process).

Context-parallel attention splits a causal attention into blocks of (query chunk, key chunk), each either
full (no mask) or causal on the diagonal (query i sees keys <= i within the block; query and key chunks
have equal length there). ``block_forward`` returns a block's output and the log-sum-exp of its scores
per query; ``merge_blocks`` combines blocks of one query chunk into the attention over all their keys;
``block_backward`` takes the *merged* output and log-sum-exp, so the blocks' gradients sum to the exact
gradient of the whole attention (softmax probabilities are rebuilt from the merged log-sum-exp).

Packed rows (``hetero.kernels.documents``) add a mask per block: an additive (0 / -inf) mask with the
causal rule folded in, and which queries see any key of the block; a query that sees none gets a
log-sum-exp of -inf (no share in the merge) and an output of 0.

Grouped-query attention (fewer K/V heads than query heads) runs without copying K/V: the CPU kernel
takes it natively, and the math path broadcasts each K/V head over its group of query heads.

Kernels: on CPU torch's fused flash-attention kernel (``_scaled_dot_product_flash_attention_for_cpu``
and its backward). Elsewhere an exact math path in plain torch ops (scores of one block at a time; a
causal block's mask is chunk × chunk); the fused CUDA kernels are the GPU path's to add. Both compute in
the input dtype and keep the log-sum-exp in fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

import math

import torch

from hetero.kernels.documents import BlockMask

KERNELS = ("auto", "flash", "math")


def _use_flash(q: torch.Tensor, kernel: str) -> bool:
    return kernel == "flash" or (kernel == "auto" and q.device.type == "cpu")


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, kernel: str = "auto",
    mask: BlockMask | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output (batch, heads, q_len, head_dim), log-sum-exp (batch, heads, q_len), fp32 or wider) of one block."""
    if _use_flash(q, kernel):
        if mask is None:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False,
                                                                            attn_mask=mask.additive)
        return out, lse.masked_fill(~mask.has_keys, float("-inf"))
    scores = _scores(q, k, causal, mask).to(_wide(q.dtype))
    lse = scores.logsumexp(-1)
    probs = (scores - _finite(lse)[..., None]).exp().to(q.dtype)
    return _ungroup(probs @ v.unsqueeze(2)), _ungroup(lse)


def block_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    causal: bool, kernel: str = "auto", mask: BlockMask | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v for one block, given the merged ``out`` and ``lse`` of q's whole attention."""
    if _use_flash(q, kernel):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), 0.0, causal and mask is None,
            attn_mask=None if mask is None else mask.additive,
        )
    groups, scale = q.shape[1] // k.shape[1], 1.0 / math.sqrt(q.shape[-1])
    wide = _wide(q.dtype)
    probs = (_scores(q, k, causal, mask).to(wide) - _group(lse, groups)[..., None]).exp().to(q.dtype)
    grad_g, out_g = _group(grad, groups), _group(out, groups)
    grad_v = (probs.transpose(-1, -2) @ grad_g).sum(2)
    grad_probs = grad_g @ v.unsqueeze(2).transpose(-1, -2)
    delta = (grad_g.to(wide) * out_g.to(wide)).sum(-1, keepdim=True)
    grad_scores = (probs.to(wide) * (grad_probs.to(wide) - delta)).to(q.dtype) * scale
    grad_q = _ungroup(grad_scores @ k.unsqueeze(2))
    grad_k = (grad_scores.transpose(-1, -2) @ _group(q, groups)).sum(2)
    return grad_q, grad_k, grad_v


def merge_blocks(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention of one query chunk over the union of its blocks' keys: outputs weighted by each
    block's share of the softmax mass, ``exp(lse_block - lse)``."""
    if len(parts) == 1:
        return parts[0]
    lse = torch.stack([p[1] for p in parts]).logsumexp(0)
    out = sum(p[0].to(lse.dtype) * (p[1] - _finite(lse)).exp()[..., None] for p in parts)
    return out.to(parts[0][0].dtype), lse


def _group(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(batch, heads, ...) -> (batch, kv_heads, groups, ...): each K/V head's query heads side by side."""
    return x.view(x.shape[0], x.shape[1] // groups, groups, *x.shape[2:])


def _ungroup(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(1, 2)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a query that sees no key) as 0, so that exp(scores - lse) is 0 there, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, mask: BlockMask | None = None) -> torch.Tensor:
    """(batch, kv_heads, groups, q_len, k_len) scaled scores; -inf above the diagonal of a causal block, or
    where the block's document mask says so."""
    groups = q.shape[1] // k.shape[1]
    scores = _group(q, groups) @ k.unsqueeze(2).transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        return scores + mask.additive[:, :, None].to(scores.dtype)
    if causal:
        above = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    return scores
