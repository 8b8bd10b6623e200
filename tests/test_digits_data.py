"""Captioned digits as webdataset shards: real tar files, the split, the sequence format, determinism,
resume, DP slicing, and failures that must be loud (corrupt shards, interrupted writes)."""

import argparse
import shutil
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from sklearn.datasets import load_digits

from hetero.data import digits
from hetero.data.digits import (
    IGNORE_INDEX,
    IMAGE_TOKEN,
    MAX_CAPTION_BYTES,
    PAD_TOKEN,
    DigitBatches,
    ensure_digit_shards,
    vlm_sequence,
    write_digit_shards,
)
from hetero.data.shards import MANIFEST, ShardError, load_manifest, read_split, write_shard_set
from hetero.data.text import decode
from hetero.parallel.sharding import dp_rows

NUM_IMAGE_TOKENS, SEQ_LEN = 16, 48


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "digits"
    write_digit_shards(out, samples_per_shard=256)
    return out


@pytest.fixture(scope="module")
def samples(shard_dir) -> dict[str, list[dict]]:
    return {split: read_split(shard_dir, split) for split in digits.SPLITS}


def heldout_batches(shard_dir, batch_size=16, seed=0) -> DigitBatches:
    return DigitBatches(shard_dir, "heldout", batch_size, NUM_IMAGE_TOKENS, SEQ_LEN, seed)


def test_shards_are_real_tar_files_that_match_the_manifest(shard_dir):
    manifest = load_manifest(shard_dir)
    files = sorted(p.name for p in shard_dir.iterdir())
    listed = [shard["file"] for split in manifest["splits"].values() for shard in split["shards"]]
    assert files == sorted([MANIFEST, *listed])
    assert [s["count"] for s in manifest["splits"]["train"]["shards"]] == [256] * 6 + [85]
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            with tarfile.open(shard_dir / shard["file"]) as tar:
                names = tar.getnames()
            keys = Counter(name.split(".")[0] for name in names)
            assert len(keys) == shard["count"] and set(keys.values()) == {4}
            assert {name.split(".", 1)[1] for name in names} == {"cls", "json", "npy", "txt"}
    # Plain webdataset, as any other reader would use it.
    urls = [str(shard_dir / shard["file"]) for shard in manifest["splits"]["heldout"]["shards"]]
    first = next(iter(wds.WebDataset(urls, shardshuffle=False).decode()))
    assert first["npy"].shape == (1, 32, 32) and first["npy"].dtype == np.float32
    assert isinstance(first["txt"], str) and isinstance(first["cls"], int)


def test_splits_are_disjoint_balanced_and_hold_the_real_images(samples):
    source = load_digits()
    train = [s["json"]["index"] for s in samples["train"]]
    heldout = [s["json"]["index"] for s in samples["heldout"]]
    assert (len(train), len(heldout)) == (1621, 176)
    assert sorted(train + heldout) == list(range(1797))
    assert heldout == np.flatnonzero(digits.heldout_mask(source.target)).tolist()
    assert set(Counter(s["cls"] for s in samples["heldout"]).values()) == {17, 18}
    for sample in samples["train"][::97] + samples["heldout"][::17]:
        index, image = sample["json"]["index"], torch.from_numpy(sample["npy"])
        assert sample["cls"] == source.target[index]
        assert 0.0 <= image.min() and image.max() <= 1.0
        assert torch.equal(image[0, ::4, ::4] * 16, torch.from_numpy(source.images[index]).float())
        assert torch.equal(image[0], image[0, ::4, ::4].repeat_interleave(4, 0).repeat_interleave(4, 1))


def test_captions_name_the_digit_once_at_the_recorded_offset(samples):
    everything = samples["train"] + samples["heldout"]
    for sample in everything:
        text, offset = sample["txt"], sample["json"]["digit_offset"]
        assert text[offset] == str(sample["cls"])
        assert sum(ch.isdigit() for ch in text) == 1
        assert text.isascii() and "\0" not in text
    assert max(len(s["txt"]) for s in everything) == MAX_CAPTION_BYTES
    assert len({s["txt"].replace(str(s["cls"]), "#") for s in everything}) == len(digits.CAPTION_TEMPLATES)


def test_sequence_format_exactly():
    tokens, labels, position = vlm_sequence("the digit 7.", 10, num_image_tokens=3, seq_len=18)
    caption = list(b"the digit 7.")
    assert tokens.tolist() == [IMAGE_TOKEN] * 3 + caption + [PAD_TOKEN] * 3
    assert labels.tolist() == [IGNORE_INDEX] * 3 + caption[1:] + [IGNORE_INDEX] * 4
    assert position == 12 and labels[position] == ord("7") and tokens[position] == ord(" ")
    with pytest.raises(ValueError, match="seq_len=14"):
        vlm_sequence("the digit 7.", 10, num_image_tokens=3, seq_len=14)


