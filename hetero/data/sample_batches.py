"""Global batches of samples from one source or a weighted mixture, in an order that depends only on
the seed.

Stream position ``p`` belongs to a source and to one of its samples. With one source, epoch ``e``
serves the source's samples in a permutation drawn from ``(seed, e)``. A mixture cuts the stream into
blocks where each source holds its quota (its weight out of ``QUOTA`` positions, at least one), in a
seeded order per block; each source's own positions then walk through its own epochs.

One sample per row: step ``s`` holds positions ``s·B .. s·B + B - 1``. Packed (``train.data.pack``):
the positions of each pass over the stream (as many as the samples) are laid into rows in order, a row
closing when the next sample does not fit, planned before any image is decoded; step ``s`` holds rows ``s·B .. s·B + B - 1`` of
the passes one after another. Lengths and bad samples come from each source's index
(``hetero.data.sample_index``), read once from the samples' text and their images' headers. Either way a batch is a function of ``(seed, step)``: the same on every
rank, under any layout, and after a resume.

A bad sample (``SampleError``) stops the job with its message (``on_error: error``), or is skipped and
counted once (``skip``: ``skipped``, reported as ``data/skipped``): its row is left empty, or packing
leaves it out. Once the skipped samples exceed ``max_skip_fraction`` of the split the job stops, naming
the last one. The held-out split is every held-out sample once, in order, the last batch filled with
empty rows. ``index`` numbers a row's sample (the sources' samples one after another), or, packed, the
row's place in the stream of rows.
"""

from __future__ import annotations

import functools
import hashlib

import torch

from hetero.data.collate import Document, SampleSkipped, Shaper
from hetero.data.sample_index import SampleIndex
from hetero.data.samples import SampleError, SampleSource

QUOTA = 100

Place = tuple[int, int]  # (source, sample index)


class DataError(RuntimeError):
    """Data that stops the job: a bad sample under ``on_error: error``, or too many skipped."""


