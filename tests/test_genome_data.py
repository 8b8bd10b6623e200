"""The genome windows: the real chromosome and its gene calls, the split, shards that round-trip exactly,
deterministic batches, and failures that must be loud (mismatched shard sets, bad options)."""

import re
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from hetero import cli
from hetero.data import genome
from hetero.data.genome import (
    BASES,
    REGIONS,
    GenomeOptions,
    GenomeWindows,
    coding_mask,
    encode,
    ensure_genome_shards,
    split_point,
    window_starts,
    write_genome_shards,
)
from hetero.data.shards import MANIFEST, ShardError, load_manifest, read_split

LENGTH = 2_463_666  # NZ_LN831026.1, Corynebacterium diphtheriae NCTC11397, complete chromosome
SMALL = GenomeOptions(window=4096, heldout_fraction=0.2)  # for shards: 481 train and 120 held-out windows


@pytest.fixture(scope="module")
def annotated():
    """The sequence, pyrodigal's genes and the coding mask. Genes are called once in this process:
    ``annotated_genome`` caches them, and ``write_genome_shards`` reuses them."""
    sequence = genome.load_genome()
    bases, mask, genes = genome.annotated_genome()
    assert np.array_equal(bases, encode(sequence)) and np.array_equal(mask, coding_mask(sequence, genes))
    return sequence, genes, mask


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory, annotated) -> Path:
    out = tmp_path_factory.mktemp("data") / "genome"
    write_genome_shards(out, SMALL, samples_per_shard=200)
    return out


def test_genome_loads_from_the_wheel_without_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("load_genome() tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    genome.genome_record.cache_clear()
    header, sequence = genome.genome_record()
    assert header.startswith("NZ_LN831026.1 Corynebacterium diphtheriae") and "chromosome" in header
    assert genome.load_genome() == sequence and len(sequence) == LENGTH
    assert set(sequence) == set("ACGT")
    gc = (sequence.count("G") + sequence.count("C")) / len(sequence)
    assert 0.53 < gc < 0.54  # C. diphtheriae's GC content


def test_encode_maps_the_alphabet():
    assert BASES == "ACGTN" and REGIONS == ("intergenic", "coding")
    codes = encode("ACGTacgtNRYx-")
    assert codes.dtype == np.uint8
    assert codes.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 4, 4, 4, 4]
    assert genome.decode(encode("GATTACAN")) == "GATTACAN"
    sequence = genome.load_genome()
    assert np.bincount(encode(sequence), minlength=5).tolist() == [sequence.count(b) for b in BASES]


