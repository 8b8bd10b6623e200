"""A real bacterial chromosome as windows of bases with coding/intergenic labels, in webdataset shards.

The data ships inside pyrodigal's wheel, so it needs no download: ``GENOME_FILE`` is the complete
chromosome of *Corynebacterium diphtheriae* NCTC11397 (assembly ``ACCESSION``, record NZ_LN831026.1,
2,463,666 bases of A, C, G and T), which pyrodigal keeps for its own tests. Bases are encoded
A→0, C→1, G→2, T→3 and anything else (N, IUPAC ambiguity codes) →4 (``BASES``).

Region labels come from pyrodigal (Prodigal's gene finder, in single-genome mode with closed ends, so no
gene runs off the sequence): every base inside a called gene, on either strand, is ``coding`` (1), every
other base ``intergenic`` (0) (``REGIONS``). The gene finder is trained on the whole chromosome, held-out
part included: the labels are an annotation of the genome, as a published annotation would be, not a
prediction the model is scored against; nothing of the held-out DNA reaches a model's training windows.

Split: the last ``heldout_fraction`` of the chromosome (``split_point`` onwards) is held out. Training
windows tile the chromosome from base 0 with stride ``window`` and end at or before the split point;
held-out windows tile it from the split point to the end. Windows do not overlap and none crosses the
split point; the bases left over at the end of each part (fewer than ``window``) are in no window.

``write_genome_shards`` stores both splits as a shard set (``hetero.data.shards``): a sample is one
window, its bases and region labels as uint8 ``npy`` arrays and its ``index`` (in its split) and
``start`` (0-based coordinate on the chromosome) in ``json``. ``GenomeWindows`` serves a split as
deterministic batches (``hetero.data.sample_table``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import importlib.resources
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetero.data import shard_command
from hetero.data.digits import SPLITS
from hetero.data.sample_table import SampleTable
from hetero.data.shards import ShardError, ensure_shard_set, read_columns, write_shard_set
from hetero.errors import ConfigError

BASES = "ACGTN"
REGIONS = ("intergenic", "coding")
ACCESSION = "GCF_001457455.1"
GENOME_PACKAGE = "pyrodigal"
GENOME_FILE = "tests/data/GCF_001457455.1_NCTC11397_genomic.fna.gz"  # inside GENOME_PACKAGE
MIN_WINDOW = 16
_CLI_HELP = "write a real bacterial chromosome as windows with coding/intergenic labels, as webdataset shards"


@dataclasses.dataclass(frozen=True)
class GenomeOptions:
    """Windows of ``window`` bases; the last ``heldout_fraction`` of the chromosome is held out."""

    window: int = 512
    heldout_fraction: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < MIN_WINDOW:
            raise ValueError(f"window={self.window!r} must be an integer of at least {MIN_WINDOW} bases")
        if isinstance(self.heldout_fraction, bool) or not isinstance(self.heldout_fraction, (int, float)):
            raise ValueError(f"heldout_fraction={self.heldout_fraction!r} must be a number")
        if not 0 < self.heldout_fraction < 0.5:
            raise ValueError(
                f"heldout_fraction={self.heldout_fraction!r} must be between 0 and 0.5 (both excluded)"
            )


@functools.cache
def genome_record() -> tuple[str, str]:
    """The FASTA header (without ``>``) and uppercase sequence of the chromosome in ``GENOME_FILE``.

    Read from the installed wheel with ``importlib.resources``: nothing is fetched. Should the file hold
    several records, the longest is the chromosome (the first of equal length); this one holds one.
    """
    resource = importlib.resources.files(GENOME_PACKAGE).joinpath(GENOME_FILE)
    if not resource.is_file():
        raise FileNotFoundError(
            f"{GENOME_PACKAGE}/{GENOME_FILE} is not installed; install pyrodigal==3.7.1 (its wheel ships it)"
        )
    with resource.open("rb") as f:
        text = gzip.decompress(f.read()).decode("ascii")
    records: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith(">"):
            records.append((line[1:].strip(), []))
        elif line.strip() and records:
            records[-1][1].append(line.strip())
    if not records:
        raise ValueError(f"{GENOME_PACKAGE}/{GENOME_FILE} holds no FASTA record")
    header, lines = max(records, key=lambda record: sum(map(len, record[1])))  # max keeps the first of ties
    return header, "".join(lines).upper()


def load_genome() -> str:
    """The chromosome's sequence, uppercase (the longest record of ``GENOME_FILE``; see ``genome_record``)."""
    return genome_record()[1]


def encode(sequence: str) -> np.ndarray:
    """``sequence`` as uint8 codes: A 0, C 1, G 2, T 3 (either case), anything else 4 (``BASES``)."""
    table = np.full(256, BASES.index("N"), dtype=np.uint8)
    for code, base in enumerate(BASES[:4]):
        table[ord(base)] = table[ord(base.lower())] = code
    return table[np.frombuffer(sequence.encode("ascii", errors="replace"), dtype=np.uint8)]


