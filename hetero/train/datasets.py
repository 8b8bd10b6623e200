"""The samples a job trains on, by ``train.dataset``, shaped by the graph that reads them.

Each dataset gives global batches (the same on every rank): ``batch(step)`` of the training split and
``ordered_batches()`` of the held-out split, with the columns the graph's kinds read. Sizes come from the
modules: the placeholders in the LLM's sequence from the edges into it, the genome window from the DNA
module, the frame size from the video module. ``prepare`` writes missing shards (rank 0, before the job's
barrier); they are real data that installs with the packages (``hetero.data``).

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
from hetero.data.stream import ShardStream
from hetero.data.text import heldout_batches, load_stdlib_corpus, sample_batch, tokenized
from hetero.data.video_clips import ClipOptions, VideoClips, ensure_video_shards
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
    raise ConfigError(f"train.dataset={dataset} needs a module that reads {key!r}; none of "
                      f"{', '.join(graph.nodes)} does: pick a dataset for these modules")


def _placeholders(graph: Graph, llm: Node, modality: str | None = None) -> int:
    """Placeholder tokens in ``llm``'s sequence from edges whose source has ``modality`` (None: all)."""
    return sum(e.tokens for e in graph.in_edges(llm.name) if e.placeholders
               and (modality is None or graph.nodes[e.src].kind.modality == modality))


def _genome_dir(experiment: ExperimentConfig, graph: Graph, dataset: str):
    return genome_shards(experiment.train.genome_dir, _reader(graph, "dna", dataset).config.seq_len)


def load_splits(experiment: ExperimentConfig, graph: Graph, splits=("train", "heldout")) -> dict[str, Batches]:
    """Each split's batches; rank 0 writes missing shards first (every rank calls this: it has a barrier)."""
    if dist.get_rank() == 0:
        prepare(experiment, graph)
    dist.barrier()
    return {split: load(experiment, graph, split) for split in splits}


def prepare(experiment: ExperimentConfig, graph: Graph) -> None:
    """Write the dataset's shards where missing (call on one rank, then barrier)."""
    cfg, dataset = experiment.train, experiment.train.dataset
    if dataset in ("digits", "digits_dna", "multimodal"):
        ensure_digit_shards(cfg.data_dir)
    if dataset in ("digits_dna", "multimodal", "genome"):
        window = _reader(graph, "dna", dataset).config.seq_len
        ensure_genome_shards(genome_shards(cfg.genome_dir, window), GenomeOptions(window=window))
    if dataset == "multimodal":
        frame_size = _reader(graph, "clips", dataset).config.frame_size
        ensure_video_shards(cfg.clip_dir, CLIPS["train"], CLIPS["heldout"], graph_clip_options(frame_size), experiment.seed)
    if dataset == "video_clips":
        frame_size = _reader(graph, "clips", dataset).config.frame_size
        ensure_video_shards(cfg.data_dir, CLIPS["train"], CLIPS["heldout"], ClipOptions(size=frame_size), experiment.seed)


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
        return MultimodalBatches(cfg.data_dir, _genome_dir(experiment, graph, dataset), cfg.clip_dir, split, size,
                                 _placeholders(graph, llm, "image"), _placeholders(graph, llm, "dna"), seq_len, seed,
                                 cfg.presence, cfg.bad_shards)
    if dataset == "video_clips":
        return Renamed(VideoClips(cfg.data_dir, split, size, seed), {"frames": "clips"})
    if dataset == "genome":
        windows = GenomeWindows(_genome_dir(experiment, graph, dataset), split, size, seed)
        return Renamed(windows, {"bases": "dna", "regions": "dna_regions"})
    if dataset == "photo_documents":
        vision = _reader(graph, "image_patches", dataset).config
        return PhotoDocuments(split, size, llm.config.seq_len, vision.patch_size, vision.max_patches, vision.channels,
                              seed)
    if dataset == "stdlib_text":
        return TextWindows(split, size, seq_len, seed, tokenizer_of(llm))
    raise ConfigError(f"train.dataset={dataset!r} is not one of {', '.join(DATASETS)}")


_DIGITS = ("images", "tokens", "labels", "digit_position", "label", "index")
COLUMNS = {  # what each dataset's batches hold
    "digits": _DIGITS,
    "digits_dna": _DIGITS + ("dna", "dna_regions", "gc", "gc_position"),
    "multimodal": _DIGITS + ("dna", "dna_regions", "gc", "gc_position", "clips", "clip_index", "has_image",
                             "has_dna", "has_clip"),
    "video_clips": ("clips", "revisit", "scene", "index"),
    "genome": ("dna", "dna_regions"),
    "stdlib_text": ("tokens", "labels"),
    "photo_documents": ("tokens", "labels", "documents", "image_patches", "image_grid", "image_row", "image_start",
                        "index"),
}
DATASETS = tuple(COLUMNS)


def check(experiment: ExperimentConfig, graph: Graph) -> None:
    """Refuse, before any process group, a dataset that is unknown or lacks a column a module reads."""
    dataset = experiment.train.dataset
    if dataset not in COLUMNS:
        raise ConfigError(f"train.dataset={dataset!r} is not one of {', '.join(DATASETS)}")
    if experiment.train.stream_buffer and dataset != "digits":
        raise ConfigError(f"train.stream_buffer={experiment.train.stream_buffer}: streaming reads the digits' shards; "
                          f"train.dataset={dataset} is read whole, so set train.stream_buffer=0")
    if experiment.train.stream_buffer < 0:
        raise ConfigError(f"train.stream_buffer={experiment.train.stream_buffer} must be >= 0 (0: read into memory)")
    for node in graph.nodes.values():
        missing = [key for key in node.kind.data_keys(node.config) if key not in COLUMNS[dataset]]
        if missing:
            raise ConfigError(
                f"{node.name} ({node.kind.name}) reads {', '.join(missing)}, which train.dataset={dataset} does not "
                f"provide (it provides {', '.join(COLUMNS[dataset])}); choose a dataset with them"
            )
    if dataset == "stdlib_text" and (tokenizer := tokenizer_of(llm := _reader(graph, "tokens", dataset))):
        from tokenizers import Tokenizer

        size = Tokenizer.from_file(str(tokenizer)).get_vocab_size(with_added_tokens=True)
        if size > llm.config.vocab_size:
            raise ConfigError(f"{tokenizer} has {size} tokens but {llm.name}.model.vocab_size="
                              f"{llm.config.vocab_size}; use the tokenizer that came with the weights")
