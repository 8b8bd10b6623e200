"""GeneZip's training objective (next-base prediction plus the ratio loss of every stage) and what its
routing achieved: bases per token per region and chunk starts per routing window."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F

from hetero.data.genome import REGIONS
from hetero.models.genezip.model import GeneZip, GeneZipOutput, Routing
from hetero.models.genezip.config import GeneZipConfig


@dataclass
class GeneZipLoss:
    """Per-sequence terms (batch,): the mean over a batch is the objective, a sum over rows divided by
    the global batch size is exact under data parallelism."""

    prediction: torch.Tensor  # next-base cross-entropy, nats per base
    ratio: torch.Tensor  # the ratio losses of every stage, summed
    region: torch.Tensor  # the region budget's classifier cross-entropy, nats per base (0 without one)

    def total(self, config: GeneZipConfig) -> torch.Tensor:
        return self.prediction + config.ratio_weight * self.ratio + self.region


def next_base_loss(logits: torch.Tensor, bases: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting base t+1 at every position t, per sequence (nats)."""
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), bases[:, 1:].flatten(), reduction="none")
    return loss.view(bases.shape[0], -1).mean(1)


def ratio_loss(routing: Routing, targets: torch.Tensor, regions: torch.Tensor | None) -> torch.Tensor:
    """H-Net's ratio loss per sequence, computed per region against its target bases per token and
    weighted by the region's share of the sequence's real positions. ``targets`` (regions,) are indexed
    by ``regions`` (batch, length); None: one region, ``targets[0]``. F and G are the router's own (before
    a region budget's bias): the loss trains the router, the budget's controller steers the bias."""
    valid = routing.valid
    regions = torch.zeros_like(valid, dtype=torch.long) if regions is None else regions
    total = torch.zeros(valid.shape[0], dtype=routing.probability.dtype, device=valid.device)
    count = valid.sum(1).clamp(min=1)
    for region, target in enumerate(targets.tolist()):
        mask = valid & (regions == region)
        size = mask.sum(1)
        chosen = (routing.router_boundary & mask).sum(1) / size.clamp(min=1)  # F: no gradient
        probability = (routing.router_probability * mask).sum(1) / size.clamp(min=1)  # G
        loss = target / (target - 1) * ((target - 1) * chosen * probability + (1 - chosen) * (1 - probability))
        total = total + loss * size / count
    return total


def genezip_loss(
    config: GeneZipConfig, output: GeneZipOutput, bases: torch.Tensor, regions: torch.Tensor | None
) -> GeneZipLoss:
    """Stage 1's ratio loss uses the per-region targets (``regions`` are needed only when the targets
    differ, which also trains the region budget's classifier on them); stage 2 aims at ``inner_bpt``
    everywhere. A fixed-stride model has no ratio loss."""
    prediction = next_base_loss(output.logits, bases)
    ratio = torch.zeros_like(prediction)
    region = torch.zeros_like(prediction)
    if output.region_logits is not None:
        region = F.binary_cross_entropy_with_logits(
            output.region_logits.float(), regions.float(), reduction="none"
        ).mean(1)
    if config.routing == "dynamic":
        targets = config.region_targets()
        if bool((targets == targets[0]).all()):
            ratio = ratio + ratio_loss(output.routings[0], targets[:1], None)
        else:
            ratio = ratio + ratio_loss(output.routings[0], targets, regions)
        for routing in output.routings[1:]:
            ratio = ratio + ratio_loss(routing, torch.tensor([config.inner_bpt], device="cpu"), None)
    return GeneZipLoss(prediction, ratio, region)


def bits_per_base(prediction: torch.Tensor) -> torch.Tensor:
    return prediction / math.log(2)


@dataclass
class RoutingCounts:
    """Bases and chunk starts per region over sequences seen (stage 1), and the fewest chunk starts any
    full routing window or any sequence had."""

    bases: torch.Tensor  # (regions,)
    tokens: torch.Tensor  # (regions,)
    fewest_per_window: int
    fewest_per_sequence: int

    def bases_per_token(self) -> dict[str, float]:
        return {name: float(self.bases[i] / self.tokens[i].clamp(min=1)) for i, name in enumerate(REGIONS)}

    def overall_bases_per_token(self) -> float:
        return float(self.bases.sum() / self.tokens.sum().clamp(min=1))


def routing_counts(routing: Routing, regions: torch.Tensor, window: int) -> RoutingCounts:
    boundary = routing.boundary
    bases = torch.stack([(regions == r).sum() for r in range(len(REGIONS))])
    tokens = torch.stack([(boundary & (regions == r)).sum() for r in range(len(REGIONS))])
    full = boundary.shape[1] // window * window
    per_window = boundary[:, :full].reshape(boundary.shape[0], -1, window).sum(-1)
    return RoutingCounts(bases, tokens, int(per_window.min()), int(boundary.sum(1).min()))


def merge_counts(a: RoutingCounts, b: RoutingCounts) -> RoutingCounts:
    return RoutingCounts(
        a.bases + b.bases, a.tokens + b.tokens, min(a.fewest_per_window, b.fewest_per_window),
        min(a.fewest_per_sequence, b.fewest_per_sequence),
    )


def region_nats(output: GeneZipOutput, bases: torch.Tensor, regions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-base cross-entropy summed per region of the predicted base (nats, float64) and the count of
    predictions per region."""
    losses = F.cross_entropy(output.logits[:, :-1].flatten(0, 1).float(), bases[:, 1:].flatten(), reduction="none")
    target_regions = regions[:, 1:].flatten()
    nats = torch.stack([losses[target_regions == r].double().sum() for r in range(len(REGIONS))])
    counted = torch.stack([(target_regions == r).sum().double() for r in range(len(REGIONS))])
    return nats, counted


@torch.no_grad()
def heldout_metrics(
    model: GeneZip, batches: Iterable[dict[str, torch.Tensor]], rate_shift: float = 0.0
) -> dict[str, float]:
    """Over every batch (``bases``, ``regions``): bits per base of next-base prediction, overall and per
    region (a prediction counts in its target base's region), the achieved bases per token per region and
    overall, and the fewest chunk starts in any full routing window and in any sequence (stage 1).
    ``model`` routes the raw bases (at ``rate_shift``, see ``rate.py``); the region labels only sort the counts."""
    nats = torch.zeros(len(REGIONS), dtype=torch.float64, device="cpu")
    bases = torch.zeros(len(REGIONS), dtype=torch.float64, device="cpu")
    counts = None
    for batch in batches:
        output = model(batch["bases"], rate_shift)
        batch_nats, batch_bases = region_nats(output, batch["bases"], batch["regions"])
        nats, bases = nats + batch_nats.cpu(), bases + batch_bases.cpu()
        batch_counts = routing_counts(output.routings[0], batch["regions"], model.config.routing_window)
        counts = batch_counts if counts is None else merge_counts(counts, batch_counts)
    if counts is None:
        raise ValueError("no held-out batches")
    result = {"bits_per_base": float(nats.sum() / bases.sum()) / math.log(2)}
    result |= {f"bits.{name}": float(nats[r] / bases[r]) / math.log(2) for r, name in enumerate(REGIONS)}
    result |= {f"bpt.{name}": value for name, value in counts.bases_per_token().items()}
    return result | {
        "bpt": counts.overall_bases_per_token(),
        "fewest_per_window": float(counts.fewest_per_window),
        "fewest_per_sequence": float(counts.fewest_per_sequence),
    }