def decode(codes: np.ndarray) -> str:
    """The bases of uint8 ``codes`` (``encode``'s inverse, up to case and non-ACGT letters, which give N)."""
    return "".join(BASES[int(code)] for code in codes)


def call_genes(sequence: str) -> Any:
    """Genes that pyrodigal calls on ``sequence`` (a ``pyrodigal.Genes``): single-genome mode with closed
    ends, its parameters trained on ``sequence`` itself (at least 20 kb). Deterministic; about 2 s here."""
    import pyrodigal  # imported late: only writing shards needs it

    finder = pyrodigal.GeneFinder(meta=False, closed=True)
    finder.train(sequence)
    return finder.find_genes(sequence)


def coding_mask(sequence: str, genes: Any = None) -> np.ndarray:
    """uint8 per base of ``sequence``: 1 inside a called gene (either strand), else 0 (``REGIONS``).

    ``genes`` defaults to ``call_genes(sequence)``, trained on the whole of ``sequence``: labels annotate
    the genome, held-out part included (see the module docstring). Gene coordinates are 1-based and
    inclusive (``begin`` .. ``end``, with ``begin`` < ``end`` on both strands).
    """
    if genes is None:
        genes = call_genes(sequence)
    edges = np.zeros(len(sequence) + 1, dtype=np.int64)
    for gene in genes:
        edges[gene.begin - 1] += 1
        edges[gene.end] -= 1
    return (np.cumsum(edges[:-1]) > 0).astype(np.uint8)


@functools.cache
def annotated_genome() -> tuple[np.ndarray, np.ndarray, Any]:
    """The chromosome encoded, its region labels (both read-only uint8 arrays) and the genes called
    (``call_genes``); computed once per process."""
    sequence = load_genome()
    genes = call_genes(sequence)
    bases, regions = encode(sequence), coding_mask(sequence, genes)
    bases.flags.writeable = regions.flags.writeable = False
    return bases, regions, genes


def split_point(length: int, options: GenomeOptions) -> int:
    """The first held-out base: ``length`` less ``heldout_fraction`` of it (rounded down)."""
    return length - int(length * options.heldout_fraction)


def window_starts(length: int, options: GenomeOptions) -> dict[str, np.ndarray]:
    """Per split, the 0-based start of each window (int64, increasing); see the module docstring."""
    split, w = split_point(length, options), options.window
    starts = {
        "train": np.arange(0, split - w + 1, w, dtype=np.int64),
        "heldout": np.arange(split, length - w + 1, w, dtype=np.int64),
    }
    for name, found in starts.items():
        if len(found) == 0:
            raise ValueError(
                f"window={w} leaves the {name} split empty ({length} bases, split point {split}, "
                f"heldout_fraction={options.heldout_fraction})"
            )
    return starts


def genome_samples(
    bases: np.ndarray, regions: np.ndarray, options: GenomeOptions
) -> dict[str, list[dict[str, Any]]]:
    """Each split's windows as webdataset samples: ``bases.npy`` and ``regions.npy`` (uint8, ``window``
    long) and ``json`` with ``index`` (in the split) and ``start`` (on the chromosome)."""
    w = options.window
    return {
        split: [
            {
                "__key__": f"{index:07d}",
                "bases.npy": np.ascontiguousarray(bases[start : start + w]),
                "regions.npy": np.ascontiguousarray(regions[start : start + w]),
                "json": {"index": index, "start": int(start)},
            }
            for index, start in enumerate(starts.tolist())
        ]
        for split, starts in window_starts(len(bases), options).items()
    }


