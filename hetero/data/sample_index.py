"""What each sample of a source holds, read once from its text and its images' headers, kept on disk
beside the data.

For sample ``i``: its text tokens (the chat template's rendering with every image and video item taking no
position), its supervised labels (the assistant's next tokens, which no placeholder is), and its items in
text order: where each one's placeholders begin among the text tokens, an image's height and width from
its header, a video item's size once resized, its temporal patches and temporal position step (from the
video's header and the video pipeline, ``hetero.data.videos``); or
why it is bad (``SampleError``: a missing file, an unreadable header, markers that do not match the
images, an unknown role). Its length and its images' placeholders under any vision module follow from
these without reading the sample again (``Shaper.plan``), so packing and the bad samples are planned
from the index alone, the same on every rank.

The index is a file beside the data (``.hetero-index/<source>-<key>.pt`` in the directory of the source's
first file, or ``$HETERO_CACHE_DIR`` where that directory cannot be written), written atomically. Its key
hashes what it was read with (the tokenizer's files, the image token, the caption prompt) and every file
it read (path, size, modification time: the JSON or tar files and the images they name), so a file that
changes, appears or goes makes a new one.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from hetero.data.chat import VideoText
from hetero.data.images import header_size
from hetero.data.samples import SampleError, SampleSource
from hetero.data.videos import VideoPipeline

INDEX_DIR = ".hetero-index"


@dataclass
class SampleIndex:
    text_tokens: torch.Tensor  # (samples,) tokens of each sample's text
    label_tokens: torch.Tensor  # (samples,) its next-token labels that carry a loss
    image_offsets: torch.Tensor  # (samples + 1,) sample i's items are rows offsets[i]..offsets[i+1] of those below
    image_text_starts: torch.Tensor  # (items,) the text tokens before each item's placeholders
    image_sizes: torch.Tensor  # (items, 2) height, width: an image's from its header, a video item's resized
    image_frames: torch.Tensor  # (items,) 0 for an image, a video item's temporal patches
    image_time_steps: torch.Tensor  # (items,) float: a video item's temporal position step (else 1)
    bad: dict[int, str]  # sample -> why it cannot be trained on

    def images(self, sample: int) -> slice:
        return slice(int(self.image_offsets[sample]), int(self.image_offsets[sample + 1]))


Item = tuple[int, int, int, float]  # height, width, frames, time step


def _entry(source: SampleSource, index: int, tokenizer, videos: VideoPipeline | None
           ) -> tuple[int, int, list[int], list[Item]]:
    sample = source.sample(index)
    sample.check()
    sizes = []
    for ref in sample.images:
        size = header_size(ref.path if ref.path is not None and ref.span is None else ref.read(sample.where))
        if size is None:
            if ref.path is not None and not ref.path.is_file():
                ref.read(sample.where)  # names the missing file
            raise SampleError(f"{sample.where} image {ref.name}: not a readable image (its header)")
        sizes.append((size[1], size[0]))
    if sample.videos and videos is None:
        raise SampleError(f"{sample.where}: it holds {len(sample.videos)} videos but no module of the graph reads "
                          f"videos (a Qwen-VL tower)")
    layouts = [videos.place(ref, sample.where) for ref in sample.videos]
    try:
        encoded = tokenizer.encode_chat(sample.turns, [1] * len(sample.images),
                                        [VideoText((1,) * layout.items, layout.stamps) for layout in layouts])
    except ValueError as err:
        raise SampleError(f"{sample.where}: {err}") from None
    items = [(start, (*size, 0, 1.0)) for start, size in zip(encoded.image_starts, sizes)]
    items += [(start, (*layout.size, layout.item_patches, layout.time_step))
              for layout, starts in zip(layouts, encoded.video_starts) for start in starts]
    items.sort(key=lambda item: item[0])
    starts = [start - k for k, (start, _) in enumerate(items)]
    return len(encoded.tokens) - len(items), sum(encoded.assistant[1:]), starts, [item for _, item in items]


def build_index(source: SampleSource, tokenizer, videos: VideoPipeline | None = None) -> SampleIndex:
    tokens, labels, offsets, starts, items, bad = [], [], [0], [], [], {}
    for index in range(len(source)):
        try:
            count, supervised, item_starts, sample_items = _entry(source, index, tokenizer, videos)
        except SampleError as err:
            count, supervised, item_starts, sample_items = 0, 0, [], []
            bad[index] = str(err)
        tokens.append(count)
        labels.append(supervised)
        starts += item_starts
        items += sample_items
        offsets.append(len(starts))
    return SampleIndex(torch.tensor(tokens, dtype=torch.long), torch.tensor(labels, dtype=torch.long),
                       torch.tensor(offsets, dtype=torch.long), torch.tensor(starts, dtype=torch.long),
                       torch.tensor([item[:2] for item in items], dtype=torch.long).reshape(-1, 2),
                       torch.tensor([item[2] for item in items], dtype=torch.long),
                       torch.tensor([item[3] for item in items], dtype=torch.float64), bad)


def _key(source: SampleSource, reader: str) -> str:
    digest = hashlib.sha256(reader.encode())
    for path in source.files():
        stat = path.stat()
        digest.update(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:20]


def _location(source: SampleSource, key: str) -> Path:
    name = f"{Path(source.name).name or 'source'}-{key}.pt"
    home = source.files()[0].parent / INDEX_DIR
    try:
        home.mkdir(exist_ok=True)
        if os.access(home, os.W_OK):
            return home / name
    except OSError:
        pass
    return Path(os.environ.get("HETERO_CACHE_DIR", Path.home() / ".cache" / "hetero")) / INDEX_DIR / name


def sample_index(source: SampleSource, tokenizer, reader: str, videos: VideoPipeline | None = None) -> SampleIndex:
    """The index of ``source`` read with ``tokenizer`` and ``videos`` (``reader``: what else shaped it, for
    the key): from its file when one for these files exists, else built and written."""
    path = _location(source, _key(source, reader + tokenizer.fingerprint() + repr(videos)))
    try:
        return SampleIndex(**torch.load(path, weights_only=True))
    except (OSError, RuntimeError, EOFError, TypeError, KeyError):
        pass  # not written yet (or by another version): built below
    index = build_index(source, tokenizer, videos)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(vars(index), f)
        os.replace(partial, path)  # several processes may build it at once: each renames its own, one wins
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    return index
