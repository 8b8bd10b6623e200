"""The samples a job trains on, by ``train.dataset``, shaped by the graph that reads them.

Each dataset gives global batches (the same on every rank): ``batch(step)`` of the training split and
``ordered_batches()`` of the held-out split, with the columns the graph's kinds read. Sizes come from the
modules: the placeholders in the LLM's sequence from the edges into it, the genome window from the DNA
module, the frame size from the video module. ``check`` refuses, from the config alone, a dataset that
is unknown or lacks a column a module reads (``DATASETS``: what each one holds). ``prepare`` writes
missing shards (``hetero train`` before it launches the ranks, rank 0 before the job's barrier); they are
real data that installs with the packages (``hetero.data``). Each shard set has a directory of its own,
so no two ever meet: the digits in ``train.data_dir``, genome windows in ``train.genome_dir/window<N>``,
clips in ``train.clip_dir/<shape, counts, seed>`` (``video_shards``); a set already there with the same
options is reused, and a directory that holds anything else is refused, saying what it holds.

- ``digits``: captioned scikit-learn digits (``images``, ``tokens``, ``labels``, ``digit_position``);
  with ``train.stream_buffer`` > 0 its training split streams from the shards through a shuffle buffer
  (``hetero.data.stream``) instead of being read into memory;
- ``digits_dna``: the same with a genome window per sample and its GC-content bin in the caption;
- ``multimodal``: text always, and an image, a genome window and a clip, each present with its own
  probability (``train.presence``);
- ``video_clips``: clips that revisit a scene (``clips``, ``revisit``, ``index``);
- ``genome``: windows of a bacterial chromosome (``dna``, ``dna_regions``);
- ``photo_documents``: long packed rows of documents that mix photographs at native resolution and
  text (``tokens``, ``labels``, ``documents``, ``image_*``; ``hetero.data.photo_documents``);
- ``stdlib_text``: windows of Python's standard-library sources (``tokens``, ``labels``): bytes, or the
  tokens of the ``tokenizer.json`` beside the LLM's ``init.hf`` checkpoint when it has one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from hetero.config import ExperimentConfig
from hetero.data.digit_dna import DigitDnaBatches
from hetero.data.digits import DigitBatches, digit_columns, ensure_digit_shards
from hetero.data.genome import GenomeOptions, GenomeWindows, ensure_genome_shards, genome_shards
from hetero.data.multimodal import MultimodalBatches
from hetero.data.photo_documents import PhotoDocuments
from hetero.data.shards import ShardError
from hetero.data.stream import ShardStream
from hetero.data.text import heldout_batches, load_stdlib_corpus, sample_batch, tokenized
from hetero.data.video_clips import ClipOptions, VideoClips, ensure_video_shards, video_shards
from hetero.errors import ConfigError
from hetero.graph.graph import Graph, Node

CLIPS = {"train": 512, "heldout": 64}
TEXT_HELDOUT_BATCHES = 16


class Batches(Protocol):
    global_batch_size: int

    def batch(self, step: int) -> dict[str, torch.Tensor]: ...

    def ordered_batches(self) -> list[dict[str, torch.Tensor]]: ...


class Renamed:
    """Batches with some columns under the names the graph's kinds read."""

    def __init__(self, batches, names: dict[str, str]):
        self.batches, self.names = batches, names
        self.global_batch_size = batches.global_batch_size

    def _rename(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.names.get(key, key): value for key, value in batch.items()}

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        return self._rename(self.batches.batch(step))

    def ordered_batches(self) -> list[dict[str, torch.Tensor]]:
        return [self._rename(b) for b in self.batches.ordered_batches()]


class TextWindows:
    """Random training windows of the text corpus per step; held-out windows spread over its held-out
    part. Byte tokens, or ``tokenizer``'s (a ``tokenizer.json``) when given."""

    def __init__(self, split: str, global_batch_size: int, seq_len: int, seed: int, tokenizer: Path | None = None):
        corpus = load_stdlib_corpus()
        if tokenizer is not None:
            corpus = tokenized(corpus, tokenizer)
        self.split, self.global_batch_size, self.seq_len, self.seed = split, global_batch_size, seq_len, seed
        self.data = corpus.train if split == "train" else corpus.heldout

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        tokens, labels = sample_batch(self.data, self.global_batch_size, self.seq_len, step, self.seed)
        return {"tokens": tokens, "labels": labels}

    def ordered_batches(self) -> list[dict[str, torch.Tensor]]:
        return [{"tokens": t, "labels": y}
                for t, y in heldout_batches(self.data, self.global_batch_size, self.seq_len, TEXT_HELDOUT_BATCHES)]


def tokenizer_of(llm: Node) -> Path | None:
    """The ``tokenizer.json`` beside ``llm``'s ``init.hf`` checkpoint, if there is one (else bytes)."""
    if llm.settings.init.hf is None:
        return None
    path = Path(llm.settings.init.hf) / "tokenizer.json"
    return path if path.is_file() else None