def test_batches_follow_the_sequence_format(shard_dir):
    batch = heldout_batches(shard_dir, batch_size=24).batch(3)
    assert batch["images"].shape == (24, 1, 32, 32) and batch["images"].dtype == torch.float32
    assert batch["tokens"].shape == batch["labels"].shape == (24, SEQ_LEN)
    assert all(batch[k].dtype == torch.long for k in ("tokens", "labels", "digit_position", "label"))
    rows = torch.arange(24)
    assert torch.equal(batch["labels"][rows, batch["digit_position"]], ord("0") + batch["label"])
    assert (batch["tokens"][:, :NUM_IMAGE_TOKENS] == IMAGE_TOKEN).all()
    assert (batch["labels"][:, :NUM_IMAGE_TOKENS] == IGNORE_INDEX).all()
    for tokens, labels in zip(batch["tokens"], batch["labels"]):
        caption = tokens[NUM_IMAGE_TOKENS:][tokens[NUM_IMAGE_TOKENS:] != PAD_TOKEN]
        assert decode(caption).endswith(".")
        assert (tokens[NUM_IMAGE_TOKENS + len(caption) :] == PAD_TOKEN).all()
        assert torch.equal(labels[labels != IGNORE_INDEX], caption[1:])
    with pytest.raises(ValueError, match="seq_len must be at least num_image_tokens"):
        DigitBatches(shard_dir, "heldout", 8, num_image_tokens=64, seq_len=80)


def test_same_step_same_batch_and_epochs_reshuffle(shard_dir):
    a, b = heldout_batches(shard_dir, seed=3), heldout_batches(shard_dir, seed=3)
    for step in (0, 1, 10, 11, 25):  # 176 samples, 16 a batch: steps 11 and 22+ are in later epochs
        assert all(torch.equal(a.batch(step)[k], b.batch(step)[k]) for k in a.batch(step))
    assert not torch.equal(heldout_batches(shard_dir, seed=4).batch(0)["index"], a.batch(0)["index"])
    epochs = torch.cat([a.batch(step)["index"] for step in range(22)]).view(2, 176)
    split = sorted(torch.cat([batch["index"] for batch in a.ordered_batches()]).tolist())
    assert all(sorted(epoch.tolist()) == split for epoch in epochs)
    assert not torch.equal(epochs[0], epochs[1])
    # A batch that spans two epochs: the end of epoch 0, then the start of epoch 1.
    big = heldout_batches(shard_dir, batch_size=100, seed=3)
    assert torch.equal(big.batch(1)["index"], torch.cat([epochs[0][100:], epochs[1][:24]]))


def test_ordered_batches_cover_the_split_once_in_stored_order(shard_dir, samples):
    batches = heldout_batches(shard_dir, batch_size=50).ordered_batches()
    assert [len(b["label"]) for b in batches] == [50, 50, 50, 26]
    stored = [s["json"]["index"] for s in samples["heldout"]]
    assert torch.cat([b["index"] for b in batches]).tolist() == stored


def test_dp_rows_cover_the_batch_once_earlier_ranks_taking_the_extra_row():
    for size in (1, 3, 7, 16):
        for dp in (1, 2, 3, 4):
            parts = [dp_rows(size, rank, dp) for rank in range(dp)]
            sizes = [part.stop - part.start for part in parts]
            assert parts[0].start == 0 and parts[-1].stop == size and sizes == sorted(sizes, reverse=True)
            assert all(a.stop == b.start for a, b in zip(parts, parts[1:])) and max(sizes) - min(sizes) <= 1
    assert [dp_rows(7, rank, 3) for rank in range(3)] == [slice(0, 3), slice(3, 5), slice(5, 7)]
    with pytest.raises(ValueError, match="dp_rank=4"):
        dp_rows(4, 4, 4)


def test_reads_the_whole_split_under_torchrun_environment(shard_dir, monkeypatch):
    # webdataset's default node splitter refuses (or splits by global rank) once RANK/WORLD_SIZE are set.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert len(read_split(shard_dir, "heldout")) == 176


