"""Decoder-only GPT (RoPE, RMSNorm, SwiGLU MLP or a mixture of SwiGLU experts)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from hetero.kernels.attention import CausalAttention, merge_heads, split_heads
from hetero.kernels.documents import Documents
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.mla import LatentAttention
from hetero.models.gpt.moe import Experts, MoEFeedForward, PooledBalance, SwiGLU
from hetero.models.gpt.rope import apply_rope, mrope_of, rope_tables


class HeadsRMSNorm(nn.Module):
    """RMSNorm over every head's channels together (OLMoE's q and k norms), before the heads are split.
    Under TP a rank holds its heads' channels and their part of ``weight``: ``group`` (the plan sets it)
    sums the squares over the TP ranks."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.width, self.eps = width, eps
        self.weight = nn.Parameter(torch.ones(width))
        self.group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squares = x.float().square().sum(-1, keepdim=True)
        if self.group is not None:
            squares = _SummedOver.apply(squares, self.group)
        weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        return weight * (x.float() * torch.rsqrt(squares / self.width + self.eps)).to(x.dtype)


class _SummedOver(torch.autograd.Function):
    """``x`` summed over ``group``, and so is its gradient: each rank's sum feeds that rank's part of the loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class Attention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim = config.head_size
        bias = config.qkv_bias
        self.wq = nn.Linear(config.hidden_size, config.num_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(config.hidden_size, config.kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(config.hidden_size, config.kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(config.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.across_heads = config.qk_norm and config.qk_norm_across_heads
        if self.across_heads:
            self.q_norm = HeadsRMSNorm(config.num_heads * self.head_dim, config.norm_eps)
            self.k_norm = HeadsRMSNorm(config.kv_heads * self.head_dim, config.norm_eps)
        elif config.qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.core = CausalAttention()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        q, k = self.wq(x), self.wk(x)
        if self.across_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = split_heads(q, self.head_dim), split_heads(k, self.head_dim), split_heads(self.wv(x), self.head_dim)
        if self.q_norm is not None and not self.across_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core(q, k, v) if documents is None else self.core(q, k, v, documents)
        return self.wo(merge_heads(out))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, index: int = 0):
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attention = LatentAttention(config) if config.kv_lora_rank else Attention(config)
        self.ffn_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.feed_forward = (MoEFeedForward(config) if config.moe_layer(index)
                             else SwiGLU(config.hidden_size, config.ffn_size))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None, aux_scale: float | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, documents)
        if isinstance(self.feed_forward, MoEFeedForward):
            return x + self.feed_forward(self.ffn_norm(x), aux_scale)
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    """Decoder-only transformer. A pipeline stage keeps a subset of ``layers`` and sets the parts it does
    not own (embedding, final norm, output) to None; layer names stay global so checkpoints line up."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleDict({str(i): Block(config, i) for i in range(config.num_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.output: nn.Linear | None = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.reset_parameters()
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.sequence_part = (0, 1)  # (part, parts): under SP the plan says which part the embedding returns

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.RMSNorm, HeadsRMSNorm)):
                nn.init.ones_(module.weight)
            elif isinstance(module, Experts):
                for weight in (module.w1, module.w3, module.w2):
                    nn.init.normal_(weight, std=0.02)
            elif isinstance(module, MoEFeedForward) and module.selection_bias is not None:
                nn.init.zeros_(module.selection_bias)  # materialized from the meta device, it holds garbage

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings (under SP this rank's part of the sequence); the pad token's lookups pass no
        gradient to its row (transformers' padding_idx)."""
        h = self.tok_embeddings(tokens)  # type: ignore[misc]
        if self.config.pad_token_id is None:
            return h
        part, parts = self.sequence_part
        padded = (tokens == self.config.pad_token_id).chunk(parts, 1)[part][..., None]
        return torch.where(padded, h.detach(), h)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        return_hidden: bool = False,
        inserts: Sequence[tuple[int, torch.Tensor, torch.Tensor]] = (),
        documents: Documents | None = None,
        aux_scale: float | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Token ids (batch, seq) or embeddings (batch, seq, hidden) on the first stage, hidden states on
        later stages.

        ``positions`` are the absolute positions of the sequence this rank holds (needed when the
        sequence is split, e.g. by context parallelism), (seq,) or one row each (batch, seq), or M-RoPE's
        (3, batch, seq); by default 0..seq-1. ``documents``: packed rows, each token attending only within its document (the
        positions then restart per document). ``inserts``: other modules'
        embeddings, each ``(index, values, rows)``, replacing local positions ``index`` of rows ``rows``
        of the token embeddings (placeholders); with ``deepstack_layers``, ``values`` are wider by one
        ``hidden_size`` part per listed layer, each added at the same places after its layer (on the first
        pipeline stage, which holds them). ``return_hidden``: also return the final
        (normed) hidden states, e.g. for a module conditioned on them. ``aux_scale``: with experts, the
        factor their auxiliary losses join the backward with (``moe.py``; None leaves them out).
        """
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        config = self.config
        cos, sin = rope_tables(config.rotary_size, positions, config.rope_theta, config.rope_scaling, mrope_of(config))
        cos, sin = cos.to(x.device), sin.to(x.device)
        # Float input is already embedded: hidden states from the previous stage, or the first stage's
        # embeddings with other modalities merged in.
        h = x if torch.is_floating_point(x) else self.embed(x)
        added: dict[int, list] = {}  # DeepStack: layer -> features to add after it
        for index, values, rows in inserts:
            values, *taps = values.split(config.hidden_size, -1)
            h = place_rows(h, index, values, rows)
            for layer, tap in zip(config.deepstack_layers, taps):
                added.setdefault(layer, []).append((index, tap, rows))
        routed = [layer.feed_forward for layer in self.layers.values() if isinstance(layer.feed_forward, MoEFeedForward)]
        pool = PooledBalance(config, routed, h.device) if config.balance_pooled and aux_scale is not None and routed else None
        for name, layer in self.layers.items():
            h = layer(h, cos, sin, documents, aux_scale)
            for index, tap, rows in added.get(int(name), ()):
                h = add_rows(h, index, tap, rows)
        if pool is not None:
            pool.finish(routed[0].row_group)
        if self.norm is not None:
            h = self.norm(h)
        out = self.output(h) if self.output is not None else h
        return (out, h) if return_hidden else out


def place_rows(h: torch.Tensor, index: torch.Tensor, values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``h`` (batch, seq, hidden) with positions ``index`` of rows ``rows`` replaced by ``values``
    (len(rows), len(index), hidden), or token by token with values (tokens, hidden) going to
    ``h[rows[t], index[t]]``; the rest unchanged. Differentiable in both."""
    out = h.clone()
    if values.dim() == 2:
        out[rows, index] = values.to(h.dtype)
    else:
        out[rows[:, None], index[None, :]] = values.to(h.dtype)
    return out


def add_rows(h: torch.Tensor, index: torch.Tensor, values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``h`` with ``values`` added where ``place_rows`` would put them (DeepStack's features)."""
    where = (rows, index) if values.dim() == 2 else (rows[:, None], index[None, :])
    return h.index_put(where, values.to(h.dtype), accumulate=True)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over every position (the caller divides by the global count)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")
