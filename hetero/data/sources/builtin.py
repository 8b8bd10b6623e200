"""The datasets hetero makes itself, from real data that installs with its packages, as data formats.

Each holds fixed columns and is sized by the modules that read some of them (the LLM's sequence, the
genome window, the clip's frames): some module must read each. Shard sets are written by ``prepare``
into directories of their own, so no two ever meet: the digits in ``train.data_dir``, genome windows in
``train.genome_dir/window<N>``, clips in ``train.clip_dir/<shape, counts, seed>``; a set already there
with the same options is reused, and a directory that holds anything else is refused. Each rank builds
only the rows its modules read (``hetero.data.rank_batches``): the shard-backed datasets are held in
memory as columns and served by sample id (``hetero.data.sample_table``).

- ``digits``: captioned scikit-learn digits (``images``, ``tokens``, ``labels``, ``digit_position``);
  with ``train.stream_buffer`` > 0 its training split streams through a shuffle buffer; in a mixture,
  each digit is a conversation about its image, shaped like users' samples;
- ``digits_dna``: the same with a genome window per sample and its GC-content bin in the caption;
- ``multimodal``: text always, and an image, a genome window and a clip, each present with its own
  probability (``train.presence``);
- ``video_clips``: clips that revisit a scene (``clips``, ``revisit``, ``index``);
- ``genome``: windows of a bacterial chromosome (``dna``, ``dna_regions``);
- ``photo_documents``: long packed rows of documents that mix photographs at native resolution and text;
- ``stdlib_text``: windows of Python's standard-library sources (``tokens``, ``labels``, ``index``: where
  each starts): bytes, or the
  tokens of the ``tokenizer.json`` beside the LLM's ``init.hf`` checkpoint when it has one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hetero.config import ExperimentConfig
from hetero.data.config import SourceConfig
from hetero.data.digit_dna import DigitDnaBatches
from hetero.data.digits import DigitBatches, digit_columns, ensure_digit_shards
from hetero.data.genome import GenomeOptions, GenomeWindows, ensure_genome_shards, genome_shards
from hetero.data.multimodal import MultimodalBatches
from hetero.data.photo_documents import PhotoDocuments
from hetero.data.rank_batches import Reads, made_together, rank_columns
from hetero.data.shards import ShardError
from hetero.data.sources.digit_conversations import DigitConversations
from hetero.data.sources.format import Batches, DataFormat
from hetero.data.sources.sample_format import Samples
from hetero.data.stream import ShardStream
from hetero.data.text import heldout_starts, load_stdlib_corpus, tokenized, window_starts, windows
from hetero.data.video_clips import ClipOptions, VideoClips, ensure_video_shards, video_shards
from hetero.errors import ConfigError
from hetero.graph.graph import Graph, Node


CLIPS = {"train": 512, "heldout": 64}
TEXT_HELDOUT_BATCHES = 16


class TextWindows:
    """Random training windows of the text corpus per step; held-out windows spread over its held-out
    part. Byte tokens, or ``tokenizer``'s (a ``tokenizer.json``) when given; a window's ``index`` is where
    it starts in its split."""

    def __init__(self, split: str, global_batch_size: int, seq_len: int, seed: int, tokenizer: Path | None = None):
        corpus = load_stdlib_corpus()
        if tokenizer is not None:
            corpus = tokenized(corpus, tokenizer)
        self.split, self.global_batch_size, self.seq_len, self.seed = split, global_batch_size, seq_len, seed
        self.data = corpus.train if split == "train" else corpus.heldout

    def _batch(self, starts: torch.Tensor, reads: Reads | None) -> dict[str, torch.Tensor]:
        def made(rows: torch.Tensor) -> dict[str, torch.Tensor]:
            return dict(zip(("tokens", "labels"), windows(self.data, starts[rows], self.seq_len)))

        bookkeeping = {"index": starts}
        if reads is not None:  # every label of a window carries a loss
            bookkeeping["label_counts"] = torch.full((len(starts),), self.seq_len, dtype=torch.long, device="cpu")
        return rank_columns(bookkeeping, ("tokens", "labels"), made_together(made), reads)

    def batch(self, step: int, reads: Reads | None = None) -> dict[str, torch.Tensor]:
        return self._batch(window_starts(self.data, self.global_batch_size, self.seq_len, step, self.seed), reads)

    def ordered_batches(self, reads: Reads | None = None) -> list[dict[str, torch.Tensor]]:
        return [self._batch(starts, reads) for starts in heldout_starts(self.data, self.global_batch_size,
                                                                        self.seq_len, TEXT_HELDOUT_BATCHES)]


def tokenizer_of(llm: Node) -> Path | None:
    """The ``tokenizer.json`` beside ``llm``'s ``init.hf`` checkpoint, if there is one (else bytes)."""
    if llm.settings.init.hf is None:
        return None
    path = Path(llm.settings.init.hf) / "tokenizer.json"
    return path if path.is_file() else None