def test_genes_and_coding_fraction_are_those_of_a_bacterium(annotated):
    sequence, genes, mask = annotated
    assert mask.dtype == np.uint8 and mask.shape == (LENGTH,) and set(np.unique(mask).tolist()) == {0, 1}
    assert 2000 < len(genes) < 3000
    assert 0.75 < mask.mean() < 0.97
    strands = {gene.strand for gene in genes}
    assert strands == {1, -1}
    for gene in list(genes)[:: len(genes) // 25]:  # 1-based inclusive: both ends coding, outside them maybe
        assert 1 <= gene.begin < gene.end <= LENGTH
        assert mask[gene.begin - 1 : gene.end].all()
        assert (gene.end - gene.begin + 1) % 3 == 0  # whole codons
        assert not (gene.partial_begin or gene.partial_end)  # closed ends
    covered = np.zeros(LENGTH, dtype=bool)
    for gene in genes:
        covered[gene.begin - 1 : gene.end] = True
    assert np.array_equal(covered, mask.astype(bool))


def test_windows_tile_each_side_of_the_split_point():
    options = GenomeOptions()
    split = split_point(LENGTH, options)
    assert split == LENGTH - int(LENGTH * 0.1) == 2_217_300
    starts = window_starts(LENGTH, options)
    train, held = starts["train"], starts["heldout"]
    assert len(train) == split // 512 == 4330 and len(held) == (LENGTH - split) // 512 == 481
    assert train[0] == 0 and np.all(np.diff(train) == 512) and train[-1] + 512 <= split
    assert held[0] == split and np.all(np.diff(held) == 512) and held[-1] + 512 <= LENGTH
    assert split - (train[-1] + 512) < 512 and LENGTH - (held[-1] + 512) < 512  # nothing else fits
    with pytest.raises(ValueError, match="window=300000 leaves the heldout split empty"):
        window_starts(LENGTH, GenomeOptions(window=300_000))


def test_shards_round_trip_and_the_manifest_describes_them(shard_dir, annotated):
    sequence, genes, mask = annotated
    bases = encode(sequence)
    meta = load_manifest(shard_dir)["meta"]
    split = split_point(LENGTH, SMALL)
    assert meta["accession"] == "GCF_001457455.1" and meta["length"] == LENGTH and meta["genes"] == len(genes)
    assert meta["window"] == 4096 and meta["heldout_fraction"] == 0.2 and meta["split_point"] == split
    starts = window_starts(LENGTH, SMALL)
    assert meta["windows"] == {"train": 481, "heldout": 120} == {k: len(v) for k, v in starts.items()}
    for name, found in starts.items():
        samples = read_split(shard_dir, name)
        assert [s["json"]["index"] for s in samples] == list(range(len(found)))
        assert [s["json"]["start"] for s in samples] == found.tolist()
        for sample in samples:
            start = sample["json"]["start"]
            assert sample["bases.npy"].dtype == sample["regions.npy"].dtype == np.uint8
            assert np.array_equal(sample["bases.npy"], bases[start : start + 4096])
            assert np.array_equal(sample["regions.npy"], mask[start : start + 4096])
            assert (start + 4096 <= split) if name == "train" else (start >= split)
        labels = np.concatenate([mask[s : s + 4096] for s in found])
        assert meta["coding_fraction"][name] == pytest.approx(labels.mean(), abs=1e-6)
        assert 0.75 < meta["coding_fraction"][name] < 0.97


def loader(shard_dir, split="train", batch_size=16, seed=0) -> GenomeWindows:
    return GenomeWindows(shard_dir, split, batch_size, seed)


def test_batches_hold_the_documented_tensors(shard_dir, annotated):
    sequence, _, mask = annotated
    bases = encode(sequence)
    batch = loader(shard_dir, batch_size=5).batch(3)
    assert set(batch) == {"bases", "regions", "index"}
    assert batch["bases"].shape == batch["regions"].shape == (5, 4096)
    assert batch["bases"].dtype == batch["regions"].dtype == batch["index"].dtype == torch.long
    for row, index in enumerate(batch["index"].tolist()):
        start = index * 4096
        assert batch["bases"][row].tolist() == bases[start : start + 4096].tolist()
        assert batch["regions"][row].tolist() == mask[start : start + 4096].tolist()
    held = loader(shard_dir, "heldout", batch_size=50).ordered_batches()
    assert [len(b["index"]) for b in held] == [50, 50, 20]
    assert torch.cat([b["index"] for b in held]).tolist() == list(range(120))
    first = split_point(LENGTH, SMALL)
    assert held[0]["bases"][0].tolist() == bases[first : first + 4096].tolist()


def test_same_seed_and_step_same_batch_other_steps_and_seeds_differ(shard_dir):
    a, b = loader(shard_dir, seed=3), loader(shard_dir, seed=3)
    for step in (0, 1, 30, 31):  # 481 windows, 16 a batch: step 30 spans two epochs
        assert all(torch.equal(a.batch(step)[k], b.batch(step)[k]) for k in a.batch(step))
    assert not torch.equal(a.batch(0)["index"], a.batch(1)["index"])
    epoch = torch.cat([a.batch(step)["index"] for step in range(30)] + [a.batch(30)["index"][:1]])
    assert sorted(epoch.tolist()) == list(range(481))
    assert not torch.equal(a.batch(0)["index"], loader(shard_dir, seed=4).batch(0)["index"])


def test_ensure_reuses_a_complete_set_and_refuses_a_different_one(shard_dir):
    before = {p.name: p.stat().st_mtime_ns for p in shard_dir.iterdir()}
    assert ensure_genome_shards(shard_dir, SMALL, samples_per_shard=200) == load_manifest(shard_dir)
    assert {p.name: p.stat().st_mtime_ns for p in shard_dir.iterdir()} == before
    with pytest.raises(ShardError, match=r"window=4096 \(wanted 512\).*delete that directory"):
        ensure_genome_shards(shard_dir, GenomeOptions(heldout_fraction=0.2), samples_per_shard=200)
    with pytest.raises(ShardError, match=r"heldout_fraction=0.2 \(wanted 0.1\)"):
        ensure_genome_shards(shard_dir, GenomeOptions(window=4096), samples_per_shard=200)
    with pytest.raises(ShardError, match=r"samples_per_shard=200 \(wanted 1024\)"):
        ensure_genome_shards(shard_dir, SMALL)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"window": 15}, "window=15"),
        ({"window": 0}, "window=0"),
        ({"window": 64.0}, "window=64.0"),
        ({"heldout_fraction": 0}, "heldout_fraction=0"),
        ({"heldout_fraction": 0.5}, "heldout_fraction=0.5"),
        ({"heldout_fraction": -0.1}, "heldout_fraction=-0.1"),
        ({"heldout_fraction": "0.1"}, "heldout_fraction='0.1'"),
    ],
)
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        GenomeOptions(**options)


