"""Samples into the rows a graph reads: tokenized by the LLM's tokenizer, images preprocessed for the
vision module, one sample per row or several packed into one (``train.data.pack``).

A conversation becomes its chat-template tokens (``hetero.data.chat``), each ``<image>`` the
placeholder tokens of its image: the vision module's ``num_patches`` for a fixed-size encoder, or the
image's own patch grid at native resolution (``max_patches``). Labels are the next tokens where those
are the assistant's, ``IGNORE_INDEX`` elsewhere. A sample longer than the LLM's ``seq_len`` follows
``train.data.too_long``: error, truncate (images past the cut are dropped with their placeholders) or
skip; ``plan`` finds the positions a sample keeps from its index entry (``hetero.data.sample_index``: its
text tokens and its images' headers), so that samples can be packed before they are read. Rows are padded to ``seq_len``.

Columns: ``tokens``, ``labels`` (rows, seq_len), ``index`` (rows,), ``documents`` (rows, seq_len) for
packed rows (each position's sample in its row; attention stays inside it), ``rope_positions`` (rows, 3,
seq_len) for an LLM with M-RoPE (``hetero.data.mrope_positions``: each image a span of its merged grid,
positions restarting per document), and
the vision module's items: ``image_pixels`` (images, channels, size, size) for a fixed-size encoder
(``model.items``), ``image_patches``/``image_grid`` at native resolution (a Qwen tower's: the processor's
patches in merge-block order and (t, h, w) grids, one placeholder per merge block), with ``image_row`` and
``image_start`` (the row and the first placeholder of each image).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hetero.data.chat import IMAGE_MARKER, ChatTokenizer, VideoText
from hetero.data.digits import IGNORE_INDEX
from hetero.data.images import BICUBIC, ImageError, ImagePipeline, has_image_processor, qwen_patches
from hetero.data.mrope_positions import VisionSpan, mrope_positions
from hetero.data.native_images import patchify
from hetero.data.sample_index import INDEX_DIR, SampleIndex
from hetero.data.samples import ImageRef, Sample, SampleError, VideoRef
from hetero.data.videos import VideoLayout, VideoPipeline, decode
from hetero.errors import ConfigError
from hetero.graph.graph import Graph, Node
from hetero.interop.llava import image_token_text
from hetero.kinds.batch_rows import held_key

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
QWEN25_TOKENS_PER_SECOND = 4  # transformers' Qwen2_5_VLVisionConfig default


class SampleSkipped(Exception):
    """A sample ``too_long: skip`` leaves out."""


@dataclass
class Picture:
    """An image or a video item of a sample: its shape after preprocessing (channels, H, W), and its pixels
    (``read``: decoded now, or when first read, by a loader that decodes only the images its rank's modules
    take); a video item's temporal patches and temporal position step."""

    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]
    frames: int = 1
    time_step: float = 1.0


@dataclass
class Document:
    """One sample as a row's content: its length in next-token pairs, its images (first placeholder,
    picture), how many of its labels carry a loss, and its tokens and labels (``text``: made now, or, for
    a document planned from the sample index, when a rank whose modules read its row first asks)."""

    length: int
    images: list[tuple[int, Picture]]
    label_count: int
    text: Callable[[], tuple[torch.Tensor, torch.Tensor]]


def readers(graph: Graph) -> tuple[Node, Node | None]:
    """The LLM (the module reading ``tokens``) and the vision module reading image items, if any."""
    llm = next((n for n in graph.nodes.values() if "tokens" in n.kind.data_keys(n.config)), None)
    if llm is None:
        raise ConfigError(f"conversations and captions train a module that reads tokens; none of "
                          f"{', '.join(graph.nodes)} does (add an LLM, e.g. kind gpt)")
    vision = None
    for node in graph.nodes.values():
        keys = node.kind.data_keys(node.config)
        if "images" in keys:
            raise ConfigError(f"{node.name} reads one image per row at fixed positions; users' samples hold any "
                              f"number of images anywhere in the text: set {node.name}.model.items=true")
        if "image_pixels" in keys or "image_patches" in keys:
            vision = node
    return llm, vision


