"""Mixture-of-experts feed-forward: token-choice top-k routing over SwiGLU experts, shared experts that
every token goes through, and the router's auxiliary losses.

Each token's router scores (a softmax over experts, or each expert's sigmoid) pick its ``top_k``
experts; its output is the gate-weighted sum of theirs. The rows routed to the experts travel sorted by
expert through a dispatch: here every expert is local (``LocalExperts``); under expert parallelism the
plan swaps in an all-to-all over the EP group (``hetero.parallel.expert_parallel``). Dropless by
default; with ``capacity_factor`` > 0 each expert takes at most ``ceil(factor · tokens · top_k / experts)``
of a call's assignments, in token order, and the rest are dropped (the residual carries those tokens).

The auxiliary losses are sums that decompose over tokens, so they are exact however the tokens are split
over ranks and microbatches:

- load balance, per row: ``E · Σ_t Σ_e f_{row(t),e} · p_{t,e}``, with ``f`` the fraction of the row's
  top-k assignments that went to expert ``e`` (counted over the whole row: the plan sets ``row_group``
  where the row's tokens are spread over ranks, CP and TP) and ``p`` the router's probabilities. Summed over a
  row it is the row's length times the Switch Transformer's ``E · Σ_e f_e P_e`` (1 when balanced);
- router z-loss: ``Σ_t logsumexp(logits_t)²``.

With ``balance_pooled`` the load balance is transformers' instead (``load_balancing_loss_func``), for runs
that must reproduce its curves: ``E · Σ_e F_e P_e``, with ``F`` and ``P`` the top-k assignments of
``softmax(logits)`` and its probabilities averaged over every MoE layer and every token of one forward's
batch (a microbatch on one DP rank; its TP and CP ranks hold its other tokens), a mean over those
batches. It does not decompose over tokens: ``PooledBalance`` collects the forward's counts, and each
layer's gradient, which depends on the layers after it, is computed in the backward.

Their sum, weighted by ``balance_loss`` and ``router_z_loss`` and scaled by the forward's ``aux_scale``
(1 / the global batch's tokens, so each is a mean over tokens), is attached to the layer's output: its
gradient enters the backward wherever the layer sits, on any pipeline stage. ``last_aux`` keeps the
weighted sums of the last forward for reporting.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from hetero.models.gpt.config import GPTConfig


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x)."""

    def __init__(self, hidden_size: int, ffn_size: int):
        super().__init__()
        self.w1 = nn.Linear(hidden_size, ffn_size, bias=False)
        self.w3 = nn.Linear(hidden_size, ffn_size, bias=False)
        self.w2 = nn.Linear(ffn_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """``num`` SwiGLU experts as stacked weights: w1 and w3 (num, ffn, hidden), w2 (num, hidden, ffn).
    Under expert parallelism they are DTensors split along the expert dimension; a rank runs its own."""

    def __init__(self, num: int, hidden_size: int, ffn_size: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num, ffn_size, hidden_size))
        self.w3 = nn.Parameter(torch.empty(num, ffn_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num, hidden_size, ffn_size))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows ``x`` grouped by expert, ``counts[e]`` of them for the e-th expert this rank holds."""
        w1, w3, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w3, self.w2))
        outs = [(F.silu(rows @ w1[e].T) * (rows @ w3[e].T)) @ w2[e].T for e, rows in enumerate(x.split(counts))]
        return torch.cat(outs) if outs else x


class Dispatch(Protocol):
    def __call__(self, experts: Experts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts' outputs for rows ``x`` sorted by expert, ``counts`` (num_experts,) per expert."""
        ...