def test_unknown_split_and_batch_size_are_refused(shard_dir):
    with pytest.raises(ValueError, match="split='test'"):
        loader(shard_dir, "test")
    with pytest.raises(ValueError, match="batch_size=0"):
        loader(shard_dir, batch_size=0)


def test_command_line(tmp_path, capsys):
    out = tmp_path / "cli"
    args = cli.build_parser().parse_args(
        ["data", "genome", "--out", str(out), "--window", "8192", "--heldout-fraction", "0.25"]
    )
    args.run(args)
    printed = capsys.readouterr().out
    assert re.search(r"GCF_001457455\.1, 2463666 bases, \d{4} genes called, split point 1847750", printed)
    assert "heldout 75 windows in 1 shards" in printed and "train 225 windows in 1 shards" in printed
    assert sorted(p.name for p in out.iterdir()) == [".windows-heldout.pt", ".windows-train.pt", "heldout-000000.tar",
                                                     MANIFEST, "train-000000.tar"]
    assert load_manifest(out)["meta"]["window"] == 8192
    assert genome.main(["--out", str(out), "--window", "8192", "--heldout-fraction", "0.25"]) == 0
    assert genome.main(["--out", str(out)]) == 2
    assert "window=8192 (wanted 512)" in capsys.readouterr().err
    assert genome.main(["--out", str(tmp_path / "bad"), "--window", "8"]) == 2
    assert "window=8" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_windows_are_read_once_then_loaded_from_their_columns_file(shard_dir):
    """The first reader leaves ``.windows-<split>.pt`` beside the shards; later readers load it and get the
    same tensors; a damaged file, or one from another shard set, is rebuilt from the shards."""
    first = GenomeWindows(shard_dir, "heldout", 4)
    columns = shard_dir / ".windows-heldout.pt"
    assert columns.is_file()
    again = GenomeWindows(shard_dir, "heldout", 4)
    for key in ("bases", "regions", "index"):
        assert torch.equal(first.column(key), again.column(key))
    columns.write_bytes(b"not a torch file")
    assert torch.equal(GenomeWindows(shard_dir, "heldout", 4).column("bases"), first.column("bases"))
    stale = torch.load(columns, weights_only=True)
    stale["shards"] = ["another set"]
    stale["columns"]["bases"] = torch.zeros_like(stale["columns"]["bases"])
    torch.save(stale, columns)
    assert torch.equal(GenomeWindows(shard_dir, "heldout", 4).column("bases"), first.column("bases"))
