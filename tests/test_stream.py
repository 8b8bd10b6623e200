"""Streamed shards (``hetero.data.stream``): real webdataset shards read through a shuffle buffer; every
epoch a permutation of the split, batches spanning epochs, the same batch from a fresh reader at any
step (what a resume does), and only a bounded number of shards decoded at a time. Then the job: a run
saved at vision dp4 / LLM dp2 and resumed at vision dp2 / LLM dp1, and back, trains on the very sample
ids of the uninterrupted run, none missing or repeated."""

import json
import subprocess
import sys

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


COMMON = ["train.log_every=4", "train.eval_every=0", "train.eval_batches=1", "train.steps=12",
          "train.checkpoint.every=4", "train.checkpoint.keep=0", "train.stream_buffer=64", "train.sample_log=true", "train.wandb=disabled"]
WIDE = ["world_size=4", "vision.layout.dp=4", "vision.micro_batch_size=4", "llm.layout.tp=2", "llm.layout.dp=2",
        "batch.micro_batch_size=8"]
NARROW = ["world_size=2", "vision.layout.dp=2", "vision.micro_batch_size=8", "llm.layout.tp=2", "llm.layout.dp=1",
          "batch.micro_batch_size=16"]


def train(tmp_path, run, *overrides):
    paths = [f"train.data_dir={tmp_path / 'digits'}", f"train.run_dir={tmp_path / run}"]
    done = subprocess.run([sys.executable, "-m", "hetero.cli", "train", "colocated_vlm", *COMMON, *overrides, *paths],
                          capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = (tmp_path / run / "colocated_vlm" / "samples.jsonl").read_text().splitlines()
    return done.stdout, {row["step"]: row["ids"] for row in map(json.loads, lines)}


def test_a_resume_under_other_dp_degrees_trains_on_the_same_samples(tmp_path):
    _, straight = train(tmp_path, "straight", *WIDE)
    assert sorted(straight) == list(range(1, 13))
    consumed = [i for step in range(1, 13) for i in straight[step]]
    assert len(consumed) == len(set(consumed)) == 12 * 16  # less than an epoch: no sample twice
    checkpoints = tmp_path / "straight" / "colocated_vlm" / "checkpoints"
    out, narrow = train(tmp_path, "narrow", *NARROW, f"train.checkpoint.resume={checkpoints / 'step_000004'}")
    assert "weights and optimizer states were resharded" in out
    assert sorted(narrow) == list(range(5, 13)) and all(narrow[s] == straight[s] for s in narrow)
    back = tmp_path / "narrow" / "colocated_vlm" / "checkpoints" / "step_000008"
    out, wide = train(tmp_path, "wide", *WIDE, f"train.checkpoint.resume={back}")
    assert "weights and optimizer states were resharded" in out
    assert sorted(wide) == list(range(9, 13)) and all(wide[s] == straight[s] for s in wide)