def _seed(*parts: int) -> int:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class SampleBatches:
    def __init__(self, sources: list[SampleSource], indexes: list[SampleIndex], weights: list[float], shaper: Shaper,
                 split: str, global_batch_size: int, seed: int, on_error: str = "error",
                 max_skip_fraction: float = 0.01, pack: bool = False):
        self.sources, self.indexes, self.shaper, self.split, self.pack = sources, indexes, shaper, split, pack
        self.global_batch_size, self.seed = global_batch_size, seed
        self.on_error, self.max_skip_fraction = on_error, max_skip_fraction
        total = sum(weights)
        self.quotas = [max(1, round(QUOTA * w / total)) for w in weights]
        self.bad: dict[Place, str] = {}  # skipped samples, why
        self._lengths: dict[Place, int | None] = {}
        self._passes: dict[int, list[list[Place]]] = {}
        self._rows_before = [0]  # rows packed from the passes before pass k
        self._heldout: list[dict[str, torch.Tensor]] | None = None
        self._orders: dict[tuple[int, int], torch.Tensor] = {}
        self._first = [sum(len(source) for source in sources[:s]) for s in range(len(sources))]  # sample ids

    def __len__(self) -> int:
        return sum(len(s) for s in self.sources)

    @property
    def skipped(self) -> int:
        return len(self.bad)

    def _order(self, source: int, epoch: int) -> torch.Tensor:
        key = (source, epoch)
        if key not in self._orders:
            generator = torch.Generator().manual_seed(_seed(self.seed, source, epoch))
            self._orders[key] = torch.randperm(len(self.sources[source]), generator=generator)
            if len(self._orders) > 4 * len(self.sources):
                self._orders.pop(next(iter(self._orders)))
        return self._orders[key]

    def locate(self, position: int) -> Place:
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

    def _skip(self, place: Place, reason: str) -> None:
        if place in self.bad:
            return
        self.bad[place] = reason
        if len(self.bad) > self.max_skip_fraction * len(self):
            raise DataError(f"{len(self.bad)} samples of the {len(self)} in the {self.split} split were skipped, more "
                            f"than train.data.max_skip_fraction={self.max_skip_fraction}; the last: {reason}")

    def skip(self, skipped: dict[Place, str]) -> None:
        """Count samples skipped building batches elsewhere (a loader's workers, each on its own copy of
        this object) as skipped here: each once, the job stopping past ``max_skip_fraction``."""
        for place, reason in skipped.items():
            self._skip(place, reason)

    def _guarded(self, place: Place, work):
        """``work()`` on the sample at ``place``, or None when the sample is skipped."""
        try:
            return work()
        except SampleError as err:
            if self.on_error == "error":
                raise DataError(f"{err} (train.data.on_error=skip skips bad samples)") from None
            self._skip(place, str(err))
        except SampleSkipped as skipped:
            self._skip(place, f"{skipped}: longer than the LLM's seq_len (train.data.too_long=skip)")
        return None

    def _document(self, place: Place, planned: bool = False) -> Document:
        """The sample at ``place`` as a row's content: tokenized and its images decoded, or (``planned``)
        shaped from the index, to be tokenized and decoded only where read."""
        index = self.indexes[place[0]]
        if place in self.bad or place[1] in index.bad:
            self._length(place)  # the index's verdict: raised or counted, as packing would
            return self.shaper.empty()
        sample = functools.partial(self.sources[place[0]].sample, place[1])
        if planned:
            return self._guarded(place, lambda: self.shaper.planned(index, place[1], sample())) or self.shaper.empty()
        return self._guarded(place, lambda: self.shaper.document(sample())) or self.shaper.empty()

    def _length(self, place: Place) -> int | None:
        if place not in self._lengths:
            source, index = self.sources[place[0]], self.indexes[place[0]]
            self._lengths[place] = self._guarded(
                place, lambda: self.shaper.plan(index, place[1], lambda: source.sample(place[1]).where))
        return self._lengths[place]

    def _packed(self, places: list[Place]) -> list[list[Place]]:
        rows, row, used = [], [], 0
        for place in places:
            length = self._length(place)
            if length is None:
                continue
            if used + length > self.shaper.seq_len:
                rows.append(row)
                row, used = [], 0
            row.append(place)
            used += length
        return rows + ([row] if row else [])

    def _rows(self, step: int) -> list[list[Place]]:
        first, size = step * self.global_batch_size, self.global_batch_size
        if not self.pack:
            return [[self.locate(p)] for p in range(first, first + size)]
        while self._rows_before[-1] < first + size:
            k = len(self._rows_before) - 1
            self._passes[k] = self._packed([self.locate(p) for p in range(k * len(self), (k + 1) * len(self))])
            self._rows_before.append(self._rows_before[-1] + len(self._passes[k]))
        rows = []
        for row in range(first, first + size):
            k = next(k for k in range(len(self._rows_before) - 1) if row < self._rows_before[k + 1])
            rows.append(self._passes[k][row - self._rows_before[k]])
        for k in [k for k in self._passes if self._rows_before[k + 1] <= first]:
            del self._passes[k]  # passes behind this step are not read again
        return rows

    def _shaped(self, rows: list[list[Place]], index: torch.Tensor, reads) -> dict[str, torch.Tensor]:
        documents = [[self._document(place, planned=reads is not None) for place in row] for row in rows]
        documents += [[]] * (self.global_batch_size - len(documents))
        try:
            return self.shaper.batch(documents, index, self.pack, reads)
        except SampleError as err:  # read on this rank alone: the others cannot leave its row out
            raise DataError(f"{err} (found reading this rank's rows and images; the sample index passed it, so no "
                            f"rank skips it: fix or remove the sample)") from None

    def batch(self, step: int, reads=None) -> dict[str, torch.Tensor]:
        """Step ``step``'s global batch; ``reads`` (``hetero.runtime.rows.RankReads``): tokenize only the
        rows and decode only the images this rank's modules take (``Shaper.batch``)."""
        rows = self._rows(step)
        if self.pack:  # a packed row is new each pass: numbered by its place in the stream of rows
            index = step * self.global_batch_size + torch.arange(self.global_batch_size)
        else:
            index = torch.tensor([self._first[place[0]] + place[1] for (place,) in rows])
        return self._shaped(rows, index, reads)

    def ordered_batches(self, reads=None) -> list[dict[str, torch.Tensor]]:
        if self._heldout is None:  # read once: each evaluation sees (and skips) the same samples
            every = [(s, i) for s, source in enumerate(self.sources) for i in range(len(source))]
            rows = self._packed(every) if self.pack else [[place] for place in every]
            size = self.global_batch_size
            self._heldout = [self._shaped(rows[first : first + size], torch.arange(first, first + size), reads)
                             for first in range(0, len(rows), size)]
        return self._heldout
