"""Digits paired with genome windows: the caption ends in the window's GC-content bin, the label at
``gc_position`` is that bin's digit, bins are balanced on the training windows, and held-out digits get
held-out DNA."""

import torch

from hetero.data.digit_dna import GC_BINS, DigitDnaBatches, gc_content
from hetero.data.digits import ensure_digit_shards
from hetero.data.genome import GenomeOptions, GenomeWindows, ensure_genome_shards


def test_captions_carry_the_gc_bin_of_their_window(tmp_path):
    ensure_digit_shards(tmp_path / "digits")
    ensure_genome_shards(tmp_path / "genome", GenomeOptions(window=256))
    splits = {split: DigitDnaBatches(tmp_path / "digits", tmp_path / "genome", split, 8, 4, 48, 88)
              for split in ("train", "heldout")}
    for split, data in splits.items():
        gc, position = data.column("gc"), data.column("gc_position")
        labels = data.column("labels")
        assert torch.equal(labels.gather(1, position[:, None]).squeeze(1), gc + ord("0"))
        assert torch.equal(labels.gather(1, data.column("digit_position")[:, None]).squeeze(1),
                           data.column("label") + ord("0"))
        windows = GenomeWindows(tmp_path / "genome", split, 1).column("bases")
        assert all(any(torch.equal(row, w) for w in windows[:: 1]) for row in data.column("dna")[:3])
        assert gc.min() >= 0 and gc.max() < GC_BINS
    # Over the training windows the bins split evenly; the paired train digits are close to even too.
    counts = torch.bincount(splits["train"].column("gc"), minlength=GC_BINS).double()
    assert (counts / counts.sum() - 1 / GC_BINS).abs().max() < 0.05
    first = splits["train"].batch(0)
    assert bytes(first["tokens"][0, 52:].tolist()).split(b"\xff")[0].decode().endswith(f"gc {int(first['gc'][0])}.")
    assert torch.allclose(gc_content(torch.tensor([[1, 2, 0, 3]])), torch.tensor([0.5], dtype=torch.float64))
