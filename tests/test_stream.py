"""Streamed shards (``hetero.data.stream``): real webdataset shards read through a shuffle buffer; every
epoch a permutation of the split, batches spanning epochs, the same batch from a fresh reader at any
step (what a resume does), and only a bounded number of shards decoded at a time. (The job on streamed
shards, resumed under other DP degrees and back, training on the very sample ids of the uninterrupted run,
is checked in test_checkpoint_resume.py.)"""

import torch

from hetero.data.shards import write_shard_set
from hetero.data.stream import ShardStream


def columns(samples):
    return {"index": torch.tensor([s["cls"] for s in samples]), "stream_id": torch.tensor([s["_id"] for s in samples])}


def shard_set(path, samples=120, per_shard=10):
    write_shard_set(path, {"train": [{"__key__": f"{i:05d}", "cls": i} for i in range(samples)]}, per_shard)
    return path


def test_an_epoch_serves_every_sample_once_through_the_buffer(tmp_path):
    stream = ShardStream(shard_set(tmp_path / "s"), "train", 16, columns, seed=3, buffer=24, cache_shards=4)
    first, second = stream.epoch_order(0), stream.epoch_order(1)
    assert sorted(first.tolist()) == list(range(120)) == sorted(second.tolist())
    assert not torch.equal(first, second)
    # the buffer mixes shards: consecutive samples come from other shards, not shard runs in file order
    assert int(((first[1:] - first[:-1]) == 1).sum()) < 30
    batches = [stream.batch(step) for step in range(15)]  # 240 samples: two epochs exactly
    served = torch.cat([b["index"] for b in batches])
    assert torch.equal(served, torch.cat([first, second]))
    assert torch.equal(batches[7]["index"], torch.cat([first[112:], second[:8]]))  # a batch across epochs
    assert torch.equal(batches[3]["index"], batches[3]["stream_id"])  # the samples read are the ones named
    assert len(stream._decoded) <= 4


def test_a_fresh_reader_serves_the_same_batch_at_any_step(tmp_path):
    path = shard_set(tmp_path / "s")
    straight = ShardStream(path, "train", 12, columns, seed=1, buffer=32)
    later = ShardStream(path, "train", 12, columns, seed=1, buffer=32)
    for step in (9, 4, 17):
        assert torch.equal(later.batch(step)["index"], straight.batch(step)["index"])
    other_seed = ShardStream(path, "train", 12, columns, seed=2, buffer=32)
    assert not torch.equal(other_seed.batch(0)["index"], straight.batch(0)["index"])