def reader(graph: Graph, key: str, fmt: str) -> Node:
    """The module that reads batch column ``key``."""
    for node in graph.nodes.values():
        if key in node.kind.data_keys(node.config):
            return node
    raise ConfigError(f"train.data.format={fmt} sizes its samples by the module that reads {key}; none of "
                      f"{', '.join(graph.nodes)} does: choose a data format for these modules or add one that reads {key}")


def _placeholders(graph: Graph, llm: Node, modality: str | None = None) -> int:
    """Placeholder tokens in ``llm``'s sequence from edges whose source has ``modality`` (None: all)."""
    return sum(e.tokens for e in graph.in_edges(llm.name) if e.placeholders
               and (modality is None or graph.nodes[e.src].kind.modality == modality))


def graph_clip_options(frame_size: int) -> ClipOptions:
    """Short clips for multimodal samples (8 frames: the digit's scene, two others, the digit's scene again)."""
    return ClipOptions(frames=8, size=frame_size, gap=3, a_len=3)


@dataclass(frozen=True)
class ShardSet:
    """A shard set a dataset reads: ``path``, under the directory of ``train.<field>``; ``ensure`` writes it
    if missing and returns its manifest."""

    field: str
    path: Path
    ensure: Callable[[], dict]


_DIGITS = ("images", "tokens", "labels", "digit_position", "label", "index")
_DNA = ("dna", "dna_regions", "gc", "gc_position")


class BuiltIn(DataFormat):
    """A built-in dataset: its columns, the columns whose readers size it, and how to load a split."""

    held: tuple[str, ...] = ()
    sized_by: tuple[str, ...] = ()

    def columns(self, experiment, graph, source) -> tuple[str, ...]:
        return self.held

    def check(self, experiment: ExperimentConfig, graph: Graph, source: SourceConfig) -> None:
        if experiment.train.stream_buffer < 0:
            raise ConfigError(f"train.stream_buffer={experiment.train.stream_buffer} must be >= 0 (0: read into memory)")
        if experiment.train.stream_buffer and self.name != "digits":
            raise ConfigError(f"train.stream_buffer={experiment.train.stream_buffer}: streaming reads the digits' shards; "
                              f"train.data.format={self.name} is read whole, so set train.stream_buffer=0")
        for node in graph.nodes.values():
            missing = [key for key in node.kind.data_keys(node.config) if key not in self.held]
            if missing:
                reads = [set(n.kind.data_keys(n.config)) for n in graph.nodes.values()]
                fitting = [f.name for f in BUILT_IN if all(keys <= set(f.held) for keys in reads)]
                raise ConfigError(
                    f"train.data.format={self.name} gives the columns {', '.join(self.held)} but {node.name} "
                    f"(kind {node.kind.name}) reads {', '.join(missing)}; "
                    + (f"choose train.data.format={' or '.join(fitting)}" if fitting else
                       "no built-in dataset has every column these modules read: bring your own data "
                       "(train.data.format=llava, webdataset, text, or a registered format)")
                )
        for key in self.sized_by:
            reader(graph, key, self.name)

    def shard_sets(self, experiment: ExperimentConfig, graph: Graph) -> list[ShardSet]:
        return []

    def prepare(self, experiment: ExperimentConfig, graph: Graph, source: SourceConfig) -> None:
        """Write the missing shard sets and reuse those already there; a directory that holds something
        else is a ``ConfigError`` naming the field that chose it and what it holds."""
        for shard_set in self.shard_sets(experiment, graph):
            try:
                shard_set.ensure()
            except (ShardError, FileExistsError) as err:
                root = getattr(experiment.train, shard_set.field)
                raise ConfigError(f"train.{shard_set.field}={root}: {err}") from err


