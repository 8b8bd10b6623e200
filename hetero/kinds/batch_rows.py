"""How a rank's batch holds the global batch's rows.

A batch has per-row columns (one entry per row of the global batch) and item columns (``image_*``: one
entry per image, or per patch, ``image_row`` naming each one's row). A loader that gives each rank only what its modules read (``train.data.per_rank``) makes a *compact*
batch: a per-row column of more than one value per row (tokens, labels, documents, images, clips, DNA
windows) may hold only some rows, in ascending order, named by ``held:<column>``, a (rows,) bool flag per
global row (a rank holds a column's rows for the modules there that read it: an encoder-only rank no
token rows at all). Per-row columns of one value per row (``index``, ``label_counts``,
``has_<modality>``, ``*_position`` ...) stay global: every rank plans the step from them (which rows each
module and edge carries, the losses' divisors). A column without its ``held:`` flag holds every row.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100  # a label that carries no loss
ITEM_PREFIX = "image_"  # columns with an entry per image (or per patch), not per row
HELD = "held:"  # held:<column>: the global rows a compact column holds


def held_key(key: str) -> str:
    return HELD + key


def batch_size(batch: dict[str, torch.Tensor]) -> int:
    """The rows of the global batch."""
    key = next((k for k in batch if k.startswith(HELD)), None)
    if key is None:
        key = next(k for k in batch if not k.startswith(ITEM_PREFIX))
    return len(batch[key])


def is_compact(batch: dict[str, torch.Tensor], key: str) -> bool:
    """Whether column ``key`` of ``batch`` holds only some rows."""
    return held_key(key) in batch


def held_rows(batch: dict[str, torch.Tensor], key: str) -> int:
    """How many rows column ``key`` holds."""
    return int(batch[held_key(key)].sum()) if is_compact(batch, key) else batch_size(batch)


def take_rows(batch: dict[str, torch.Tensor], key: str, rows: torch.Tensor) -> torch.Tensor:
    """Column ``key`` at global rows ``rows``; a ``ValueError`` if a compact column does not hold them all."""
    column = batch[key]
    if not is_compact(batch, key):
        return column[rows]
    held = batch[held_key(key)].cpu()
    rows = rows.cpu()
    if not bool(held[rows].all()):
        missing = rows[~held[rows]].tolist()
        raise ValueError(f"the batch's {key} lack rows {missing[:8]}: the rank's loader left them out "
                         f"(train.data.per_rank=false gives every rank every row)")
    return column[(held.cumsum(0) - 1)[rows]]
