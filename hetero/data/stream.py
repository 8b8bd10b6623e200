"""A split of a shard set streamed: shards in a shuffled order, a shuffle buffer, and a position that any
layout resumes from.

Epoch ``e`` reads the split's shards in an order drawn from ``(seed, e)``, each shard's samples in file
order, through a buffer of ``buffer`` samples: once full, each sample read replaces one drawn at random
(from ``(seed, e)`` too), which is served; at the end of the epoch the buffer drains in random order. So
an epoch serves every sample of the split exactly once, and epochs follow each other as one stream of
global batches (a batch may span two).

The order depends only on the seed, the buffer and the manifest's sample counts, never on the data or
on any module's layout: it is computed from the counts alone (``epoch_order``), and a batch reads just
the shards its samples sit in (``cache_shards`` of them decoded at a time). The position in the stream
is the step (``batch(step)``: samples ``step·B .. step·B + B - 1``), which the checkpoint carries; a
resume under other DP degrees (or any other layout) serves the same global batches: every rank decodes the
whole global batch and keeps the rows its modules read. Each sample's id is its index in the
split (shards in manifest order), in the batch as ``index``.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hetero.data.rank_batches import Reads, compact
from hetero.data.shards import read_shard, load_manifest


def _seed(seed: int, epoch: int, what: int) -> int:
    return (seed * 1_000_003 + epoch * 7919 + what) % (2**63)


class ShardStream:
    """``batch(step)``: the global batch at stream position ``step * global_batch_size``, its samples turned
    into columns by ``columns(samples)`` (a list of decoded webdataset samples, each with ``_id``)."""

    def __init__(self, shard_dir: str | os.PathLike, split: str, global_batch_size: int,
                 columns: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]], *, seed: int = 0,
                 buffer: int = 256, cache_shards: int = 8):
        if global_batch_size < 1 or buffer < 1:
            raise ValueError(f"global_batch_size={global_batch_size} and buffer={buffer} must be >= 1")
        self.shard_dir, self.split, self.global_batch_size = Path(shard_dir), split, global_batch_size
        self.columns, self.seed, self.buffer, self.cache_shards = columns, seed, buffer, cache_shards
        self.entries = load_manifest(shard_dir)["splits"][split]["shards"]
        self.counts = torch.tensor([e["count"] for e in self.entries])
        self.first_id = self.counts.cumsum(0) - self.counts  # each shard's first sample id
        self._orders: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._decoded: OrderedDict[int, list[dict[str, Any]]] = OrderedDict()

    def __len__(self) -> int:
        return int(self.counts.sum())

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The sample ids epoch ``epoch`` serves, in order."""
        if epoch not in self._orders:
            shards = torch.randperm(len(self.entries), generator=torch.Generator().manual_seed(_seed(self.seed, epoch, 1)))
            draw = torch.Generator().manual_seed(_seed(self.seed, epoch, 2))
            held: list[int] = []
            order: list[int] = []
            for shard in shards.tolist():
                first = int(self.first_id[shard])
                for sample in range(first, first + int(self.counts[shard])):
                    if len(held) < self.buffer:
                        held.append(sample)
                        continue
                    j = int(torch.randint(self.buffer, (), generator=draw))
                    order.append(held[j])
                    held[j] = sample
            order += [held[j] for j in torch.randperm(len(held), generator=draw).tolist()]
            self._orders[epoch] = torch.tensor(order, dtype=torch.long)
            while len(self._orders) > 2:
                self._orders.popitem(last=False)
        return self._orders[epoch]

    def ids(self, step: int) -> torch.Tensor:
        """The sample ids of step ``step``'s global batch."""
        start, parts, count = step * self.global_batch_size, [], self.global_batch_size
        while count:
            epoch, offset = divmod(start, len(self))
            take = min(count, len(self) - offset)
            parts.append(self.epoch_order(epoch)[offset : offset + take])
            start, count = start + take, count - take
        return torch.cat(parts)

    def batch(self, step: int, reads: Reads | None = None) -> dict[str, torch.Tensor]:
        return compact(self.columns([self._sample(int(i)) for i in self.ids(step)]), reads)

    def _sample(self, sample_id: int) -> dict[str, Any]:
        shard = int(torch.searchsorted(self.first_id, sample_id, right=True)) - 1
        if shard not in self._decoded:
            entry = self.entries[shard]
            self._decoded[shard] = read_shard(self.shard_dir / entry["file"], entry)
            while len(self._decoded) > self.cache_shards:
                self._decoded.popitem(last=False)
        self._decoded.move_to_end(shard)
        return self._decoded[shard][sample_id - int(self.first_id[shard])] | {"_id": sample_id}
