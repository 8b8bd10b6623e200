"""Global batches of samples from one source or a weighted mixture, in an order that depends only on
the seed.

Stream position ``p`` (step ``s`` holds positions ``s·B .. s·B + B - 1``) belongs to a source and to one
of its samples. With one source, epoch ``e`` serves the source's samples in a permutation drawn from
``(seed, e)``. A mixture cuts the stream into blocks where each source holds its quota (its weight out
of ``QUOTA`` positions, at least one), in a seeded order per block; each source's own positions then
walk through its own epochs. Either way a batch is a function of ``(seed, step)``: the same on every
rank, under any layout, and after a resume.

A bad sample (``SampleError``) stops the job with its message (``on_error: error``), or leaves its row
empty and is counted (``skip``: ``skipped``, reported as ``data/skipped``); once the skipped samples
exceed ``max_skip_fraction`` of the split the job stops, naming the last one. The held-out split is
every held-out sample once, in order, the last batch filled with empty rows.
"""

from __future__ import annotations

import hashlib

import torch

from hetero.data.collate import SampleSkipped, Shaper
from hetero.data.samples import SampleError, SampleSource

QUOTA = 100


class DataError(RuntimeError):
    """Data that stops the job: a bad sample under ``on_error: error``, or too many skipped."""


def _seed(*parts: int) -> int:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class SampleBatches:
    def __init__(self, sources: list[SampleSource], weights: list[float], shaper: Shaper, split: str,
                 global_batch_size: int, seed: int, on_error: str = "error", max_skip_fraction: float = 0.01):
        self.sources, self.shaper, self.split = sources, shaper, split
        self.global_batch_size, self.seed = global_batch_size, seed
        self.on_error, self.max_skip_fraction = on_error, max_skip_fraction
        total = sum(weights)
        self.quotas = [max(1, round(QUOTA * w / total)) for w in weights]
        self.skipped = 0
        self._heldout: list[dict[str, torch.Tensor]] | None = None
        self._orders: dict[tuple[int, int], torch.Tensor] = {}

    def __len__(self) -> int:
        return sum(len(s) for s in self.sources)

    def _order(self, source: int, epoch: int) -> torch.Tensor:
        key = (source, epoch)
        if key not in self._orders:
            generator = torch.Generator().manual_seed(_seed(self.seed, source, epoch))
            self._orders[key] = torch.randperm(len(self.sources[source]), generator=generator)
            if len(self._orders) > 4 * len(self.sources):
                self._orders.pop(next(iter(self._orders)))
        return self._orders[key]

    def locate(self, position: int) -> tuple[int, int]:
        """(source, sample index) of stream position ``position``."""
        if len(self.sources) == 1:
            epoch, offset = divmod(position, len(self.sources[0]))
            return 0, int(self._order(0, epoch)[offset])
        block, within = divmod(position, sum(self.quotas))
        owners = torch.repeat_interleave(torch.arange(len(self.quotas)), torch.tensor(self.quotas))
        owners = owners[torch.randperm(len(owners), generator=torch.Generator().manual_seed(_seed(self.seed, -1, block)))]
        source = int(owners[within])
        count = block * self.quotas[source] + int((owners[:within] == source).sum())
        epoch, offset = divmod(count, len(self.sources[source]))
        return source, int(self._order(source, epoch)[offset])

    def _document(self, source: int, index: int):
        try:
            return self.shaper.document(self.sources[source].sample(index))
        except SampleError as err:
            if self.on_error == "error":
                raise DataError(f"{err} (train.data.on_error=skip skips bad samples)") from None
            reason = str(err)
        except SampleSkipped as skipped:
            reason = f"{skipped}: longer than the LLM's seq_len (train.data.too_long=skip)"
        self.skipped += 1
        if self.skipped > self.max_skip_fraction * len(self):
            raise DataError(f"{self.skipped} samples of the {len(self)} in the {self.split} split were skipped, more "
                            f"than train.data.max_skip_fraction={self.max_skip_fraction}; the last: {reason}")
        return self.shaper.empty()

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        positions = range(step * self.global_batch_size, (step + 1) * self.global_batch_size)
        documents = [self._document(*self.locate(p)) for p in positions]
        return self.shaper.batch(documents, torch.tensor(list(positions)))

    def ordered_batches(self) -> list[dict[str, torch.Tensor]]:
        if self._heldout is None:  # read once: each evaluation sees (and skips) the same samples
            self._heldout = self._ordered()
        return self._heldout

    def _ordered(self) -> list[dict[str, torch.Tensor]]:
        every = [(s, i) for s, source in enumerate(self.sources) for i in range(len(source))]
        batches = []
        for first in range(0, len(every), self.global_batch_size):
            chosen = every[first : first + self.global_batch_size]
            documents = [self._document(s, i) for s, i in chosen]
            documents += [self.shaper.empty()] * (self.global_batch_size - len(chosen))
            batches.append(self.shaper.batch(documents, torch.arange(first, first + self.global_batch_size)))
        return batches
