"""Captioned digits paired with genome windows: data for a vision and a DNA encoder feeding one LLM.

Sample ``i`` of a split of the digits (``hetero.data.digits``) is paired with window
``(i · PAIR_STRIDE) mod windows`` of the same split of the genome (``hetero.data.genome``). Its caption is
the digit's caption followed by `` gc N.``, where ``N`` is the window's GC-content bin: ``GC_BINS`` bins
of equal frequency over the training windows (terciles), so each is about as common and the LLM can tell
it only from the DNA. Coarse bins keep the task learnable: a 256-base window's GC fraction varies by a
few percent, so a decile would hinge on two or three bases. The LLM's sequence holds
``num_image_tokens`` placeholders (the image embeddings), then ``num_dna_tokens`` placeholders (the DNA
encoder's compressed tokens), then the caption.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from hetero.data.digits import DigitBatches, vlm_sequence
from hetero.data.genome import BASES, GenomeWindows
from hetero.data.shards import read_split

PAIR_STRIDE = 7919  # a prime: consecutive digits get windows far apart on the chromosome
GC_BINS = 3
GC = (BASES.index("G"), BASES.index("C"))


def gc_content(bases: torch.Tensor) -> torch.Tensor:
    """Fraction of G or C in each row of base ids (batch, length)."""
    return ((bases == GC[0]) | (bases == GC[1])).double().mean(-1)


@functools.cache
def _train_windows(genome_dir: Path) -> GenomeWindows:
    return GenomeWindows(genome_dir, "train", 1)


def gc_bin_edges(genome_dir: str | Path) -> torch.Tensor:
    """The GC-content values that cut the training windows into ``GC_BINS`` bins of equal size."""
    bases = _train_windows(Path(genome_dir)).column("bases")
    return torch.quantile(gc_content(bases), torch.arange(1, GC_BINS).double() / GC_BINS)


class DigitDnaBatches(DigitBatches):
    """``DigitBatches`` with a genome window per sample: batches add ``dna`` (B, window) base ids,
    ``dna_regions`` (B, window) region ids, ``gc`` (B,) the GC bin and ``gc_position`` (B,) (``labels[b,
    gc_position[b]]`` is the bin's digit); ``tokens``, ``labels`` and ``digit_position`` follow the
    longer caption and the DNA placeholders."""

    def __init__(
        self,
        digit_dir: str | Path,
        genome_dir: str | Path,
        split: str,
        global_batch_size: int,
        num_image_tokens: int,
        num_dna_tokens: int,
        seq_len: int,
        seed: int = 0,
        bad_shards: str = "error",
    ):
        super().__init__(
            digit_dir, split, global_batch_size, num_image_tokens + num_dna_tokens, seq_len, seed, bad_shards
        )
        captions = {s["json"]["index"]: s["txt"] for s in read_split(digit_dir, split, bad_shards)}
        windows = _train_windows(Path(genome_dir)) if split == "train" else GenomeWindows(genome_dir, split, 1)
        bases, regions = windows.column("bases"), windows.column("regions")
        pick = (self._data["index"] * PAIR_STRIDE) % len(windows)
        gc = torch.bucketize(gc_content(bases[pick]), gc_bin_edges(genome_dir))
        sequences = []
        for index, gc_bin, position in zip(self._data["index"].tolist(), gc.tolist(), self._data["digit_position"]):
            text = f"{captions[index]} gc {gc_bin}."
            tokens, labels, _ = vlm_sequence(text, len(text) - 2, num_image_tokens + num_dna_tokens, seq_len)
            sequences.append((tokens, labels, int(position), num_image_tokens + num_dna_tokens + len(text) - 3))
        self._data |= {
            "tokens": torch.stack([s[0] for s in sequences]),
            "labels": torch.stack([s[1] for s in sequences]),
            "dna": bases[pick],
            "dna_regions": regions[pick],
            "gc": gc,
            "gc_position": torch.tensor([s[3] for s in sequences]),
        }