class LocalExperts:
    """Every expert on this rank. The counts go to the host to split the rows (dropless routing's one
    device-to-host copy per layer)."""

    bytes_sent = 0

    def __call__(self, experts: Experts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return experts(x, counts.tolist())


def with_aux_loss(out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """``out``, carrying ``aux`` (already scaled as a part of the total loss) into its backward."""
    return _WithAuxLoss.apply(out, aux) if torch.is_grad_enabled() else out


class _WithAuxLoss(torch.autograd.Function):
    """The layer's output unchanged; in backward, the auxiliary loss gets gradient 1 (it was scaled as a
    part of the total loss already)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_dtype, ctx.aux_device = aux.dtype, aux.device
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), dtype=ctx.aux_dtype, device=ctx.aux_device)


class Routing:
    """What a layer that routes tokens to experts keeps for reporting: the weighted auxiliary-loss sums of
    its last forward, and its training forwards' routing so far (not state: they restart with the
    process): tokens each expert took, and assignments routed and dropped. The native layer below and the
    megatron backend's router both keep it."""

    def start_records(self, num_experts: int) -> None:
        self.last_aux: dict[str, torch.Tensor] = {}
        # on the host, also when the model is built on the meta device (init.hf): the first record moves them
        cpu = torch.device("cpu")
        self.load = torch.zeros(num_experts, dtype=torch.float64, device=cpu)
        self.assigned = torch.zeros((), dtype=torch.float64, device=cpu)
        self.dropped = torch.zeros((), dtype=torch.float64, device=cpu)

    def counts_this_forward(self) -> bool:
        """Whether this forward is one to count: a training one, not a recompute's (torch's checkpoint
        reruns the forward inside the backward)."""
        return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1

    def record(self, counts: torch.Tensor, assigned: int, dropped: torch.Tensor) -> None:
        """A training forward's routing, once per forward (``counts_this_forward``)."""
        if self.counts_this_forward():
            self.load = self.load.to(counts.device) + counts.double()
            self.assigned = self.assigned.to(counts.device) + assigned
            self.dropped = self.dropped.to(counts.device) + dropped.double()

    def aux_loss(self, config: GPTConfig, logits: torch.Tensor, scores: torch.Tensor, row_counts: torch.Tensor,
                 row_of: torch.Tensor, row_group: dist.ProcessGroup | None) -> torch.Tensor:
        """The weighted sum of both auxiliary losses over this call's tokens (``logits`` and ``scores``,
        (tokens, experts)); ``row_counts`` (rows, experts): the top-k assignments of each row's tokens
        here, ``row_of`` each token's row. Kept in ``last_aux``."""
        probs = scores if config.gate == "softmax" else scores / scores.sum(-1, keepdim=True)
        if row_group is not None:
            dist.all_reduce(row_counts, group=row_group)
        fractions = row_counts / row_counts.sum(-1, keepdim=True).clamp(min=1)
        balance = config.num_experts * (fractions[row_of] * probs).sum() * config.balance_loss
        z = logits.logsumexp(-1).square().sum() * config.router_z_loss
        self.last_aux = {"balance_loss": balance.detach(), "z_loss": z.detach()}
        return balance + z


class PooledBalance:
    """One forward's pooled load-balancing loss (``balance_pooled``): each MoE layer adds its routing, the
    forward finishes the pool, and each layer's part of the loss (and its gradient) follows from the
    pooled assignments ``C``. With ``aux_scale`` = 1 / (G·T), G batches of T tokens, the layer's part is
    ``balance_loss · E / (L²·T) · Σ_e C_e P_e`` over its L MoE layers and its local probability sums
    ``P``: summed over layers, ranks and batches, ``balance_loss`` times the mean over batches of
    transformers' ``E · Σ_e (C_e / LT) (P_e / LT)``."""

    def __init__(self, config: GPTConfig, layers: list["MoEFeedForward"], device: torch.device):
        self.config, self.layers = config, layers
        self.counts = torch.zeros(config.num_experts + 1, dtype=torch.float32, device=device)  # then the tokens
        self.probs: list[torch.Tensor] = []
        self.weights: torch.Tensor | None = None  # d loss / d P of every layer, once finished
        for layer in layers:
            layer.pool = self

    def add(self, logits: torch.Tensor) -> torch.Tensor:
        """A layer's routing logits (tokens, experts): its placeholder part of the loss, whose gradient the
        finished pool gives."""
        probs = logits.softmax(-1)
        chosen = probs.topk(self.config.top_k, dim=-1).indices.flatten()
        self.counts.index_add_(0, chosen, torch.ones(len(chosen), dtype=self.counts.dtype, device=chosen.device))
        self.counts[-1] += len(logits)
        summed = probs.sum(0)
        self.probs.append(summed.detach())
        return _PooledPart.apply(summed, self)

    def finish(self, row_group: dist.ProcessGroup | None) -> None:
        """After the forward's last MoE layer: the pool over the whole batch (``row_group``'s ranks hold its
        other tokens), and each layer's reported part (``last_aux``)."""
        if row_group is not None:
            dist.all_reduce(self.counts, group=row_group)
        config, counts, rows = self.config, self.counts[:-1], self.counts[-1].clamp(min=1)  # rows: L·T
        self.weights = config.balance_loss * config.num_experts / (len(self.layers) * rows) * counts
        for layer, probs in zip(self.layers, self.probs):
            layer.last_aux["balance_loss"] = (self.weights * probs).sum()


class _PooledPart(torch.autograd.Function):
    """0 in the forward (the pool is not complete yet); in the backward, the pool's weights times the
    incoming gradient for the layer's probability sums."""

    @staticmethod
    def forward(ctx, probs: torch.Tensor, pool: PooledBalance) -> torch.Tensor:
        ctx.pool = pool
        return probs.new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.pool.weights, None


def routed_layers(model: nn.Module) -> list[tuple[int, Routing]]:
    """(global layer index, routing record) of every mixture-of-experts layer of a model on this rank."""
    if hasattr(model, "routed_layers"):  # a backend whose layer names differ from the native model's
        return model.routed_layers()
    return [(int(name.split(".")[1]), layer) for name, layer in model.named_modules()
            if isinstance(layer, MoEFeedForward)]


class MoEFeedForward(nn.Module, Routing):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, config.hidden_size, config.expert_size)
        self.shared = (SwiGLU(config.hidden_size, config.shared_experts * config.expert_size)
                       if config.shared_experts else None)
        self.shared_gate = nn.Linear(config.hidden_size, 1, bias=False) if config.shared_expert_gate else None
        self.selection_bias = (nn.Buffer(torch.zeros(config.num_experts, dtype=torch.float32))
                               if config.selection_bias else None)
        self.dispatch: Dispatch = LocalExperts()
        self.row_group: dist.ProcessGroup | None = None  # ranks holding other tokens of the same rows (CP, TP)
        self.pool: PooledBalance | None = None  # the forward's, with balance_pooled
        self.start_records(config.num_experts)

    def forward(self, x: torch.Tensor, aux_scale: float | None = None) -> torch.Tensor:
        """``x`` (batch, seq, hidden). ``aux_scale``: what the auxiliary losses' sums are multiplied by before
        they join the backward (1 / the tokens of the global batch); None leaves them out (e.g. inference)."""
        config = self.config
        num, k = config.num_experts, config.top_k
        batch, seq, hidden = x.shape
        tokens = x.reshape(-1, hidden)
        if config.router_fp32:
            with torch.autocast(x.device.type, enabled=False):
                logits = self.router(tokens.float())
        else:
            logits = self.router(tokens).float()
        scores = logits.softmax(-1) if config.gate == "softmax" else logits.sigmoid()
        chosen = self._choose(scores)
        gates = scores.gather(1, chosen)
        if config.normalize_gates:
            gates = gates / gates.sum(-1, keepdim=True)
        gates = gates * config.routed_scale if config.routed_scale != 1.0 else gates
        flat = chosen.flatten()
        order = flat.argsort(stable=True)  # assignments grouped by expert, in token order within each
        counts = torch.bincount(flat, minlength=num)
        routed = torch.ones_like(order, dtype=torch.bool)
        if config.capacity_factor > 0:
            capacity = math.ceil(config.capacity_factor * len(tokens) * k / num)
            place = torch.arange(len(order), device=x.device) - (counts.cumsum(0) - counts)[flat[order]]
            routed = place < capacity
            order, counts = order[routed], counts.clamp(max=capacity)
        token_of = order // k
        out = self.dispatch(self.experts, tokens[token_of], counts)
        weights = gates.flatten()[order].to(out.dtype)
        out = torch.zeros(tokens.shape, dtype=out.dtype, device=x.device).index_add(0, token_of, out * weights[:, None])
        if self.shared is not None:
            shared = self.shared(tokens)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(tokens)) * shared)
        out = out.view(batch, seq, hidden)
        self.record(counts, flat.numel(), (~routed).sum())
        if aux_scale is None:
            return out
        row_of = torch.arange(batch, device=x.device).repeat_interleave(seq)
        row_counts = torch.zeros(batch, num, dtype=torch.float32, device=x.device)
        row_counts.index_put_((row_of.repeat_interleave(k), flat), torch.ones(flat.numel(), device=x.device),
                              accumulate=True)
        if config.balance_pooled:
            z = logits.logsumexp(-1).square().sum() * config.router_z_loss
            self.last_aux = {"z_loss": z.detach()}  # the balance part comes when the pool is finished
            aux = self.pool.add(logits) + z
        else:
            aux = self.aux_loss(config, logits, scores, row_counts, row_of, self.row_group)
        return with_aux_loss(out, aux * aux_scale)

    def _choose(self, scores: torch.Tensor) -> torch.Tensor:
        """Each token's top_k experts by its scores plus the selection bias, within its groups_per_token best
        groups (each ranked by the sum of its two best) where the experts are grouped."""
        config = self.config
        choice = scores if self.selection_bias is None else scores + self.selection_bias
        if config.expert_groups > 1:
            grouped = choice.view(len(choice), config.expert_groups, -1)
            best = grouped.topk(2, dim=-1).values.sum(-1).topk(config.groups_per_token, dim=-1).indices
            allowed = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter(1, best, True)
            choice = choice.masked_fill(~allowed.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        return choice.topk(config.top_k, dim=-1).indices
