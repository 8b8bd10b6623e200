"""GeneZip: a DNA compressor that learns where its tokens start (H-Net dynamic chunking) and how many bases
each token covers in each kind of genomic region (the Region-Aware Ratio objective).

A stage embeds its input, runs *encoder* blocks whose attention sees only the last ``local_window``
positions, and a boundary router scores every position from the similarity of adjacent hidden states:
``p_t = (1 - cos(q_t, k_{t-1})) / 2`` and ``p_0 = 1``. Positions with ``p_t >= 1/2`` start a chunk
(bounded routing may add or drop some, below). The hidden states at chunk starts form the compressed
sequence, which the *main network* (full causal attention) processes, or, with two stages, a second stage
of the same kind. The de-chunker smooths the main network's outputs with an EMA whose rate is each chunk's
boundary probability, hands every position the smoothed state of its chunk times the router's confidence
in its decision (1 in the forward pass, the confidence's gradient in the backward, so the router also
learns from the prediction loss), adds a projection of the encoder's state, and *decoder* blocks
(local attention) predict the next base.

Everything is causal: a chunk's state is taken at its first position, the main network is causal over
chunks, and the bounded routing decides each position from earlier ones in its window, so the prediction
at base ``t`` depends on bases ``<= t`` only.

Ratio loss (H-Net): with F the fraction of positions chosen and G their mean boundary probability,
``N/(N-1) ((N-1) F G + (1-F)(1-G))`` drives F to 1/N (N bases per token); its gradient reaches the router
through G. The Region-Aware Ratio applies it per region with that region's target N_r, taken from gene
annotations at training time only; inference routes raw DNA. Each sequence computes its own F and G per
region and contributes in proportion to its bases, so the loss is a mean over sequences (exact under data
parallelism).

Bounded routing: within every window of ``routing_window`` positions at least ``min_boundaries`` and at
most ``max_boundaries`` (0: no ceiling) positions start a chunk. Both are decided causally: a boundary is
dropped when earlier ones in its window already reach the ceiling; once the positions left in a window are
just enough to reach the floor, each of them starts a chunk.

When the region targets differ, a region budget (``regions.py``) classifies every base causally and
biases stage 1's boundary probabilities per predicted region, so each region meets its own target. The
biased probabilities choose the chunk starts and feed the de-chunker; the ratio loss still sees the router's
own probabilities and decisions. Were it to see the biased ones, router and bias would be interchangeable:
the router drifts with nothing to hold it, the controller's bias grows to follow, and coding DNA is routed in
the saturated tail of the router's probabilities. Measured on held-out DNA: coding biases ended at +0.6
to +1.7 (+2.8 at four times the controller's gain) and coding DNA lost up to 0.015 bits per base (0.039)
against H-Net; with the loss on the router itself the biases end between -1 and +0.1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hetero.data.genome import BASES
from hetero.kernels.attention import LocalCausalAttention
from hetero.models.genezip.config import GeneZipConfig
from hetero.models.genezip.regions import RegionBudget
from hetero.models.gpt.model import Block
from hetero.models.gpt.rope import rope_tables



@dataclass
class Routing:
    """One stage's routing of a batch: boundary probabilities, chosen chunk starts, real positions, and what
    the router alone gave (the ratio loss trains it on those; they differ under a region budget's bias)."""

    probability: torch.Tensor  # (batch, length) float: the de-chunker's rates and confidences
    boundary: torch.Tensor  # (batch, length) bool
    valid: torch.Tensor  # (batch, length) bool: False on the padding of a compressed sequence
    router_probability: torch.Tensor | None = None  # None: ``probability``
    router_boundary: torch.Tensor | None = None  # None: ``boundary``

    def __post_init__(self) -> None:
        if self.router_probability is None:
            self.router_probability = self.probability
        if self.router_boundary is None:
            self.router_boundary = self.boundary


@dataclass
class GeneZipOutput:
    logits: torch.Tensor  # (batch, seq, bases): the next base at every position
    routings: list[Routing]  # stage 1 first
    tokens: torch.Tensor  # (batch, max chunks, width): stage 1's compressed sequence after the main network
    token_valid: torch.Tensor  # (batch, max chunks) bool
    region_logits: torch.Tensor | None = None  # (batch, seq): the region budget's coding logits


class Blocks(nn.Module):
    """Transformer blocks (RoPE over positions 0..L-1), with local or full causal attention."""

    def __init__(self, config: GeneZipConfig, count: int, window: int | None):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_heads
        self.layers = nn.ModuleDict({str(i): Block(config.block_config()) for i in range(count)})
        if window is not None:
            for block in self.layers.values():
                block.attention.core = LocalCausalAttention(window)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_tables(self.head_dim, torch.arange(x.shape[1], device=x.device), 10000.0)
        for layer in self.layers.values():
            x = layer(x, cos.to(x.device), sin.to(x.device))
        return x


class BoundaryRouter(nn.Module):
    """``p_t = (1 - cos(W_q h_t, W_k h_{t-1})) / 2``, ``p_0 = 1``; W_q and W_k start as the identity."""

    def __init__(self, hidden: int):
        super().__init__()
        self.wq = nn.Linear(hidden, hidden, bias=False)
        self.wk = nn.Linear(hidden, hidden, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q = F.normalize(self.wq(h[:, 1:]), dim=-1)
        k = F.normalize(self.wk(h[:, :-1]), dim=-1)
        p = ((1 - (q * k).sum(-1)) / 2).clamp(0.0, 1.0)
        return torch.cat([torch.ones_like(p[:, :1]), p], dim=1)


def bound_boundaries(boundary: torch.Tensor, window: int, floor: int, ceiling: int) -> torch.Tensor:
    """Causal bounded routing: at most ``ceiling`` (0: any) and at least ``floor`` chunk starts in every
    window of ``window`` positions (a short last window: as many as it has positions, up to ``floor``)."""
    batch, length = boundary.shape
    pad = -length % window
    x = F.pad(boundary, (0, pad)).view(batch, -1, window)
    if ceiling:
        x = x & (x.long().cumsum(-1) - x.long() < ceiling)
    if floor:
        starts = torch.arange(0, length + pad, window, device=x.device)
        real = (length - starts).clamp(max=window)  # real positions in each window
        left = real[:, None] - torch.arange(window, device=x.device)  # positions left, this one included
        before = x.long().cumsum(-1) - x.long()
        x = x | ((floor - before >= left) & (left > 0))
    return x.reshape(batch, -1)[:, :length]


def smooth_chunks(states: torch.Tensor, rate: torch.Tensor) -> torch.Tensor:
    """EMA over chunks: ``s_j = P_j z_j + (1 - P_j) s_{j-1}`` with ``P_j`` a chunk's boundary probability.

    An inclusive scan of the affine maps ``s -> (1 - P_j) s + P_j z_j`` in log2(chunks) vectorised steps:
    step k composes each map with the one 2^k chunks earlier. Only products of factors in [0, 1] appear
    (no division by a vanishing cumulative product, and P_0 = 1 is allowed)."""
    rate = rate.unsqueeze(-1).to(states.dtype)
    decay, value = 1 - rate, rate * states
    shift = 1
    while shift < states.shape[1]:
        value = value + decay * F.pad(value[:, :-shift], (0, 0, shift, 0))
        decay = decay * F.pad(decay[:, :-shift], (0, 0, shift, 0), value=1.0)
        shift *= 2
    return value


def straight_through(confidence: torch.Tensor) -> torch.Tensor:
    """1 in the forward pass, the gradient of ``confidence`` in the backward pass."""
    return confidence + (1 - confidence).detach()


class ChunkStage(nn.Module):
    """Encoder, router, an inner network over the chunks (the main network or another stage), de-chunker
    and decoder; maps (batch, length, hidden) to the same shape."""

    def __init__(self, config: GeneZipConfig, depth: int):
        super().__init__()
        self.config, self.depth = config, depth
        self.encoder = Blocks(config, config.encoder_layers, config.local_window)
        self.router = BoundaryRouter(config.hidden_size) if config.routing == "dynamic" else None
        last = depth + 1 == config.stages
        self.inner = Blocks(config, config.main_layers, None) if last else ChunkStage(config, depth + 1)
        self.residual = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.decoder = Blocks(config, config.decoder_layers, config.local_window)

    def route(self, h: torch.Tensor, valid: torch.Tensor, bias: torch.Tensor | None) -> Routing:
        config = self.config
        if self.router is None:
            stride = config.stride if self.depth == 0 else int(config.inner_bpt)
            boundary = (torch.arange(h.shape[1], device=h.device) % stride == 0).expand(h.shape[0], -1)
            return Routing(boundary.to(h.dtype), boundary & valid, valid)
        return self.decide(self.router(h), valid, bias)

    def decide(self, probability: torch.Tensor, valid: torch.Tensor, bias: torch.Tensor | None) -> Routing:
        """The chunk starts from the router's probabilities, shifted by ``bias`` (log-odds) when given."""
        routing = Routing(probability, self.bound(probability >= 0.5) & valid, valid)
        if bias is None:
            return routing
        # Position 0 always starts a chunk.
        shifted = torch.sigmoid(torch.logit(probability[:, 1:].clamp(1e-6, 1 - 1e-6)) + bias[:, 1:])
        shifted = torch.cat([probability[:, :1], shifted], 1)
        return Routing(shifted, self.bound(shifted >= 0.5) & valid, valid, probability, routing.boundary)

    def bound(self, boundary: torch.Tensor) -> torch.Tensor:
        config = self.config
        if self.depth:
            return boundary
        return bound_boundaries(boundary, config.routing_window, config.min_boundaries, config.max_boundaries)

    def forward(
        self, x: torch.Tensor, valid: torch.Tensor, bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[Routing], tuple]:
        """``bias`` (batch, length): added to the router's log-odds (stage 1 under a region budget)."""
        h = self.encoder(x)
        routing = self.route(h, valid, bias)
        probability, boundary = routing.probability, routing.boundary
        counts = boundary.sum(1)
        # Boundary positions first, in order (a stable sort), then cut at the longest row's count.
        order = torch.argsort((~boundary).to(torch.int8), dim=1, stable=True)[:, : int(counts.max())]
        chunk_valid = torch.arange(order.shape[1], device=x.device) < counts[:, None]
        chunks = h.gather(1, order[..., None].expand(-1, -1, h.shape[-1]))
        if isinstance(self.inner, ChunkStage):
            processed, routings, _ = self.inner(chunks, chunk_valid)
        else:
            processed, routings = self.inner(chunks), []
        smoothed = smooth_chunks(processed, probability.gather(1, order))
        chunk_of = (boundary.long().cumsum(1) - 1).clamp(min=0)
        up = smoothed.gather(1, chunk_of[..., None].expand(-1, -1, h.shape[-1]))
        confidence = torch.where(boundary, probability, 1 - probability)
        y = self.decoder(up * straight_through(confidence).unsqueeze(-1) + self.residual(h))
        return y, [routing] + routings, (processed, chunk_valid)


class GeneZip(nn.Module):
    def __init__(self, config: GeneZipConfig):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(len(BASES), config.hidden_size)
        self.stage = ChunkStage(config, 0)
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.output = nn.Linear(config.hidden_size, len(BASES), bias=False)
        self.projector = nn.Linear(config.hidden_size, config.out_size, bias=False) if config.out_size else None
        self.budget = RegionBudget(
            config.region_targets(), config.region_channels, config.region_gain
        ) if config.region_budget() else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
        for module in self.modules():
            if isinstance(module, BoundaryRouter):
                with torch.no_grad():
                    module.wq.weight.copy_(torch.eye(self.config.hidden_size))
                    module.wk.weight.copy_(torch.eye(self.config.hidden_size))
        if self.budget is not None:  # the classifier keeps torch's default initialisation
            for module in self.budget.modules():
                if isinstance(module, (nn.Linear, nn.Conv1d)):
                    module.reset_parameters()

    def forward(self, bases: torch.Tensor, rate_shift: float = 0.0) -> GeneZipOutput:
        """``bases`` (batch, seq) ids in ``BASES`` order. ``rate_shift``: log-odds added to every stage-1
        boundary probability at inference, to compress at another rate (``rate.py`` finds one)."""
        x = self.embedding(bases)
        valid = torch.ones(bases.shape, dtype=torch.bool, device=bases.device)
        region_logits, bias = self.stage_one_bias(bases, rate_shift)
        y, routings, (tokens, token_valid) = self.stage(x, valid, bias)
        if self.projector is not None:
            tokens = self.projector(tokens) * token_valid.unsqueeze(-1)
        return GeneZipOutput(self.output(self.norm(y)), routings, tokens, token_valid, region_logits)

    def stage_one_bias(
        self, bases: torch.Tensor, rate_shift: float = 0.0
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The region budget's coding logits and stage 1's log-odds bias (its bias per called region plus
        ``rate_shift``); None for either that does not apply."""
        if self.budget is None:
            shift = torch.full(bases.shape, rate_shift, device=bases.device) if rate_shift else None
            return None, shift
        region_logits = self.budget(bases)
        return region_logits, self.budget.router_bias(region_logits) + rate_shift


def padded_tokens(output: GeneZipOutput, config: GeneZipConfig) -> torch.Tensor:
    """The compressed tokens zero-padded to ``config.max_tokens()``: a fixed width for another module."""
    return F.pad(output.tokens, (0, 0, 0, config.max_tokens() - output.tokens.shape[1]))
