"""Compressing at a chosen rate after training: one log-odds shift of stage 1's router.

The ratio loss and the region budget hold the rate on the training data, but the router's probabilities
crowd around the 1/2 threshold, so a few hundredths of log-odds of drift between the training windows and
other DNA move the bases per token by percents. Comparing compressors at equal rate therefore sets, per
model, the one shift of every position's log-odds (on top of any region bias) at which the evaluated
windows average the wanted bases per token. It uses no labels; the model is not changed.
"""

from __future__ import annotations

from typing import Iterable

import torch

from hetero.models.genezip.model import GeneZip

SHIFT_RANGE = 8.0  # log-odds; far past any shift a trained router needs to reach a sane rate
BISECTIONS = 40


@torch.no_grad()
def matched_rate_shift(model: GeneZip, batches: Iterable[dict[str, torch.Tensor]], target_bpt: float) -> float:
    """The ``rate_shift`` at which ``model`` routes the ``bases`` of ``batches`` at ``target_bpt`` bases per
    stage-1 token (bisection: more shift, more chunk starts)."""
    if model.stage.router is None:
        raise ValueError("fixed-stride routing has no router to shift: its rate is its stride")
    stage, cached, bases_seen = model.stage, [], 0
    for batch in batches:
        bases = batch["bases"]
        probability = stage.router(stage.encoder(model.embedding(bases)))
        _, bias = model.stage_one_bias(bases)
        bias = torch.zeros_like(probability) if bias is None else bias
        valid = torch.ones(bases.shape, dtype=torch.bool, device=bases.device)
        cached.append((probability, valid, bias))
        bases_seen += bases.numel()
    if not cached:
        raise ValueError("no batches to match the rate on")

    def bases_per_token(shift: float) -> float:
        starts = sum(int(stage.decide(p, valid, bias + shift).boundary.sum()) for p, valid, bias in cached)
        return bases_seen / max(starts, 1)

    low, high = -SHIFT_RANGE, SHIFT_RANGE
    if not bases_per_token(high) <= target_bpt <= bases_per_token(low):
        raise ValueError(
            f"target_bpt={target_bpt} is out of reach: shifts of ±{SHIFT_RANGE} log-odds give "
            f"{bases_per_token(high):.2f} to {bases_per_token(low):.2f} bases per token"
        )
    for _ in range(BISECTIONS):
        middle = (low + high) / 2
        low, high = (middle, high) if bases_per_token(middle) > target_bpt else (low, middle)
    return (low + high) / 2