def _digit_set(experiment: ExperimentConfig) -> ShardSet:
    cfg = experiment.train
    return ShardSet("data_dir", Path(cfg.data_dir), lambda: ensure_digit_shards(cfg.data_dir))


def _genome_set(experiment: ExperimentConfig, graph: Graph, fmt: str) -> ShardSet:
    window = reader(graph, "dna", fmt).config.seq_len
    path = genome_shards(experiment.train.genome_dir, window)
    return ShardSet("genome_dir", path, lambda: ensure_genome_shards(path, GenomeOptions(window=window)))


def _clip_set(experiment: ExperimentConfig, graph: Graph, fmt: str) -> ShardSet:
    """The clips' shard set under ``train.clip_dir`` (one per shape and seed)."""
    frame_size = reader(graph, "clips", fmt).config.frame_size
    options = graph_clip_options(frame_size) if fmt == "multimodal" else ClipOptions(size=frame_size)
    path = video_shards(experiment.train.clip_dir, CLIPS["train"], CLIPS["heldout"], options, experiment.seed)
    return ShardSet("clip_dir", path, lambda: ensure_video_shards(path, CLIPS["train"], CLIPS["heldout"], options,
                                                                  experiment.seed))


class Digits(Samples, BuiltIn):
    """The digits: whole batches of fixed columns, or, in a mixture, conversations about each digit
    (``digit_conversations``) that the mixture shapes as it does users' samples."""

    name, held, sized_by = "digits", _DIGITS, ("tokens",)

    def shard_sets(self, experiment, graph):
        return [_digit_set(experiment)]

    def columns(self, experiment, graph, source):
        if experiment.train.data.mixture:
            return self.shaper(experiment, graph).columns(experiment.train.data.pack)
        return super().columns(experiment, graph, source)

    def check(self, experiment, graph, source):
        if experiment.train.data.mixture:
            return DataFormat.check(self, experiment, graph, source)
        return super().check(experiment, graph, source)

    def split(self, experiment, config, split):
        return DigitConversations(experiment.train.data_dir, split, experiment.train.data.caption_prompt,
                                  experiment.train.bad_shards)

    def prepare(self, experiment, graph, source):
        super().prepare(experiment, graph, source)
        if experiment.train.data.mixture:
            self.index_splits(experiment, graph, source)

    def load(self, experiment, graph, source, split) -> Batches:
        cfg, size, seed = experiment.train, experiment.batch.global_batch_size, experiment.seed
        llm = reader(graph, "tokens", self.name)
        placeholders, seq_len = _placeholders(graph, llm), llm.config.seq_len
        if cfg.stream_buffer and split == "train":
            return ShardStream(cfg.data_dir, split, size,
                               lambda samples: digit_columns(samples, placeholders, seq_len, split),
                               seed=seed, buffer=cfg.stream_buffer)
        return DigitBatches(cfg.data_dir, split, size, placeholders, seq_len, seed, cfg.bad_shards)


class DigitsDna(BuiltIn):
    name, held, sized_by = "digits_dna", _DIGITS + _DNA, ("tokens", "dna")

    def shard_sets(self, experiment, graph):
        return [_digit_set(experiment), _genome_set(experiment, graph, self.name)]

    def load(self, experiment, graph, source, split) -> Batches:
        cfg, llm = experiment.train, reader(graph, "tokens", self.name)
        return DigitDnaBatches(cfg.data_dir, _genome_set(experiment, graph, self.name).path, split,
                               experiment.batch.global_batch_size, _placeholders(graph, llm, "image"),
                               _placeholders(graph, llm, "dna"), llm.config.seq_len, experiment.seed, cfg.bad_shards)