def tokenizer_dir(llm: Node) -> Path | None:
    """The LLM's ``init.hf`` directory when it holds a tokenizer (else bytes)."""
    hf = llm.settings.init.hf
    if hf is not None and any((Path(hf) / name).is_file() for name in TOKENIZER_FILES):
        return Path(hf)
    return None


def image_pipeline(vision: Node) -> ImagePipeline:
    """The vision module's preprocessing: its checkpoint's ``preprocessor_config.json`` when imported
    with one, else from its config (``ImagePipeline.for_vision``)."""
    config, hf = vision.config, vision.settings.init.hf
    if config.qwen:
        return _qwen_pipeline(vision)
    native = dict(patch_size=config.patch_size, max_patches=config.max_patches) if config.max_patches else {}
    if hf is not None and has_image_processor(hf):
        pipeline = dataclasses.replace(ImagePipeline.from_hf(hf), **native)
        size = pipeline.crop or pipeline.size
        if not config.max_patches and tuple(size) != (config.image_size, config.image_size):
            raise ConfigError(f"{vision.name}: {hf}'s image processor makes {size[0]}×{size[1]} images but "
                              f"{vision.name}.model.image_size={config.image_size}")
        return pipeline
    return ImagePipeline.for_vision(config.image_size, config.channels, config.patch_size, config.max_patches)


def _qwen_pipeline(vision: Node) -> ImagePipeline:
    """A Qwen tower's processor: its checkpoint's, else one of its sizes (within merge blocks up to
    ``max_patches``, mean and std 0.5); refused when it disagrees with the tower or makes larger images."""
    config, hf = vision.config, vision.settings.init.hf
    if hf is not None and has_image_processor(hf):
        pipeline = ImagePipeline.from_hf(hf)
        if not pipeline.qwen:
            raise ConfigError(f"{vision.name}: {hf}'s image processor is not a Qwen-VL processor, which the "
                              f"{config.tower} tower takes")
    else:
        block = config.merge * config.patch_size
        pipeline = ImagePipeline(size=None, shortest_edge=None, crop=None, resample=BICUBIC, rescale=1 / 255,
                                 mean=(0.5,) * config.channels, std=(0.5,) * config.channels, channels=config.channels,
                                 patch_size=config.patch_size, min_pixels=block * block,
                                 max_pixels=config.max_patches * config.patch_size**2, merge=config.merge,
                                 temporal_patch=config.temporal_patch)
    made = (pipeline.patch_size, pipeline.merge, pipeline.temporal_patch)
    if made != (config.patch_size, config.merge, config.temporal_patch):
        raise ConfigError(f"{vision.name}: the image processor cuts patches of {made[0]} pixels, merges {made[1]}x"
                          f"{made[1]} and repeats {made[2]} frames, but {vision.name}.model has patch_size="
                          f"{config.patch_size}, merge={config.merge}, temporal_patch={config.temporal_patch}")
    if pipeline.max_pixels // pipeline.patch_size**2 > config.max_patches:
        raise ConfigError(f"{vision.name}: the image processor makes images of up to "
                          f"{pipeline.max_pixels // pipeline.patch_size**2} patches, more than {vision.name}.model."
                          f"max_patches={config.max_patches}; raise it")
    return pipeline


def video_pipeline(vision: Node) -> VideoPipeline:
    """A Qwen tower's video processor: its checkpoint's, else its family's defaults at the tower's sizes;
    Qwen2.5-VL's ``tokens_per_second`` from the checkpoint's vision config."""
    config, hf = vision.config, vision.settings.init.hf
    vision_config = {}
    if hf is not None and (Path(hf) / "config.json").is_file():
        vision_config = json.loads((Path(hf) / "config.json").read_text()).get("vision_config") or {}
    try:
        pipeline = VideoPipeline.from_hf(hf, config.tower, vision_config.get("tokens_per_second", QWEN25_TOKENS_PER_SECOND))
    except ValueError as err:
        raise ConfigError(f"{vision.name}: {err}") from None
    if hf is None or not has_image_processor(hf):
        block = config.merge * config.patch_size
        pipeline = dataclasses.replace(pipeline, patch_size=config.patch_size, merge=config.merge,
                                       temporal_patch=config.temporal_patch, min_pixels=block * block,
                                       max_pixels=config.max_patches * config.patch_size**2,
                                       mean=(0.5,) * config.channels, std=(0.5,) * config.channels)
    made = (pipeline.patch_size, pipeline.merge, pipeline.temporal_patch)
    if made != (config.patch_size, config.merge, config.temporal_patch):
        raise ConfigError(f"{vision.name}: the video processor cuts patches of {made[0]} pixels, merges {made[1]}x"
                          f"{made[1]} and groups {made[2]} frames, but {vision.name}.model has patch_size="
                          f"{config.patch_size}, merge={config.merge}, temporal_patch={config.temporal_patch}")
    return pipeline


