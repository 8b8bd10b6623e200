"""What each sample of a source holds, read once from its text and its images' headers, kept on disk
beside the data.

For sample ``i``: its text tokens (the chat template's rendering with every image taking no position),
its supervised labels (the assistant's next tokens, which no image placeholder is), where each image's placeholders begin among them, and each image's height and width from its header; or
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

from hetero.data.images import header_size
from hetero.data.samples import SampleError, SampleSource

INDEX_DIR = ".hetero-index"


@dataclass
class SampleIndex:
    text_tokens: torch.Tensor  # (samples,) tokens of each sample's text
    label_tokens: torch.Tensor  # (samples,) its next-token labels that carry a loss
    image_offsets: torch.Tensor  # (samples + 1,) sample i's images are rows offsets[i]..offsets[i+1] of the two below
    image_text_starts: torch.Tensor  # (images,) the text tokens before each image's placeholders
    image_sizes: torch.Tensor  # (images, 2) height, width from each image's header
    bad: dict[int, str]  # sample -> why it cannot be trained on

    def images(self, sample: int) -> slice:
        return slice(int(self.image_offsets[sample]), int(self.image_offsets[sample + 1]))


def _entry(source: SampleSource, index: int, tokenizer) -> tuple[int, int, list[int], list[tuple[int, int]]]:
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
    try:
        encoded = tokenizer.encode_chat(sample.turns, [1] * len(sample.images))
    except ValueError as err:
        raise SampleError(f"{sample.where}: {err}") from None
    starts = [start - k for k, start in enumerate(encoded.image_starts)]
    return len(encoded.tokens) - len(sample.images), sum(encoded.assistant[1:]), starts, sizes


def build_index(source: SampleSource, tokenizer) -> SampleIndex:
    tokens, labels, offsets, starts, sizes, bad = [], [], [0], [], [], {}
    for index in range(len(source)):
        try:
            count, supervised, image_starts, image_sizes = _entry(source, index, tokenizer)
        except SampleError as err:
            count, supervised, image_starts, image_sizes = 0, 0, [], []
            bad[index] = str(err)
        tokens.append(count)
        labels.append(supervised)
        starts += image_starts
        sizes += image_sizes
        offsets.append(len(starts))
    return SampleIndex(torch.tensor(tokens, dtype=torch.long), torch.tensor(labels, dtype=torch.long),
                       torch.tensor(offsets, dtype=torch.long),
                       torch.tensor(starts, dtype=torch.long), torch.tensor(sizes, dtype=torch.long).reshape(-1, 2), bad)


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


def sample_index(source: SampleSource, tokenizer, reader: str) -> SampleIndex:
    """The index of ``source`` read with ``tokenizer`` (``reader``: what else shaped it, for the key):
    from its file when one for these files exists, else built and written."""
    path = _location(source, _key(source, reader + tokenizer.fingerprint()))
    try:
        return SampleIndex(**torch.load(path, weights_only=True))
    except (OSError, RuntimeError, EOFError, TypeError, KeyError):
        pass  # not written yet (or by another version): built below
    index = build_index(source, tokenizer)
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
