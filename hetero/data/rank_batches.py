"""A rank's share of each batch (``train.data.per_rank``): the rows its modules read, as a compact batch
(``hetero.kinds.batch_rows``).

Every dataset builds a step's batch from its bookkeeping first (the columns of one value per row, which
every rank keeps: ``index``, presence flags, ``label_counts``), asks the rank's ``RankReads`` which rows of
each wider column (tokens, labels, images, clips, DNA windows) its modules take, and builds only those
rows (``rank_columns``). A dataset that can only make whole batches (the digits' stream, a plug-in's
format) cuts them down (``compact``), images too: a rank keeps the pixels of the images its modules take
(``image_held``). A row's ``label_counts`` (its labels that carry a loss) stays for every row: every rank
divides the LLM's loss by the global count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from hetero.kinds.batch_rows import IGNORE_INDEX, ITEM_PREFIX, batch_size, held_key


Reads = Callable[[dict[str, torch.Tensor], Iterable[str]], tuple[dict[str, torch.Tensor], torch.Tensor]]
"""What one rank reads of a batch (``hetero.runtime.rows.RankReads``): given the batch's bookkeeping and
the columns being built, the global rows of each column its modules take and the items they take."""
Values = Callable[[str, torch.Tensor], torch.Tensor]  # (column, global rows) -> the column at those rows


def made_together(make: Callable[[torch.Tensor], dict[str, torch.Tensor]]) -> Values:
    """``Values`` of columns that ``make`` builds together from the same rows (a text window's tokens and
    labels): built once for each set of rows asked for."""
    made: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}

    def values(key: str, rows: torch.Tensor) -> torch.Tensor:
        rows_key = tuple(rows.tolist())
        if rows_key not in made:
            made[rows_key] = make(rows)
        return made[rows_key][key]

    return values


def rank_columns(bookkeeping: dict[str, torch.Tensor], wide: Iterable[str], values: Values,
                 reads: Reads | None, items: Callable[[torch.Tensor | None], dict[str, torch.Tensor]] | None = None
                 ) -> dict[str, torch.Tensor]:
    """A batch of ``bookkeeping`` (every row) and the ``wide`` columns, each made by ``values``: at every
    row (``reads`` None: the global batch), or at the rows rank ``reads`` takes, flagged ``held:<column>``
    (a column none of its modules reads: no rows); ``items``: the item columns of the images it takes
    (None: of every image)."""
    size, wide = batch_size(bookkeeping), tuple(wide)
    if reads is None:
        every = torch.arange(size, device="cpu")
        return bookkeeping | {key: values(key, every) for key in wide} | (items(None) if items is not None else {})
    by_column, held_items = reads(bookkeeping, (*bookkeeping, *wide))
    batch = dict(bookkeeping)
    for key in wide:
        rows = by_column.get(key, torch.zeros(0, dtype=torch.long, device="cpu"))
        batch[key] = values(key, rows)
        batch[held_key(key)] = torch.zeros(size, dtype=torch.bool, device="cpu")
        batch[held_key(key)][rows] = True
    return batch | (items(held_items) if items is not None else {})


def _items(batch: dict[str, torch.Tensor], held: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The pixels of images ``held`` alone, their numbers in ``image_held`` (None: all, as they are)."""
    if held is None:
        return {}
    if "image_pixels" in batch:
        return {"image_pixels": batch["image_pixels"][held], "image_held": held}
    sizes = batch["image_grid"].prod(1)
    starts = sizes.cumsum(0) - sizes
    patches = [torch.arange(int(starts[i]), int(starts[i] + sizes[i]), device="cpu") for i in held.tolist()]
    patches = torch.cat(patches) if patches else torch.zeros(0, dtype=torch.long, device="cpu")
    return {"image_patches": batch["image_patches"][patches], "image_held": held}


def compact(batch: dict[str, torch.Tensor], reads: Reads | None) -> dict[str, torch.Tensor]:
    """Whole ``batch`` as rank ``reads`` holds it (None: whole), with ``label_counts`` when it has labels."""
    if reads is None:
        return batch
    wide = [key for key, value in batch.items() if value.dim() >= 2 and not key.startswith(ITEM_PREFIX)]
    bookkeeping = {key: value for key, value in batch.items() if key not in wide}
    if "labels" in batch and "label_counts" not in batch:
        bookkeeping["label_counts"] = (batch["labels"] != IGNORE_INDEX).sum(1)
    pixels = "image_pixels" in batch or "image_patches" in batch
    return rank_columns(bookkeeping, wide, lambda key, rows: batch[key][rows], reads,
                        (lambda held: _items(batch, held)) if pixels else None)