class Shaper:
    """Samples to documents and documents to batches, for one graph."""

    def __init__(self, graph: Graph, image_token: str | None, too_long: str):
        self.llm, self.vision = readers(graph)
        self.seq_len, self.too_long = self.llm.config.seq_len, too_long
        hf = self.llm.settings.init.hf
        self.tokenizer = ChatTokenizer(tokenizer_dir(self.llm), image_token or (image_token_text(hf) if hf else None))
        vocab = self.llm.config.vocab_size
        if self.tokenizer.vocab_size > vocab:
            raise ConfigError(f"{self.llm.name}'s tokenizer has {self.tokenizer.vocab_size} tokens, more than "
                              f"{self.llm.name}.model.vocab_size={vocab}; raise it to {self.tokenizer.vocab_size}")
        self.pipeline = image_pipeline(self.vision) if self.vision is not None else None
        self.videos = video_pipeline(self.vision) if self.vision is not None and self.vision.config.qwen else None
        self.mrope = bool(self.llm.config.mrope_sections)
        self.pad_id = self.tokenizer.eos_id if self.tokenizer.eos_id is not None else 0
        self.decoded = self.bytes_read = self.tokenized = 0  # images decoded so far, their bytes, samples tokenized

    def image_tokens(self, picture: Picture) -> int:
        config = self.vision.config
        if config.qwen:  # one per merge block
            return self.placeholders(picture.shape[1], picture.shape[2], picture.frames)
        if config.max_patches:
            return (picture.shape[1] // config.patch_size) * (picture.shape[2] // config.patch_size)
        return config.feature_tokens

    def images(self, sample: Sample, sizes: list[tuple[int, int]] | None = None) -> list[Picture]:
        """``sample``'s pictures: decoded now, or, given each image's (height, width) from the sample index,
        shaped from those and decoded when read; ``SampleError`` for an image that cannot be read."""
        if sample.images and self.pipeline is None:
            raise SampleError(f"{sample.where}: it holds {len(sample.images)} images but no module of the graph "
                              f"reads images")
        pictures = []
        for k, ref in enumerate(sample.images):
            read = functools.partial(self._decode, ref, sample.where)
            if sizes is None:
                pixels = read()
                pictures.append(Picture(tuple(pixels.shape), lambda pixels=pixels: pixels))
                continue
            height, width = self.pipeline.output_size(*sizes[k])
            pictures.append(Picture((self.vision.config.channels, height, width), read))
        return pictures

    def video_items(self, sample: Sample) -> list[tuple[VideoLayout, list[Picture]]]:
        """``sample``'s videos: each one's layout (from its header) and items, decoded when first read."""
        if sample.videos and self.videos is None:
            raise SampleError(f"{sample.where}: it holds {len(sample.videos)} videos but no module of the graph reads "
                              f"videos (a Qwen-VL tower)")
        out = []
        for ref in sample.videos:
            layout = self.videos.place(ref, sample.where)
            pixels = functools.cache(functools.partial(self._decode_video, ref, layout, sample.where))
            shape = (self.vision.config.channels, *layout.size)
            if layout.items == 1:
                out.append((layout, [Picture(shape, pixels, layout.item_patches, layout.time_step)]))
                continue
            step = self.videos.temporal_patch
            out.append((layout, [Picture(shape, lambda k=k, pixels=pixels: pixels()[k * step:(k + 1) * step])
                                 for k in range(layout.items)]))
        return out

    def _decode_video(self, ref: VideoRef, layout: VideoLayout, where: str) -> torch.Tensor:
        pixels = self.videos(decode(ref, list(layout.indices), where))
        if tuple(pixels.shape[2:]) != layout.size:
            raise SampleError(f"{where}: video {ref.name}'s frames are not the size its header gives")
        self.decoded += 1
        return pixels

    def _decode(self, ref: ImageRef, where: str) -> torch.Tensor:
        data = ref.read(where)
        try:
            pixels = self.pipeline(self.pipeline.decode(data, f"{where} image {ref.name}"))
        except ImageError as err:
            raise SampleError(str(err)) from None
        self.decoded, self.bytes_read = self.decoded + 1, self.bytes_read + len(data)
        return pixels

    def encode(self, sample: Sample, sizes: list[tuple[int, int]] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, Picture]]]:
        """The sample's tokens, their next-token labels (one fewer) and its pictures at their first
        placeholders, whatever its length (``sizes``: see ``images``); ``SampleError`` if it is bad."""
        sample.check()
        images, videos = self.images(sample, sizes), self.video_items(sample)
        self.tokenized += 1
        try:
            encoded = self.tokenizer.encode_chat(
                sample.turns, [self.image_tokens(i) for i in images],
                [VideoText(tuple(self.image_tokens(p) for p in items), layout.stamps) for layout, items in videos])
        except ValueError as err:
            raise SampleError(f"{sample.where}: {err}") from None
        tokens = torch.tensor(encoded.tokens, dtype=torch.long)
        supervised = torch.tensor(encoded.assistant, dtype=torch.bool)
        labels = torch.where(supervised[1:], tokens[1:], IGNORE_INDEX)
        placed = list(zip(encoded.image_starts, images))
        placed += [pair for starts, (_, items) in zip(encoded.video_starts, videos) for pair in zip(starts, items)]
        return tokens, labels, sorted(placed, key=lambda pair: pair[0])

    def _fit(self, where: Callable[[], str], length: int, images: list[tuple[int, int]]) -> int:
        """Positions the sample keeps under ``too_long`` (``images``: first placeholder, count)."""
        if length <= self.seq_len:
            return length
        if self.too_long == "error":
            raise SampleError(f"{where()}: {length} positions with its images' placeholders, more than "
                              f"{self.llm.name}.model.seq_len={self.seq_len}; raise it, or set "
                              f"train.data.too_long=truncate or skip")
        if self.too_long == "skip":
            raise SampleSkipped(where())
        cut = self.seq_len
        for start, count in images:  # never through an image: cut before it
            if start < cut < start + count:
                cut = start
        return cut

    def placeholders(self, height: int, width: int, frames: int = 0) -> int:
        """An image's placeholder tokens, from its size before preprocessing; a video item's (``frames``
        temporal patches) from its size after."""
        config = self.vision.config
        if not config.max_patches:
            return config.feature_tokens
        rows, cols = self.pipeline.output_size(height, width) if not frames else (height, width)
        tokens = (rows // config.patch_size) * (cols // config.patch_size) // (config.merge**2 if config.qwen else 1)
        return tokens * max(frames, 1)

    def _placed(self, index: SampleIndex, sample: int, where: Callable[[], str]) -> tuple[int, list[tuple[int, int]]]:
        """Sample ``sample``'s length in next-token pairs and its images' (first placeholder, count), whole,
        from ``index`` alone."""
        if sample in index.bad:
            raise SampleError(index.bad[sample])
        sizes = index.image_sizes[index.images(sample)].tolist()
        if sizes and self.vision is None:
            raise SampleError(f"{where()}: it holds {len(sizes)} images but no module of the graph reads images")
        frames = index.image_frames[index.images(sample)].tolist()
        counts = [self.placeholders(height, width, f) for (height, width), f in zip(sizes, frames)]
        text_starts = index.image_text_starts[index.images(sample)].tolist()
        starts = [start + sum(counts[:k]) for k, start in enumerate(text_starts)]
        return int(index.text_tokens[sample]) + sum(counts) - 1, list(zip(starts, counts))

    def plan(self, index: SampleIndex, sample: int, where: Callable[[], str]) -> int:
        """The positions sample ``sample`` of ``index``'s source keeps, from the index alone (for packing);
        ``SampleError`` if it is bad, ``SampleSkipped`` if it is too long under ``too_long: skip``."""
        return self._fit(where, *self._placed(index, sample, where))

    def planned(self, index: SampleIndex, sample_id: int, sample: Sample) -> Document:
        """Sample ``sample_id`` of ``index``'s source (``sample``) as a document shaped from the index: its
        length, image places and label count known now, its text tokenized and its images decoded only
        when read. Errors as ``document``."""
        full, placed = self._placed(index, sample_id, lambda: sample.where)
        cut = self._fit(lambda: sample.where, full, placed)
        rows = index.images(sample_id)
        sizes = [tuple(size) for size, f in zip(index.image_sizes[rows].tolist(), index.image_frames[rows].tolist()) if not f]
        images, videos = iter(self.images(sample, sizes)), iter(self.video_items(sample))
        pictures = [picture for marker in sample.markers()
                    for picture in ([next(images)] if marker == IMAGE_MARKER else next(videos)[1])]
        kept = [(start, picture) for (start, count), picture in zip(placed, pictures) if start + count <= cut]
        text = functools.partial(self._text, sample, sizes, cut)
        label_count = int(index.label_tokens[sample_id]) if cut == full else int((text()[1] != IGNORE_INDEX).sum())
        return Document(cut, kept, label_count, text)

    def _text(self, sample: Sample, sizes: list[tuple[int, int]], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        document = self.document(sample, sizes)
        if document.length != length:
            raise SampleError(f"{sample.where}: {document.length} positions tokenized but {length} in the sample "
                              f"index; the data changed since it was indexed (delete its {INDEX_DIR} directory)")
        return document.text()

    def document(self, sample: Sample, sizes: list[tuple[int, int]] | None = None) -> Document:
        """``sample`` tokenized, its images preprocessed (or, given their ``sizes``, to be decoded when read);
        ``SampleError`` if it is bad, ``SampleSkipped`` if it is too long under ``too_long: skip``."""
        tokens, labels, placed = self.encode(sample, sizes)
        cut = self._fit(lambda: sample.where, len(tokens) - 1, [(s, self.image_tokens(i)) for s, i in placed])
        placed = [(s, i) for s, i in placed if s + self.image_tokens(i) <= cut]
        tokens, labels = tokens[:cut], labels[:cut]
        return Document(cut, placed, int((labels != IGNORE_INDEX).sum()), lambda: (tokens, labels))

    def empty(self) -> Document:
        nothing = torch.zeros(0, dtype=torch.long)
        return Document(0, [], 0, lambda: (nothing, nothing))

    def batch(self, rows: list[list[Document]], index: torch.Tensor, packed: bool,
              reads: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]] | None = None
              ) -> dict[str, torch.Tensor]:
        """The columns of ``rows``, each a list of documents laid end to end (``packed``: with ``documents``,
        each position's document in its row, the padding one of its own), and ``label_counts``, each row's
        labels that carry a loss. ``reads``: the rows and items this rank's modules take, from the batch's
        bookkeeping (``hetero.runtime.rows.RankReads``): a compact batch (``hetero.kinds.batch_rows``) of
        those rows alone, tokenized, and those images alone, read, their numbers in ``image_held`` (None:
        every row and image)."""
        length = self.seq_len
        label_counts = torch.zeros(len(rows), dtype=torch.long)
        row_of, starts, images = [], [], []
        for r, row in enumerate(rows):
            offset = 0
            for doc in row:
                label_counts[r] += doc.label_count
                for start, image in doc.images:
                    row_of.append(r)
                    starts.append(offset + start)
                    images.append(image)
                offset += doc.length
        places = {"index": index.long()}
        if self.vision is not None:
            places |= {"image_row": torch.tensor(row_of, dtype=torch.long),
                       "image_start": torch.tensor(starts, dtype=torch.long)}
            config = self.vision.config
            if config.max_patches:
                grids = [(p.shape[1] // config.patch_size, p.shape[2] // config.patch_size) for p in images]
                grids = [(p.frames, *grid) for p, grid in zip(images, grids)] if config.qwen else grids
                places["image_grid"] = torch.tensor(grids, dtype=torch.long).reshape(-1, 3 if config.qwen else 2)
        text = ("tokens", "labels") + (("documents",) if packed else ()) + (("rope_positions",) if self.mrope else ())
        if reads is None:
            held_rows, held = torch.arange(len(rows)), None
        else:
            by_column, held = reads(places, self.columns(packed))
            held_rows = torch.unique(torch.cat([by_column.get(key, torch.zeros(0, dtype=torch.long)) for key in text]))
        tokens = torch.full((len(held_rows), length), self.pad_id, dtype=torch.long)
        labels = torch.full((len(held_rows), length), IGNORE_INDEX, dtype=torch.long)
        documents = torch.zeros(len(held_rows), length, dtype=torch.long)
        rope = torch.zeros(len(held_rows), 3, length, dtype=torch.long, device="cpu") if self.mrope else None
        for h, r in enumerate(held_rows.tolist()):
            if rope is not None:
                rope[h] = self._rope_positions(rows[r], packed)
            offset = 0
            for d, doc in enumerate(rows[r]):
                tokens[h, offset : offset + doc.length], labels[h, offset : offset + doc.length] = doc.text()
                documents[h, offset : offset + doc.length] = d
                offset += doc.length
            documents[h, offset:] = len(rows[r])
        batch = {"tokens": tokens, "labels": labels, "index": places.pop("index")}
        batch |= ({"documents": documents} if packed else {}) | {"label_counts": label_counts} | places
        batch |= {"rope_positions": rope} if rope is not None else {}
        if reads is not None:
            flags = torch.zeros(len(rows), dtype=torch.bool)
            flags[held_rows] = True
            batch |= {held_key(key): flags for key in text}
        if self.vision is None:
            return batch
        if held is None:
            return batch | self._items([p.read() for p in images])
        return batch | self._items([images[i].read() for i in held.tolist()]) | {"image_held": held}

    def _rope_positions(self, row: list[Document], packed: bool) -> torch.Tensor:
        """M-RoPE's positions of a row: each image and video item a span of its merged grid; with
        ``packed``, restarting in every document and in the padding after them."""
        merge = self.vision.config.merge if self.vision is not None else 1
        spans, starts, offset = [], [0], 0
        for doc in row:
            for start, picture in doc.images:
                height, width = picture.shape[1] // self.vision.config.patch_size, picture.shape[2] // self.vision.config.patch_size
                spans.append(VisionSpan(offset + start, (picture.frames, height // merge, width // merge),
                                        picture.time_step))
            offset += doc.length
            starts.append(offset)
        starts = sorted({s for s in starts[:-1] + ([offset] if offset < self.seq_len else [])}) if packed else [0]
        return mrope_positions(self.seq_len, spans, starts)

    def _items(self, images: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        config = self.vision.config
        if config.qwen:
            patches = [qwen_patches(i, config.patch_size, config.merge, config.temporal_patch)[0] for i in images]
            return {"image_patches": torch.cat(patches) if patches else torch.zeros(0, config.patch_values, device="cpu")}
        if not config.max_patches:
            size = config.image_size
            return {"image_pixels": torch.stack(images) if images else torch.zeros(0, config.channels, size, size)}
        p = config.patch_size
        patches = [patchify(i, p) for i in images]
        return {"image_patches": torch.cat(patches) if patches else torch.zeros(0, config.channels * p * p)}

    def columns(self, packed: bool) -> tuple[str, ...]:
        held = ("tokens", "labels", "index") + (("documents",) if packed else ()) + ("label_counts",)
        held += ("rope_positions",) if self.mrope else ()
        if self.vision is None:
            return held
        items = ("image_pixels",) if not self.vision.config.max_patches else ("image_patches", "image_grid")
        return held + items + ("image_row", "image_start")
