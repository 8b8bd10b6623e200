"""The digits as samples of a mixture (``train.data.mixture: [{format: digits}, ...]``): each digit an
image-caption conversation, like a ``webdataset`` pair. The user's turn is ``train.data.caption_prompt``,
the assistant's the digit's caption ("handwritten 7."); the image is the 32×32 scan as a grayscale PNG,
which the vision module's own preprocessing reads like any user's image. Each split is the digits'
(``hetero.data.digits``: 1621 train, 176 held out), from the shard set in ``train.data_dir``.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from hetero.data.chat import IMAGE_MARKER, Turn
from hetero.data.shards import MANIFEST, load_manifest, read_split
from hetero.data.samples import ImageRef, Sample, SampleInfo
from hetero.errors import ConfigError


def png(pixels: np.ndarray) -> bytes:
    """A (1, H, W) image in [0, 1] as 8-bit grayscale PNG bytes."""
    out = io.BytesIO()
    Image.fromarray(np.round(pixels[0] * 255).astype(np.uint8), mode="L").save(out, format="PNG")
    return out.getvalue()


class DigitConversations:
    """The digits of one split as conversations about their images."""

    def __init__(self, shard_dir: str | Path, split: str, prompt: str, bad_shards: str = "error"):
        if prompt.count(IMAGE_MARKER) != 1:
            raise ConfigError(f"train.data.caption_prompt={prompt!r} must hold one {IMAGE_MARKER} marker")
        self.shard_dir, self.prompt = Path(shard_dir), prompt
        self.name = f"the digits in {shard_dir} ({split})"
        self.samples = read_split(shard_dir, split, bad_shards)
        self.images = [png(s["npy"]) for s in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def files(self) -> list[Path]:
        manifest = load_manifest(self.shard_dir)
        return [self.shard_dir / MANIFEST] + [self.shard_dir / shard["file"] for split in manifest["splits"].values()
                                              for shard in split["shards"]]

    def sample(self, index: int) -> Sample:
        sample = self.samples[index]
        key = f"digit {sample['json']['index']}"
        turns = [Turn("user", self.prompt), Turn("assistant", sample["txt"])]
        return Sample(key, f"{self.name} {key}", turns, [ImageRef(f"{key}.png", data=self.images[index])])

    def describe(self, index: int) -> SampleInfo:
        return SampleInfo(len(self.samples[index]["txt"]), 1)
