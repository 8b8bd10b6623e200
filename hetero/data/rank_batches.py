"""A rank's share of each batch (``train.data.per_rank``): the rows and images its modules read, as a
compact batch (``hetero.kinds.batch_rows``).

Samples of users' formats (``SampleBatches``) are tokenized and decoded for those rows and images alone.
A dataset of whole global batches is built whole and cut down to the rank's rows (its items stay whole).
Either way a row's ``label_counts`` (its labels that carry a loss) stays for every row: every rank
divides the LLM's loss by the global count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hetero.data.digits import IGNORE_INDEX
from hetero.data.sample_batches import SampleBatches
from hetero.data.sources.format import Batches
from hetero.kinds.batch_rows import ITEM_PREFIX, batch_size, held_key

if TYPE_CHECKING:
    from hetero.runtime.rows import RankReads


def compact(batch: dict[str, torch.Tensor], rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Global ``batch`` with each per-row column of more than one value per row cut down to its ``rows``
    (ascending global row numbers; a column missing from ``rows``: none)."""
    size = batch_size(batch)
    out = dict(batch)
    if "labels" in batch and "label_counts" not in batch:
        out["label_counts"] = (batch["labels"] != IGNORE_INDEX).sum(1)
    for key, value in batch.items():
        if key.startswith(ITEM_PREFIX) or value.dim() < 2:
            continue
        kept = rows.get(key, torch.zeros(0, dtype=torch.long, device="cpu"))
        out[key] = value[kept]
        out[held_key(key)] = torch.zeros(size, dtype=torch.bool, device="cpu")
        out[held_key(key)][kept] = True
    return out


def rank_batch(batches: Batches, step: int, reads: RankReads | None) -> dict[str, torch.Tensor]:
    """Step ``step``'s batch as rank ``reads`` holds it (None: the global batch)."""
    if reads is None:
        return batches.batch(step)
    if isinstance(batches, SampleBatches):
        return batches.batch(step, reads)
    batch = batches.batch(step)
    return compact(batch, reads(batch)[0])


def rank_heldout(batches: Batches, reads: RankReads | None) -> list[dict[str, torch.Tensor]]:
    """The held-out batches as rank ``reads`` holds them (None: the global batches)."""
    if reads is None:
        return batches.ordered_batches()
    if isinstance(batches, SampleBatches):
        return batches.ordered_batches(reads)
    return [compact(batch, reads(batch)[0]) for batch in batches.ordered_batches()]