def copy_heldout_set(shard_dir: Path, dest: Path) -> Path:
    dest.mkdir()
    shutil.copy(shard_dir / MANIFEST, dest)
    shutil.copy(shard_dir / "heldout-000000.tar", dest)
    return dest / "heldout-000000.tar"


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_corrupt_shard_raises_an_error_naming_the_file(shard_dir, tmp_path, damage):
    shard = copy_heldout_set(shard_dir, tmp_path / "copy")
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(data)
    else:
        shard.unlink()
    with pytest.raises(ShardError, match=str(shard)):
        heldout_batches(tmp_path / "copy")


def test_skip_policy_leaves_a_corrupt_shard_out_with_a_warning(shard_dir, tmp_path):
    """``train.bad_shards=skip``: the other shards' samples, in order; a warning names the bad file."""
    dest = tmp_path / "copy"
    shutil.copytree(shard_dir, dest)
    bad = dest / "train-000002.tar"
    bad.write_bytes(bad.read_bytes()[:1000])
    with pytest.warns(UserWarning, match=rf"shard {bad} is truncated or corrupt.*skipped .*256 samples are left out"):
        kept = read_split(dest, "train", bad_shards="skip")
    everything = read_split(shard_dir, "train")
    assert [s["json"]["index"] for s in kept] == [s["json"]["index"] for s in everything[:512] + everything[768:]]
    with pytest.raises(ShardError, match=str(bad)):
        read_split(dest, "train")


def test_a_directory_without_manifest_is_not_a_shard_set(shard_dir, tmp_path):
    copy_heldout_set(shard_dir, tmp_path / "copy")
    (tmp_path / "copy" / MANIFEST).unlink()
    with pytest.raises(ShardError, match="not a complete shard set"):
        read_split(tmp_path / "copy", "heldout")


def fail_on_write(monkeypatch, after: int) -> None:
    """Make ShardWriter raise on its ``after``-th sample, as an interrupted job would stop."""
    original, calls = wds.ShardWriter.write, Counter()

    def write(self, obj):
        calls["n"] += 1
        if calls["n"] == after:
            raise KeyboardInterrupt("simulated interruption")
        return original(self, obj)

    monkeypatch.setattr(wds.ShardWriter, "write", write)


def test_interrupted_write_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    fail_on_write(monkeypatch, after=300)  # after the first shard is finished, inside the second
    with pytest.raises(KeyboardInterrupt):
        write_digit_shards(tmp_path / "digits", samples_per_shard=256)
    assert list(tmp_path.iterdir()) == []  # no target, no half-written staging directory
    with pytest.raises(ShardError, match="not a complete shard set"):
        load_manifest(tmp_path / "digits")


def test_interrupted_overwrite_keeps_the_old_set(tmp_path, monkeypatch):
    def records(text: str, count: int) -> list[dict]:
        return [{"__key__": f"{i:03d}", "txt": text, "cls": i} for i in range(count)]

    out = tmp_path / "set"
    write_shard_set(out, {"train": records("old", 5)}, samples_per_shard=2)
    with monkeypatch.context() as patch:
        fail_on_write(patch, after=4)
        with pytest.raises(KeyboardInterrupt):
            write_shard_set(out, {"train": records("new", 6)}, samples_per_shard=2, overwrite=True)
    assert [s["txt"] for s in read_split(out, "train")] == ["old"] * 5
    with pytest.raises(FileExistsError, match="not empty"):
        write_shard_set(out, {"train": records("new", 6)}, samples_per_shard=2)
    write_shard_set(out, {"train": records("new", 6)}, samples_per_shard=2, overwrite=True)
    assert [s["txt"] for s in read_split(out, "train")] == ["new"] * 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set"]


def test_ensure_reuses_a_complete_set_and_refuses_a_different_one(shard_dir):
    before = {p.name: p.stat().st_mtime_ns for p in shard_dir.iterdir()}
    assert ensure_digit_shards(shard_dir) == load_manifest(shard_dir)
    assert {p.name: p.stat().st_mtime_ns for p in shard_dir.iterdir()} == before
    with pytest.raises(ShardError, match="samples_per_shard=256 \\(wanted 100\\)"):
        ensure_digit_shards(shard_dir, samples_per_shard=100)


def test_command_line(shard_dir, capsys):
    assert digits.main(["--out", str(shard_dir)]) == 0
    assert "heldout 176 samples in 1 shards" in capsys.readouterr().out
    assert digits.main(["--out", str(shard_dir), "--samples-per-shard", "100"]) == 2
    assert "different shard set" in capsys.readouterr().err
    parser = argparse.ArgumentParser(prog="hetero data")
    digits.add_parser(parser.add_subparsers(dest="dataset", required=True))
    args = parser.parse_args(["digits", "--out", str(shard_dir)])
    args.run(args)
    assert "train 1621 samples in 7 shards" in capsys.readouterr().out