def _reader(graph: Graph, key: str, dataset: str) -> Node:
    """The module that reads batch column ``key``."""
    for node in graph.nodes.values():
        if key in node.kind.data_keys(node.config):
            return node
    raise ConfigError(f"train.dataset={dataset} sizes its samples by the module that reads {key}; none of "
                      f"{', '.join(graph.nodes)} does: choose a dataset for these modules or add one that reads {key}")


def _placeholders(graph: Graph, llm: Node, modality: str | None = None) -> int:
    """Placeholder tokens in ``llm``'s sequence from edges whose source has ``modality`` (None: all)."""
    return sum(e.tokens for e in graph.in_edges(llm.name) if e.placeholders
               and (modality is None or graph.nodes[e.src].kind.modality == modality))


def _genome_dir(experiment: ExperimentConfig, graph: Graph, dataset: str) -> Path:
    return genome_shards(experiment.train.genome_dir, _reader(graph, "dna", dataset).config.seq_len)


def _clip_dir(experiment: ExperimentConfig, graph: Graph, dataset: str) -> tuple[Path, ClipOptions]:
    """The clips' shard set under ``train.clip_dir`` (one per shape and seed) and their options."""
    frame_size = _reader(graph, "clips", dataset).config.frame_size
    options = graph_clip_options(frame_size) if dataset == "multimodal" else ClipOptions(size=frame_size)
    return video_shards(experiment.train.clip_dir, CLIPS["train"], CLIPS["heldout"], options, experiment.seed), options


def load_splits(experiment: ExperimentConfig, graph: Graph, splits=("train", "heldout")) -> dict[str, Batches]:
    """Each split's batches; rank 0 writes missing shards first (every rank calls this: it has a barrier)."""
    if dist.get_rank() == 0:
        prepare(experiment, graph)
    dist.barrier()
    return {split: load(experiment, graph, split) for split in splits}


@dataclass(frozen=True)
class ShardSet:
    """A shard set a dataset reads: ``path``, under the directory of ``train.<field>``; ``ensure`` writes it
    if missing and returns its manifest."""

    field: str
    path: Path
    ensure: Callable[[], dict]


def shard_sets(experiment: ExperimentConfig, graph: Graph) -> list[ShardSet]:
    """The shard sets ``train.dataset`` reads (none for the datasets made in memory), each in a directory
    of its own: the digits in ``data_dir``, windows of N bases in ``genome_dir/windowN``, clips in
    ``clip_dir/<shape, counts, seed>``."""
    cfg, dataset = experiment.train, experiment.train.dataset
    sets = []
    if dataset in ("digits", "digits_dna", "multimodal"):
        sets.append(ShardSet("data_dir", Path(cfg.data_dir), lambda: ensure_digit_shards(cfg.data_dir)))
    if dataset in ("digits_dna", "multimodal", "genome"):
        genome_dir, window = _genome_dir(experiment, graph, dataset), _reader(graph, "dna", dataset).config.seq_len
        sets.append(ShardSet("genome_dir", genome_dir,
                             lambda: ensure_genome_shards(genome_dir, GenomeOptions(window=window))))
    if dataset in ("multimodal", "video_clips"):
        clip_dir, options = _clip_dir(experiment, graph, dataset)
        sets.append(ShardSet("clip_dir", clip_dir, lambda: ensure_video_shards(
            clip_dir, CLIPS["train"], CLIPS["heldout"], options, experiment.seed)))
    return sets


def prepare(experiment: ExperimentConfig, graph: Graph) -> None:
    """Write the dataset's missing shard sets and reuse those already there (on one process: ``hetero
    train`` before it launches the ranks, rank 0 before the job's barrier); a directory that holds
    something else is a ``ConfigError`` naming the field that chose it and what it holds."""
    for shard_set in shard_sets(experiment, graph):
        try:
            shard_set.ensure()
        except (ShardError, FileExistsError) as err:
            root = getattr(experiment.train, shard_set.field)
            raise ConfigError(f"train.{shard_set.field}={root}: {err}") from err


def graph_clip_options(frame_size: int) -> ClipOptions:
    """Short clips for multimodal samples (8 frames: the digit's scene, two others, the digit's scene again)."""
    return ClipOptions(frames=8, size=frame_size, gap=3, a_len=3)


