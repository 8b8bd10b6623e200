"""Samples of users' data, by id: the contract every file format fills (``hetero.data.sources``).

A ``SampleSource`` holds a split's samples: ``sample(i)`` reads sample ``i`` (its conversation, its
images' bytes, or its text), ``describe(i)`` says cheaply what it holds (text length, number of images,
their sizes when a header gives them). Reading a bad sample raises ``SampleError`` naming the file, the
sample (its id, and its JSONL line or tar member) and what is wrong: ``train.data.on_error`` decides
whether the job stops or skips it (``hetero.data.sample_batches``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from hetero.data.chat import IMAGE_MARKER, VIDEO_MARKER, Turn


class SampleError(ValueError):
    """A sample that cannot be trained on; the message says where it is and what is wrong."""


@dataclass(frozen=True)
class ImageRef:
    """An image of a sample: a file (``path``), or ``span`` (offset, size) of one (a tar member), or bytes
    already read; ``name`` for messages. Nothing is read until ``read``."""

    name: str
    path: Path | None = None
    data: bytes | None = None
    span: tuple[int, int] | None = None

    def read(self, where: str) -> bytes:
        if self.data is not None:
            return self.data
        assert self.path is not None
        try:
            if self.span is not None:
                with self.path.open("rb") as f:
                    f.seek(self.span[0])
                    return f.read(self.span[1])
            return self.path.read_bytes()
        except FileNotFoundError:
            raise SampleError(f"{where}: image {self.name} not found at {self.path}; fix the path or "
                              f"train.data.image_root") from None
        except OSError as err:
            raise SampleError(f"{where}: image {self.name} cannot be read ({err})") from None


@dataclass(frozen=True)
class VideoRef:
    """A video of a sample: a file (``path``, any container PyAV reads), or its frames as image files at
    ``fps`` frames a second (None: unknown, which transformers takes as 24)."""

    name: str
    path: Path | None = None
    frames: tuple[ImageRef, ...] = ()
    fps: float | None = None


@dataclass
class Sample:
    """One sample: a conversation with an image per ``<image>`` marker and a video per ``<video>`` marker
    (each in order), or a plain text."""

    id: str
    where: str  # e.g. "data/train.jsonl line 7 (id 000123)"
    turns: list[Turn] = field(default_factory=list)
    images: list[ImageRef] = field(default_factory=list)
    text: str | None = None
    videos: list[VideoRef] = field(default_factory=list)

    def markers(self) -> list[str]:
        """The ``<image>`` and ``<video>`` markers of the conversation, in text order."""
        pattern = re.compile(f"{re.escape(IMAGE_MARKER)}|{re.escape(VIDEO_MARKER)}")
        return [found for turn in self.turns for found in pattern.findall(turn.content)]

    def check(self) -> None:
        """The checks that need no decoding: a conversation, and as many images as markers."""
        if self.text is not None:
            return
        if not self.turns:
            raise SampleError(f"{self.where}: the conversation is empty; give it at least one turn")
        if not any(turn.role == "assistant" for turn in self.turns):
            raise SampleError(f"{self.where}: the conversation has no assistant turn, so nothing to learn")
        for marker, refs, what in ((IMAGE_MARKER, self.images, "image"), (VIDEO_MARKER, self.videos, "video")):
            markers = sum(turn.content.count(marker) for turn in self.turns)
            if markers != len(refs):
                raise SampleError(f"{self.where}: {markers} {marker} markers but {len(refs)} {what}s; "
                                  f"give one marker per {what}")


@dataclass(frozen=True)
class SampleInfo:
    """What a sample holds, known without decoding it."""

    text_chars: int
    images: int


class SampleSource(Protocol):
    """A split's samples, by index (0 .. len - 1)."""

    name: str

    def __len__(self) -> int: ...

    def sample(self, index: int) -> Sample: ...

    def describe(self, index: int) -> SampleInfo: ...

    def files(self) -> list[Path]:
        """Every file its samples come from (the index is kept while none of them changes)."""
        ...


class Subset:
    """The samples ``indices`` of ``source``: a split cut from one source."""

    def __init__(self, source: SampleSource, indices: list[int], split: str):
        self.source, self.indices = source, indices
        self.name = f"{source.name} ({split})"

    def __len__(self) -> int:
        return len(self.indices)

    def sample(self, index: int) -> Sample:
        return self.source.sample(self.indices[index])

    def describe(self, index: int) -> SampleInfo:
        return self.source.describe(self.indices[index])

    def files(self) -> list[Path]:
        return self.source.files()


def split_of(source: SampleSource, split: str, heldout_every: int) -> Subset:
    """Every ``heldout_every``-th sample held out; the others train."""
    held = [i for i in range(len(source)) if (i % heldout_every == heldout_every - 1) == (split == "heldout")]
    if not held:
        raise SampleError(f"{source.name} has {len(source)} samples: none left for the {split} split with "
                          f"train.data.heldout_every={heldout_every}; add samples or give train.data.heldout_path")
    return Subset(source, held, split)
