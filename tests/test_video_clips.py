"""Revisiting video clips: the layout, that the revisit is predictable from A and not from the gap, the
split, determinism, shards and batches, and failures that must be loud (corrupt shards, bad options)."""

import json
import shutil
import socket
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from hetero.data import video_clips
from hetero.data.digits import heldout_mask
from hetero.data.shards import MANIFEST, ShardError, load_manifest, read_split
from hetero.data.video_clips import (
    ClipOptions,
    VideoClips,
    digit_indices,
    digit_position,
    ensure_video_shards,
    make_clips,
    render_frame,
    revisit_is_nearest_to_a,
    textures,
    write_video_shards,
)

SMALL = ClipOptions(frames=12, size=16, gap=5, a_len=4)  # for shards: 4 of A, 3 + 2 of the gap, 3 of A
COUNTS = {"train": 10, "heldout": 7}


@pytest.fixture(scope="module")
def clips() -> dict[str, list[dict]]:
    return {split: make_clips(24, seed=0, split=split) for split in video_clips.SPLITS}


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "clips"
    write_video_shards(out, COUNTS["train"], COUNTS["heldout"], SMALL, seed=0, samples_per_shard=4)
    return out


def every_clip(clips):
    return clips["train"] + clips["heldout"]


def test_textures_load_from_the_wheel_without_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("textures() tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    textures.cache_clear()
    loaded = textures()
    assert list(loaded) == list(video_clips.TEXTURES)
    for name, texture in loaded.items():
        assert texture.dtype == np.float32 and texture.ndim == 2, name
        assert texture.min() == 0.0 and texture.max() == 1.0, name
    assert loaded["brick"].shape == (128, 128) and loaded["text"].shape == (43, 112)


def test_clips_have_the_documented_layout_shapes_and_range(clips):
    for clip in every_clip(clips):
        frames = clip["frames"]
        assert frames.shape == (32, 1, 16, 16) and frames.dtype == np.float32
        assert 0.0 <= frames.min() and frames.max() <= 1.0
        assert clip["revisit"].dtype == bool and clip["scene"].dtype == np.int64
        assert clip["revisit"].tolist() == [False] * 24 + [True] * 8
        assert clip["scene"].tolist() == [0] * 8 + [1] * 8 + [2] * 8 + [0] * 8
        assert clip["time"].tolist() == list(range(32))  # "continue": the scene clock never stops
        assert [(s["scene"], s["start"], s["length"]) for s in clip["segments"]] == [
            (0, 0, 8),
            (1, 8, 8),
            (2, 16, 8),
            (0, 24, 8),
        ]
        assert len(clip["scenes"]) == 3
    # An uneven gap: earlier gap scenes take the extra frames.
    uneven = make_clips(1, frames=20, gap=11, a_len=5, gap_scenes=3)[0]
    assert uneven["scene"].tolist() == [0] * 5 + [1] * 4 + [2] * 4 + [3] * 3 + [0] * 4
    assert uneven["revisit"].tolist() == [False] * 16 + [True] * 4


def test_every_frame_is_its_scene_at_its_time_and_the_digit_moves(clips):
    for clip in every_clip(clips):
        for t, (scene, time) in enumerate(zip(clip["scene"], clip["time"])):
            assert np.array_equal(clip["frames"][t, 0], render_frame(clip["scenes"][scene], time, 16, 10))
        positions = [digit_position(clip["scenes"][0], t, 16, 10) for t in range(32)]
        assert all(0 <= y <= 6 and 0 <= x <= 6 for y, x in positions)
        assert len(set(positions[:8])) > 1  # A's digit moves within A
        # The digit is drawn: its box differs from the bare texture crop.
        scene = clip["scenes"][0]
        y0, x0 = scene["offset"]
        bare = video_clips.BACKGROUND_GAIN * textures()[scene["texture"]][y0 : y0 + 16, x0 : x0 + 16]
        y, x = positions[0]
        assert (clip["frames"][0, 0, y : y + 10, x : x + 10] - bare[y : y + 10, x : x + 10]).max() > 0.2


def test_digit_bounces_off_the_edges():
    scene = {"start": [5.0, 0.0], "velocity": [1.0, -0.5]}
    assert [digit_position(scene, t, 16, 10) for t in range(9)] == [
        (5, 0),
        (6, 1),
        (5, 1),
        (4, 2),
        (3, 2),
        (2, 3),
        (1, 3),
        (0, 4),
        (1, 4),
    ]


def test_revisit_is_scene_a_and_no_gap_scene(clips):
    for clip in every_clip(clips):
        a, gap = clip["scenes"][0], clip["scenes"][1:]
        assert (clip["scene"][clip["revisit"]] == clip["scene"][0]).all()
        assert set(clip["scene"][8:24].tolist()).isdisjoint({0})
        assert len({s["texture"] for s in clip["scenes"]}) == len({s["label"] for s in clip["scenes"]}) == 3
        assert all(s["texture"] != a["texture"] and s["digit_index"] != a["digit_index"] for s in gap)
        # Outside the digit's box, a revisit frame is A's background to the bit.
        first = clip["frames"][24, 0]
        box = np.zeros((16, 16), dtype=bool)
        for t in (0, 24):
            y, x = digit_position(a, t, 16, 10)
            box[y : y + 10, x : x + 10] = True
        assert np.array_equal(first[~box], clip["frames"][0, 0][~box])


def test_first_revisit_frame_is_nearer_to_a_than_to_every_gap_frame(clips):
    for clip in every_clip(clips):
        frames = clip["frames"][:, 0]
        errors = ((frames - frames[24]) ** 2).mean(axis=(1, 2))
        assert errors[:8].min() < errors[8:24].min()
        assert revisit_is_nearest_to_a(clip["frames"], clip["scene"], clip["revisit"])
    # The check itself: a revisit that copies a gap frame fails it.
    clip = clips["train"][0]
    spoiled = clip["frames"].copy()
    spoiled[24] = spoiled[12]
    assert not revisit_is_nearest_to_a(spoiled, clip["scene"], clip["revisit"])


def test_restart_replays_a_and_continue_does_not():
    restart = make_clips(3, frames=20, gap=6, a_len=8, revisit_motion="restart")
    cont = make_clips(3, frames=20, gap=6, a_len=8)
    for r, c in zip(restart, cont):
        assert np.array_equal(r["frames"][14:], r["frames"][:6])
        assert r["time"].tolist() == list(range(14)) + list(range(6))
        assert np.array_equal(r["frames"][:14], c["frames"][:14])  # the same draw up to the revisit
    assert not all(np.array_equal(c["frames"][14:], c["frames"][:6]) for c in cont)


def test_same_seed_same_bytes_and_another_seed_differs():
    first, again = make_clips(4, seed=7), make_clips(4, seed=7)
    for a, b in zip(first, again):
        assert a["frames"].tobytes() == b["frames"].tobytes() and a["scenes"] == b["scenes"]
    assert all(a["frames"].tobytes() == b["frames"].tobytes() for a, b in zip(make_clips(2, seed=7), first))
    other = make_clips(4, seed=8)
    assert all(a["frames"].tobytes() != b["frames"].tobytes() for a, b in zip(first, other))
    heldout = make_clips(4, seed=7, split="heldout")
    assert all(a["frames"].tobytes() != b["frames"].tobytes() for a, b in zip(first, heldout))


def test_splits_use_disjoint_digit_images_and_texture_halves(clips):
    digits = load_digits()
    held = set(np.flatnonzero(heldout_mask(digits.target)).tolist())
    assert set(digit_indices("heldout").tolist()) == held
    assert set(digit_indices("train").tolist()) == set(range(1797)) - held
    used = {split: {s["digit_index"] for c in clips[split] for s in c["scenes"]} for split in clips}
    assert used["heldout"] <= held and used["train"].isdisjoint(held) and len(used["train"]) > 50
    for split, group in clips.items():
        for scene in (s for c in group for s in c["scenes"]):
            assert scene["label"] == digits.target[scene["digit_index"]]
            half = textures()[scene["texture"]].shape[1] // 2
            x = scene["offset"][1]
            assert x + 16 <= half if split == "train" else x >= half
    assert Counter(s["texture"] for c in clips["train"] for s in c["scenes"]).keys() == set(
        video_clips.TEXTURES
    )


@pytest.mark.parametrize(
    "options, message",
    [
        ({"frames": 24, "gap": 16, "a_len": 8}, "leaves no revisit"),
        ({"gap_scenes": 6}, "gap_scenes=6"),
        ({"gap": 2, "frames": 12, "gap_scenes": 3}, "gap_scenes=3"),
        ({"digit_size": 16}, "digit_size=16"),
        ({"size": 44}, "size=44"),
        ({"revisit_motion": "rewind"}, "revisit_motion='rewind'"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        make_clips(1, **options)


def test_unknown_split_is_refused():
    with pytest.raises(ValueError, match="split='test'"):
        make_clips(1, split="test")


def test_shards_round_trip_and_match_the_manifest(shard_dir):
    manifest = load_manifest(shard_dir)
    assert manifest["meta"]["frames"] == 12 and manifest["meta"]["digit_size"] == 10
    assert [s["count"] for s in manifest["splits"]["train"]["shards"]] == [4, 4, 2]
    with tarfile.open(shard_dir / "heldout-000000.tar") as tar:
        assert {name.split(".", 1)[1] for name in tar.getnames()} == {
            "npy",
            "revisit.npy",
            "scene.npy",
            "json",
        }
    for split, count in COUNTS.items():
        stored = read_split(shard_dir, split)
        made = [video_clips.make_clip(i, SMALL, 0, split) for i in range(count)]
        assert len(stored) == count
        for sample, clip in zip(stored, made):
            assert sample["npy"].tobytes() == clip["frames"].tobytes()
            assert np.array_equal(sample["revisit.npy"], clip["revisit"])
            assert np.array_equal(sample["scene.npy"], clip["scene"])
            assert sample["json"] == json.loads(
                json.dumps(
                    {**{k: clip[k] for k in ("index", "scenes", "segments")}, "time": clip["time"].tolist()}
                )
            )


def loader(shard_dir, split="train", batch_size=4, seed=0) -> VideoClips:
    return VideoClips(shard_dir, split, batch_size, seed)


def test_batches_have_the_documented_tensors(shard_dir):
    batch = loader(shard_dir, batch_size=3).batch(2)
    assert batch["frames"].shape == (3, 12, 1, 16, 16) and batch["frames"].dtype == torch.float32
    assert batch["revisit"].shape == batch["scene"].shape == (3, 12)
    assert batch["revisit"].dtype == torch.bool and batch["scene"].dtype == torch.long
    assert batch["index"].shape == (3,) and batch["index"].dtype == torch.long
    for row, index in enumerate(batch["index"].tolist()):
        clip = video_clips.make_clip(index, SMALL, 0, "train")
        assert torch.equal(batch["frames"][row], torch.from_numpy(clip["frames"]))
        assert batch["revisit"][row].tolist() == clip["revisit"].tolist()
        assert batch["scene"][row].tolist() == clip["scene"].tolist()


def test_same_step_same_batch_across_loaders_and_seeds_differ(shard_dir):
    a, b = loader(shard_dir, seed=3), loader(shard_dir, seed=3)
    for step in (0, 1, 2, 5):  # 10 clips, 4 a batch: step 2 spans two epochs
        assert all(torch.equal(a.batch(step)[k], b.batch(step)[k]) for k in a.batch(step))
    assert sorted(torch.cat([a.batch(s)["index"] for s in range(5)]).tolist()) == sorted(list(range(10)) * 2)
    orders = {tuple(loader(shard_dir, seed=seed).batch(0)["index"].tolist()) for seed in range(4)}
    assert len(orders) > 1


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_shard_is_detected_by_the_manifest(shard_dir, tmp_path, damage):
    copy = tmp_path / "copy"
    shutil.copytree(shard_dir, copy)
    shard = copy / "heldout-000001.tar"
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(data)
    else:
        shard.write_bytes(data[:-512])
    with pytest.raises(ShardError, match=str(shard)):
        loader(copy, "heldout")
    assert len(loader(copy, "train")) == 10  # the other split is intact


def test_ensure_reuses_a_complete_set_and_refuses_a_different_one(shard_dir):
    before = {p.name: p.stat().st_mtime_ns for p in shard_dir.iterdir()}
    args = (COUNTS["train"], COUNTS["heldout"], SMALL)
    assert ensure_video_shards(shard_dir, *args, samples_per_shard=4) == load_manifest(shard_dir)
    assert {p.name: p.stat().st_mtime_ns for p in shard_dir.iterdir()} == before
    with pytest.raises(ShardError, match="seed=0 \\(wanted 1\\)"):
        ensure_video_shards(shard_dir, *args, seed=1, samples_per_shard=4)
    with pytest.raises(ShardError, match="gap=5 \\(wanted 6\\)"):
        ensure_video_shards(shard_dir, *args[:2], ClipOptions(frames=12, gap=6, a_len=4), samples_per_shard=4)


def test_command_line(tmp_path, capsys):
    out = str(tmp_path / "cli")
    tiny = ["--train-count", "2", "--heldout-count", "1", "--frames", "6", "--gap", "2", "--a-len", "2"]
    assert video_clips.main(["--out", out, *tiny, "--revisit-motion", "restart"]) == 0
    assert "heldout 1 clips in 1 shards" in capsys.readouterr().out
    assert load_manifest(out)["meta"]["revisit_motion"] == "restart"
    assert sorted(p.name for p in Path(out).iterdir()) == sorted(
        [MANIFEST, "train-000000.tar", "heldout-000000.tar"]
    )
    assert video_clips.main(["--out", out, *tiny]) == 2
    assert "different shard set" in capsys.readouterr().err
    assert video_clips.main(["--out", str(tmp_path / "bad"), "--frames", "8"]) == 2
    assert "leaves no revisit" in capsys.readouterr().err