def write_genome_shards(
    out_dir: str | Path,
    options: GenomeOptions | None = None,
    samples_per_shard: int = 1024,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write both splits as a shard set in ``out_dir`` (see ``hetero.data.shards``); return the manifest.

    The manifest's ``meta`` records the options, the genome (accession, record, length), the genes
    called, the split point, and per split the number of windows and the fraction of coding bases in them.
    """
    options = options or GenomeOptions()
    bases, regions, genes = annotated_genome()
    samples = genome_samples(bases, regions, options)
    meta = {**_meta(options, samples_per_shard), **_statistics(bases, regions, len(genes), options)}
    return write_shard_set(out_dir, samples, samples_per_shard, meta, overwrite)


def genome_shards(genome_dir: str | Path, window: int) -> Path:
    """Where a job keeps the genome shards of ``window``-base windows: one set per window length."""
    return Path(genome_dir) / f"window{window}"


def ensure_genome_shards(
    out_dir: str | Path, options: GenomeOptions | None = None, samples_per_shard: int = 1024
) -> dict[str, Any]:
    """The manifest of the genome shards in ``out_dir``, writing them first if no complete set is there;
    ``ShardError`` naming the differing fields if the set there was made with other options.

    Safe when several processes call it at once: one rename wins and the others read its set. Each
    split's windows are also decoded once into their columns file (``GenomeWindows``), so that a job's
    other ranks, which call this after its first, load tensors instead of decoding every sample.
    """
    options = options or GenomeOptions()
    manifest = ensure_shard_set(
        out_dir, lambda: write_genome_shards(out_dir, options, samples_per_shard), _meta(options, samples_per_shard)
    )
    for split in SPLITS:
        read_columns(out_dir, split, "windows", _window_columns)
    return manifest


class GenomeWindows(SampleTable):
    """Batches of one split's windows, in a deterministic order that depends only on ``seed`` and the epoch.

    The split is read once into memory and served as a ``SampleTable`` (``ordered_batches()``: the
    windows in chromosome order, for held-out evaluation). A batch holds ``bases`` (B, window) long (codes of ``BASES``), ``regions``
    (B, window) long (indices of ``REGIONS``) and ``index`` (B,) long (the window's index in its split;
    it starts at ``split start + index * window``).
    """

    def __init__(self, shard_dir: str | Path, split: str, batch_size: int, seed: int = 0):
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is not one of {SPLITS}")
        columns = read_columns(shard_dir, split, "windows", _window_columns)
        super().__init__({
            "bases": columns["bases"].long(), "regions": columns["regions"].long(), "index": columns["index"],
        }, split, batch_size, seed)


def _window_columns(samples: list[dict]) -> dict[str, torch.Tensor]:
    return {
        "bases": torch.from_numpy(np.stack([s["bases.npy"] for s in samples]).astype(np.uint8)),
        "regions": torch.from_numpy(np.stack([s["regions.npy"] for s in samples]).astype(np.uint8)),
        "index": torch.tensor([s["json"]["index"] for s in samples]),
    }


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``genome`` under ``subparsers`` (e.g. of ``hetero data``); it runs via ``args.run(args)``."""
    return shard_command.register(subparsers, "genome", _CLI_HELP, _add_arguments, _run)


def main(argv: list[str] | None = None) -> int:
    """``python -m hetero.data.genome --out DIR``: the same command without the ``hetero`` wrapper."""
    return shard_command.main("hetero data genome", _CLI_HELP, _add_arguments, _run, argv)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = GenomeOptions()
    parser.add_argument("--out", required=True, type=Path, help="directory of the shard set")
    parser.add_argument("--window", type=int, default=defaults.window, help="bases in each window")
    parser.add_argument(
        "--heldout-fraction",
        type=float,
        default=defaults.heldout_fraction,
        help="the last part of the chromosome held out, as a fraction of its length",
    )
    parser.add_argument("--samples-per-shard", type=int, default=1024, help="windows in each tar shard")
    parser.add_argument("--overwrite", action="store_true", help="replace a shard set already in --out")


def _run(args: argparse.Namespace) -> None:
    try:
        options = GenomeOptions(window=args.window, heldout_fraction=args.heldout_fraction)
        if args.overwrite:
            manifest = write_genome_shards(args.out, options, args.samples_per_shard, overwrite=True)
        else:
            manifest = ensure_genome_shards(args.out, options, args.samples_per_shard)
    except (ValueError, FileExistsError, ShardError) as err:
        raise ConfigError(str(err)) from err
    meta = manifest["meta"]
    print(
        f"{args.out}: {meta['accession']}, {meta['length']} bases, {meta['genes']} genes called, "
        f"split point {meta['split_point']}"
    )
    for name, split in manifest["splits"].items():
        size = sum(shard["bytes"] for shard in split["shards"])
        shards = len(split["shards"])
        print(
            f"{args.out}: {name} {split['count']} windows in {shards} shards, {size / 1e6:.1f} MB, "
            f"coding fraction {meta['coding_fraction'][name]:.3f}"
        )


def _meta(options: GenomeOptions, samples_per_shard: int) -> dict[str, Any]:
    """What the set is and the options it was made with: the keys ``ensure_genome_shards`` compares."""
    return {
        "dataset": "bacterial chromosome windows with coding/intergenic labels (pyrodigal)",
        "accession": ACCESSION,
        "source": f"{GENOME_PACKAGE}/{GENOME_FILE}",
        "bases": BASES,
        "regions": list(REGIONS),
        **dataclasses.asdict(options),
        "samples_per_shard": samples_per_shard,
    }


def _statistics(bases: np.ndarray, regions: np.ndarray, genes: int, options: GenomeOptions) -> dict[str, Any]:
    starts = window_starts(len(bases), options)
    covered = {
        split: np.concatenate([regions[s : s + options.window] for s in found.tolist()])
        for split, found in starts.items()
    }
    return {
        "record": genome_record()[0],
        "length": len(bases),
        "genes": genes,
        "gene_caller": f"pyrodigal {version('pyrodigal')}, single mode, closed ends, trained on the genome",
        "split_point": split_point(len(bases), options),
        "windows": {split: len(found) for split, found in starts.items()},
        "coding_fraction": {split: round(float(labels.mean()), 6) for split, labels in covered.items()},
        "genome_coding_fraction": round(float(regions.mean()), 6),
    }


if __name__ == "__main__":
    sys.exit(main())