class Multimodal(BuiltIn):
    name, sized_by = "multimodal", ("tokens", "dna", "clips")
    held = _DIGITS + _DNA + ("clips", "clip_index", "has_image", "has_dna", "has_clip")

    def shard_sets(self, experiment, graph):
        return [_digit_set(experiment), _genome_set(experiment, graph, self.name),
                _clip_set(experiment, graph, self.name)]

    def load(self, experiment, graph, source, split) -> Batches:
        cfg, llm = experiment.train, reader(graph, "tokens", self.name)
        return MultimodalBatches(cfg.data_dir, _genome_set(experiment, graph, self.name).path,
                                 _clip_set(experiment, graph, self.name).path, split,
                                 experiment.batch.global_batch_size, _placeholders(graph, llm, "image"),
                                 _placeholders(graph, llm, "dna"), llm.config.seq_len, experiment.seed,
                                 cfg.presence, cfg.bad_shards)


class Clips(BuiltIn):
    name, held, sized_by = "video_clips", ("clips", "revisit", "scene", "index"), ("clips",)

    def shard_sets(self, experiment, graph):
        return [_clip_set(experiment, graph, self.name)]

    def load(self, experiment, graph, source, split) -> Batches:
        clips = VideoClips(_clip_set(experiment, graph, self.name).path, split, experiment.batch.global_batch_size,
                           experiment.seed)
        return clips.renamed({"frames": "clips"})


class Genome(BuiltIn):
    name, held, sized_by = "genome", ("dna", "dna_regions"), ("dna",)

    def shard_sets(self, experiment, graph):
        return [_genome_set(experiment, graph, self.name)]

    def load(self, experiment, graph, source, split) -> Batches:
        windows = GenomeWindows(_genome_set(experiment, graph, self.name).path, split,
                                experiment.batch.global_batch_size, experiment.seed)
        return windows.renamed({"bases": "dna", "regions": "dna_regions"})


class StdlibText(BuiltIn):
    name, held, sized_by = "stdlib_text", ("tokens", "labels", "index"), ("tokens",)

    def check(self, experiment, graph, source) -> None:
        super().check(experiment, graph, source)
        llm = reader(graph, "tokens", self.name)
        tokenizer = tokenizer_of(llm)
        if tokenizer is not None:
            from tokenizers import Tokenizer

            size = Tokenizer.from_file(str(tokenizer)).get_vocab_size(with_added_tokens=True)
            if size > llm.config.vocab_size:
                raise ConfigError(f"{tokenizer} has {size} tokens but {llm.name}.model.vocab_size="
                                  f"{llm.config.vocab_size}; use the tokenizer that came with the weights")

    def load(self, experiment, graph, source, split) -> Batches:
        llm = reader(graph, "tokens", self.name)
        return TextWindows(split, experiment.batch.global_batch_size, llm.config.seq_len, experiment.seed,
                           tokenizer_of(llm))


class PhotoDocumentRows(BuiltIn):
    name, sized_by = "photo_documents", ("tokens", "image_patches")
    held = ("tokens", "labels", "documents", "image_patches", "image_grid", "image_row", "image_start", "index")

    def load(self, experiment, graph, source, split) -> Batches:
        llm, vision = reader(graph, "tokens", self.name), reader(graph, "image_patches", self.name).config
        return PhotoDocuments(split, experiment.batch.global_batch_size, llm.config.seq_len, vision.patch_size,
                              vision.max_patches, vision.channels, experiment.seed)


BUILT_IN: tuple[BuiltIn, ...] = (Digits(), DigitsDna(), Multimodal(), Clips(), Genome(), StdlibText(),
                                 PhotoDocumentRows())