def load(experiment: ExperimentConfig, graph: Graph, split: str) -> Batches:
    """The global batches of ``split`` (train | heldout); the shards must exist (``prepare``)."""
    cfg, dataset = experiment.train, experiment.train.dataset
    size, seed = experiment.batch.global_batch_size, experiment.seed
    if dataset in ("digits", "digits_dna", "multimodal", "stdlib_text", "photo_documents"):
        llm = _reader(graph, "tokens", dataset)
        seq_len = llm.config.seq_len
    if dataset == "digits" and cfg.stream_buffer and split == "train":
        placeholders = _placeholders(graph, llm)
        return ShardStream(cfg.data_dir, split, size, lambda samples: digit_columns(samples, placeholders, seq_len, split),
                           seed=seed, buffer=cfg.stream_buffer)
    if dataset == "digits":
        return DigitBatches(cfg.data_dir, split, size, _placeholders(graph, llm), seq_len, seed, cfg.bad_shards)
    if dataset == "digits_dna":
        return DigitDnaBatches(cfg.data_dir, _genome_dir(experiment, graph, dataset), split, size,
                               _placeholders(graph, llm, "image"), _placeholders(graph, llm, "dna"), seq_len, seed,
                               cfg.bad_shards)
    if dataset == "multimodal":
        return MultimodalBatches(cfg.data_dir, _genome_dir(experiment, graph, dataset),
                                 _clip_dir(experiment, graph, dataset)[0], split, size,
                                 _placeholders(graph, llm, "image"), _placeholders(graph, llm, "dna"), seq_len, seed,
                                 cfg.presence, cfg.bad_shards)
    if dataset == "video_clips":
        return Renamed(VideoClips(_clip_dir(experiment, graph, dataset)[0], split, size, seed), {"frames": "clips"})
    if dataset == "genome":
        windows = GenomeWindows(_genome_dir(experiment, graph, dataset), split, size, seed)
        return Renamed(windows, {"bases": "dna", "regions": "dna_regions"})
    if dataset == "photo_documents":
        vision = _reader(graph, "image_patches", dataset).config
        return PhotoDocuments(split, size, llm.config.seq_len, vision.patch_size, vision.max_patches, vision.channels,
                              seed)
    if dataset == "stdlib_text":
        return TextWindows(split, size, seq_len, seed, tokenizer_of(llm))
    raise ConfigError(f"train.dataset={dataset} is not a dataset; choose one of {', '.join(DATASETS)}")


@dataclass(frozen=True)
class Dataset:
    """What the check before launch knows of a built-in dataset without building it: the columns its
    batches hold, and the columns whose reader sizes its samples (the LLM's sequence, the genome window,
    the clip's frames): some module must read each of those."""

    columns: tuple[str, ...]
    sized_by: tuple[str, ...]


_DIGITS = ("images", "tokens", "labels", "digit_position", "label", "index")
_DNA = ("dna", "dna_regions", "gc", "gc_position")
DATASETS: dict[str, Dataset] = {
    "digits": Dataset(_DIGITS, ("tokens",)),
    "digits_dna": Dataset(_DIGITS + _DNA, ("tokens", "dna")),
    "multimodal": Dataset(_DIGITS + _DNA + ("clips", "clip_index", "has_image", "has_dna", "has_clip"),
                          ("tokens", "dna", "clips")),
    "video_clips": Dataset(("clips", "revisit", "scene", "index"), ("clips",)),
    "genome": Dataset(("dna", "dna_regions"), ("dna",)),
    "stdlib_text": Dataset(("tokens", "labels"), ("tokens",)),
    "photo_documents": Dataset(("tokens", "labels", "documents", "image_patches", "image_grid", "image_row",
                                "image_start", "index"), ("tokens", "image_patches")),
}


def check(experiment: ExperimentConfig, graph: Graph) -> None:
    """Refuse, before any process starts, a dataset that is unknown, lacks a column a module reads, or has
    no module to size its samples: a function of the config (no shard is read or written)."""
    dataset = experiment.train.dataset
    if dataset not in DATASETS:
        raise ConfigError(f"train.dataset={dataset} is not a dataset; choose one of {', '.join(DATASETS)}")
    if experiment.train.stream_buffer and dataset != "digits":
        raise ConfigError(f"train.stream_buffer={experiment.train.stream_buffer}: streaming reads the digits' shards; "
                          f"train.dataset={dataset} is read whole, so set train.stream_buffer=0")
    if experiment.train.stream_buffer < 0:
        raise ConfigError(f"train.stream_buffer={experiment.train.stream_buffer} must be >= 0 (0: read into memory)")
    reads = {node.name: set(node.kind.data_keys(node.config)) for node in graph.nodes.values()}
    for node in graph.nodes.values():
        missing = [key for key in node.kind.data_keys(node.config) if key not in DATASETS[dataset].columns]
        if missing:
            fitting = [name for name, d in DATASETS.items() if all(keys <= set(d.columns) for keys in reads.values())]
            raise ConfigError(
                f"train.dataset={dataset} gives the columns {', '.join(DATASETS[dataset].columns)} but {node.name} "
                f"(kind {node.kind.name}) reads {', '.join(missing)}; "
                + (f"choose train.dataset={' or '.join(fitting)}" if fitting else
                   "no built-in dataset has every column these modules read: train them with batches of your own")
            )
    for key in DATASETS[dataset].sized_by:
        _reader(graph, key, dataset)
    if dataset == "stdlib_text" and (tokenizer := tokenizer_of(llm := _reader(graph, "tokens", dataset))):
        from tokenizers import Tokenizer

        size = Tokenizer.from_file(str(tokenizer)).get_vocab_size(with_added_tokens=True)
        if size > llm.config.vocab_size:
            raise ConfigError(f"{tokenizer} has {size} tokens but {llm.name}.model.vocab_size="
                              f"{llm.config.vocab_size}; use the tokenizer that came with the weights")
