"""A built-in dataset's split held in memory as columns (one tensor per column, samples on dim 0) and
served by sample id, in an order that depends only on the seed.

Samples form one stream: epoch ``e`` is a permutation of the split drawn from ``(seed, e)``, and epochs
follow each other without dropping samples, so a batch may span two. Step ``s``'s batch holds stream
positions ``s·B .. s·B + B - 1`` (``ids``): the same on every rank, under any layout and after a resume,
which starts again at the checkpoint's step. A rank builds only the rows of each wide column that its
modules read (``hetero.data.rank_batches``). The held-out batches are the split once, in stored order.
"""

from __future__ import annotations

import copy
import hashlib

import torch

from hetero.data.rank_batches import Reads, rank_columns
from hetero.kinds.batch_rows import IGNORE_INDEX


def _epoch_seed(seed: int, epoch: int) -> int:
    # A hash rather than seed * K + epoch, which would give some distinct (seed, epoch) pairs one seed.
    digest = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class SampleTable:
    """``batch(step, reads)`` and ``ordered_batches(reads)`` of one split's ``columns``. A subclass may
    make a wide column per batch rather than keep it (``assembled``, made by ``values``)."""

    assembled: tuple[str, ...] = ()

    def __init__(self, columns: dict[str, torch.Tensor], split: str, global_batch_size: int, seed: int = 0):
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size={global_batch_size} must be at least 1")
        self.split, self.seed, self.global_batch_size = split, seed, global_batch_size
        self._data = columns
        self._label_counts: torch.Tensor | None = None

    def __len__(self) -> int:
        """Samples in the split."""
        return len(next(iter(self._data.values())))

    def column(self, key: str) -> torch.Tensor:
        """Every sample's ``key``, in stored order."""
        return self._data[key]

    def renamed(self, names: dict[str, str]) -> SampleTable:
        """This table with some columns under other names (the ones the graph's kinds read)."""
        table = copy.copy(self)
        table._data = {names.get(key, key): value for key, value in self._data.items()}
        return table

    def ids(self, step: int) -> torch.Tensor:
        """The sample ids of step ``step``'s batch: stream positions ``step·B ..``, across epochs."""
        start, count, parts = step * self.global_batch_size, self.global_batch_size, []
        while count > 0:
            epoch, offset = divmod(start, len(self))
            take = min(count, len(self) - offset)
            order = torch.randperm(len(self), generator=torch.Generator().manual_seed(_epoch_seed(self.seed, epoch)))
            parts.append(order[offset : offset + take])
            start, count = start + take, count - take
        return torch.cat(parts)

    def batch(self, step: int, reads: Reads | None = None) -> dict[str, torch.Tensor]:
        """The batch of training step ``step`` (0-based), as rank ``reads`` holds it (None: whole)."""
        return self.samples(self.ids(step), reads)

    def ordered_batches(self, reads: Reads | None = None) -> list[dict[str, torch.Tensor]]:
        """The whole split once in stored order, ``global_batch_size`` rows a batch (the last may be less)."""
        return [self.samples(ids, reads) for ids in torch.arange(len(self), device="cpu").split(self.global_batch_size)]

    def samples(self, ids: torch.Tensor, reads: Reads | None = None) -> dict[str, torch.Tensor]:
        """A batch of samples ``ids``, one a row."""
        wide = [key for key, value in self._data.items() if value.dim() >= 2] + list(self.assembled)
        bookkeeping = {key: value[ids] for key, value in self._data.items() if key not in wide}
        if reads is not None and "labels" in self._data:
            bookkeeping["label_counts"] = self.label_counts()[ids]
        return rank_columns(bookkeeping, wide, lambda key, rows: self.values(key, ids[rows]), reads)

    def label_counts(self) -> torch.Tensor:
        """Each sample's labels that carry a loss (counted once)."""
        if self._label_counts is None:
            self._label_counts = (self._data["labels"] != IGNORE_INDEX).sum(1)
        return self._label_counts

    def values(self, key: str, ids: torch.Tensor) -> torch.Tensor:
        """Column ``key`` of samples ``ids``."""
        return self._data[key][ids]
