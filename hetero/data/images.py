"""One image pipeline for every data source: bytes -> PIL image -> the tensor a vision module reads.

``ImagePipeline.decode`` reads encoded bytes (any format Pillow reads) and turns the image upright by
its EXIF orientation, as transformers' ``load_image`` does; ``pipeline(image)`` converts to RGB (or
grayscale), resizes with PIL on uint8 pixels, center-crops, rescales in float64, then normalizes in
float32. That is the arithmetic, in that order, of transformers' PIL image processors, so a pipeline
read from a checkpoint (``from_hf``: SigLIP or CLIP processors) gives the checkpoint's pixel values
exactly. A vision module trained from scratch takes ``for_vision``. At native resolution
(``patch_size`` and ``max_patches`` set) an image keeps its aspect ratio and is resized to its patch
grid (``hetero.data.native_images.patch_grid``). A Qwen-VL processor (``Qwen2VLImageProcessor``, which
Qwen2.5-VL and Qwen3-VL name) resizes each image to whole merge blocks within ``min_pixels`` ..
``max_pixels`` (``smart_resize``) and ``qwen_patches`` cuts it into its patches in merge-block order,
each ``temporal_patch`` copies of the frame deep: the processor's ``pixel_values`` and ``image_grid_thw``.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

from hetero.data.native_images import patch_grid

# PIL's resample filter ids (HF's `resample`): 0 nearest, 1 lanczos, 2 bilinear, 3 bicubic, 4 box, 5 hamming
BICUBIC = 3
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# Each processor type's class defaults, for the fields its preprocessor_config.json leaves out.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "SiglipImageProcessor": {"size": {"height": 224, "width": 224}, "do_center_crop": False,
                             "image_mean": [0.5] * 3, "image_std": [0.5] * 3},
    "CLIPImageProcessor": {"size": {"shortest_edge": 224}, "do_center_crop": True,
                           "crop_size": {"height": 224, "width": 224},
                           "image_mean": list(OPENAI_CLIP_MEAN), "image_std": list(OPENAI_CLIP_STD)},
    "Qwen2VLImageProcessor": {"size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
                              "do_center_crop": False, "image_mean": list(OPENAI_CLIP_MEAN),
                              "image_std": list(OPENAI_CLIP_STD), "patch_size": 14, "temporal_patch_size": 2,
                              "merge_size": 2},
}
_HF_COMMON = {"do_resize": True, "resample": BICUBIC, "do_rescale": True, "rescale_factor": 1 / 255,
              "do_normalize": True, "do_convert_rgb": True, "default_to_square": False}
# Fields that name things or feed the text side only, not how pixels are made.
_HF_INERT = {"image_processor_type", "feature_extractor_type", "processor_class", "image_seq_length"}
_QWEN_FIELDS = {"patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"}
_HF_FIELDS = (_HF_INERT | set(_HF_COMMON) | _QWEN_FIELDS
              | {"size", "do_center_crop", "crop_size", "image_mean", "image_std"})


class ImageError(ValueError):
    """Image bytes that cannot be read; the message names where they came from."""


@dataclass(frozen=True)
class ImagePipeline:
    """How images become what a vision module reads: (channels, H, W) float32."""

    size: tuple[int, int] | None  # (height, width) after resize; None with shortest_edge
    shortest_edge: int | None  # resize so the short side is this (aspect kept), CLIP style
    crop: tuple[int, int] | None  # center crop (height, width) after resize (zero-padded if larger)
    resample: int  # PIL resample filter id
    rescale: float  # e.g. 1/255
    mean: tuple[float, ...]
    std: tuple[float, ...]
    channels: int  # 3: RGB; 1: grayscale (PIL mode "L")
    patch_size: int = 0  # native resolution: > 0 with max_patches > 0, or a Qwen-VL processor's
    max_patches: int = 0
    # A Qwen-VL processor's: pixels an image is resized within, its merge blocks' side, frames per patch
    min_pixels: int = 0
    max_pixels: int = 0
    merge: int = 1
    temporal_patch: int = 1

    def __post_init__(self) -> None:
        if self.channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {self.channels}")
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise ValueError(f"mean and std need {self.channels} values each, got {self.mean} and {self.std}")
        if self.resample not in {int(r) for r in Image.Resampling}:
            raise ValueError(f"resample {self.resample} is not a PIL filter id")
        if (self.patch_size > 0) != (self.max_patches > 0 or self.qwen):
            raise ValueError("native resolution needs both patch_size and max_patches (or max_pixels) > 0")
        if self.size is not None and self.shortest_edge is not None:
            raise ValueError("give size or shortest_edge, not both")
        if self.native and (self.size or self.shortest_edge or self.crop):
            raise ValueError("native resolution resizes to the patch grid: no size, shortest_edge or crop")

    @property
    def native(self) -> bool:
        """Whether images keep their aspect ratio and are fitted to a patch grid."""
        return self.patch_size > 0

    @property
    def qwen(self) -> bool:
        """Whether it is a Qwen-VL processor's (``smart_resize``, ``qwen_patches``)."""
        return self.max_pixels > 0

    @classmethod
    def from_hf(cls, directory: str | os.PathLike) -> ImagePipeline:
        """The pipeline of a checkpoint's ``preprocessor_config.json`` (SigLIP or CLIP image processor), or
        of the ``image_processor`` of its ``processor_config.json`` (a whole VLM's processor, as
        transformers 5 saves it; ``image_processor_config``).

        Raises ValueError naming the processor type or field it cannot follow (padding, anyres grids,
        longest-edge sizes, ...)."""
        path, config = image_processor_config(directory)
        kind = config.get("image_processor_type") or config.get("feature_extractor_type")
        kind = {"CLIPFeatureExtractor": "CLIPImageProcessor"}.get(kind, kind)
        for suffix in ("Fast", "Pil"):
            kind = kind.removesuffix(suffix) if isinstance(kind, str) else kind
        if kind not in _HF_DEFAULTS:
            raise ValueError(f"{path}: image_processor_type {kind!r} is not supported "
                             f"(supported: {sorted(_HF_DEFAULTS)})")
        for field, value in config.items():
            qwen_only = field in _QWEN_FIELDS and kind != "Qwen2VLImageProcessor"
            if (field not in _HF_FIELDS or qwen_only) and value not in (None, False):  # an option off is harmless
                raise ValueError(f"{path}: field {field!r} = {value!r} is not supported")
        c = {**_HF_COMMON, **_HF_DEFAULTS[kind], **{k: v for k, v in config.items() if v is not None}}
        if kind == "Qwen2VLImageProcessor":
            return cls._qwen(c, path)

        size = shortest_edge = crop = None
        if c["do_resize"]:
            size, shortest_edge = _hf_size(c["size"], c["default_to_square"], path)
        if c["do_center_crop"]:
            crop_size = c["crop_size"]
            if isinstance(crop_size, int):
                crop_size = {"height": crop_size, "width": crop_size}
            if not isinstance(crop_size, dict) or set(crop_size) != {"height", "width"}:
                raise ValueError(f"{path}: field 'crop_size' = {crop_size!r} is not supported")
            crop = (int(crop_size["height"]), int(crop_size["width"]))

        def per_channel(field: str, off: float) -> tuple[float, ...]:
            value = c[field] if c["do_normalize"] else off
            values = tuple(map(float, value)) if isinstance(value, (list, tuple)) else (float(value),) * 3
            if len(values) != 3:
                raise ValueError(f"{path}: field {field!r} = {value!r} needs 3 values (RGB)")
            return values

        # do_convert_rgb false changes nothing for RGB images, the only ones such a checkpoint can read.
        return cls(size=size, shortest_edge=shortest_edge, crop=crop, resample=int(c["resample"]),
                   rescale=float(c["rescale_factor"]) if c["do_rescale"] else 1.0,
                   mean=per_channel("image_mean", 0.0), std=per_channel("image_std", 1.0), channels=3)

    @classmethod
    def _qwen(cls, c: dict[str, Any], path: Path) -> ImagePipeline:
        """A Qwen-VL processor's pipeline (``min_pixels``/``max_pixels`` of older configs override ``size``)."""
        size = c["size"]
        if not isinstance(size, dict) or not {"shortest_edge", "longest_edge"} <= set(size):
            raise ValueError(f"{path}: field 'size' = {size!r} is not supported (shortest_edge and longest_edge)")
        if not (c["do_resize"] and c["do_rescale"] and c["do_normalize"]):
            raise ValueError(f"{path}: a Qwen-VL processor that does not resize, rescale and normalize is not supported")
        return cls(size=None, shortest_edge=None, crop=None, resample=int(c["resample"]),
                   rescale=float(c["rescale_factor"]), mean=tuple(map(float, c["image_mean"])),
                   std=tuple(map(float, c["image_std"])), channels=3, patch_size=int(c["patch_size"]),
                   min_pixels=int(c.get("min_pixels") or size["shortest_edge"]),
                   max_pixels=int(c.get("max_pixels") or size["longest_edge"]), merge=int(c["merge_size"]),
                   temporal_patch=int(c["temporal_patch_size"]))

    @classmethod
    def for_vision(
        cls, image_size: int, channels: int, patch_size: int = 0, max_patches: int = 0
    ) -> ImagePipeline:
        """A vision module trained from scratch: bicubic resize to ``image_size`` square (or, at native
        resolution, to the image's patch grid), pixels scaled to [0, 1] then normalized with mean = std
        = 0.5 per channel, so values lie in [-1, 1] (SigLIP's convention)."""
        native = max_patches > 0
        return cls(size=None if native else (image_size, image_size), shortest_edge=None, crop=None,
                   resample=BICUBIC, rescale=1 / 255, mean=(0.5,) * channels, std=(0.5,) * channels,
                   channels=channels, patch_size=patch_size if native else 0, max_patches=max_patches)

    @staticmethod
    def decode(data: bytes, where: str) -> Image.Image:
        """Encoded image bytes, fully decoded and turned upright; ImageError naming ``where`` if not."""
        try:
            image = Image.open(io.BytesIO(data))
            image.load()  # decode every pixel now, so that truncated data fails here
            if _orientation(image) != 1:
                image = ImageOps.exif_transpose(image)
        except Exception as error:  # Pillow's decoders raise many types on bad data: OSError, SyntaxError...
            reason = re.sub(r" <_io\.BytesIO object at 0x[0-9a-f]+>", "", str(error)) or type(error).__name__
            raise ImageError(f"{where}: not a readable image ({reason})") from error
        return image

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) of the tensor made from an image of this size (e.g. from ``header_size``)."""
        if self.crop is not None:
            return self.crop
        return self._resized_size(height, width)

    def _resized_size(self, height: int, width: int) -> tuple[int, int]:
        if self.qwen:
            return smart_resize(height, width, self.patch_size * self.merge, self.min_pixels, self.max_pixels)
        if self.native:
            rows, cols = patch_grid(height, width, self.patch_size, self.max_patches)
            return rows * self.patch_size, cols * self.patch_size
        if self.size is not None:
            return self.size
        if self.shortest_edge is not None:
            # transformers' (and torchvision's) rounding: the long side truncated
            short, long = (width, height) if width <= height else (height, width)
            new_long = int(self.shortest_edge * long / short)
            return (new_long, self.shortest_edge) if width <= height else (self.shortest_edge, new_long)
        return height, width

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """``image`` as (channels, H, W) float32."""
        image = _convert(image, self.channels)
        width, height = image.size
        new_height, new_width = self._resized_size(height, width)
        if (new_height, new_width) != (height, width):
            image = image.resize((new_width, new_height), resample=self.resample)
        if self.crop is not None:
            crop_height, crop_width = self.crop
            top, left = (new_height - crop_height) // 2, (new_width - crop_width) // 2
            # PIL fills outside the image with zeros, as transformers pads a crop larger than the image
            image = image.crop((left, top, left + crop_width, top + crop_height))
        pixels = torch.from_numpy(np.array(image))  # (H, W) or (H, W, C) uint8
        pixels = pixels[..., None] if pixels.dim() == 2 else pixels
        # transformers rescales in float64, casts to float32, then normalizes in float32
        x = pixels.to(torch.float64).mul_(self.rescale).to(torch.float32)
        x.sub_(torch.tensor(self.mean, dtype=torch.float32, device="cpu"))
        x.div_(torch.tensor(self.std, dtype=torch.float32, device="cpu"))
        return x.permute(2, 0, 1).contiguous()


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """A Qwen-VL processor's size for an image: each side a multiple of ``factor`` (patch × merge), the
    nearest (halves to even, as Python rounds) unless the area leaves ``min_pixels`` .. ``max_pixels``, where
    both sides scale by one factor, rounded down (too large) or up (too small) to whole blocks."""
    if max(height, width) > 200 * min(height, width):
        raise ValueError(f"an image of {width}x{height} pixels is more than 200 times as long as it is wide; the "
                         f"Qwen-VL processor refuses it")
    rows, cols = round(height / factor) * factor, round(width / factor) * factor
    if rows * cols > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        rows = max(factor, math.floor(height / shrink / factor) * factor)
        cols = max(factor, math.floor(width / shrink / factor) * factor)
    elif rows * cols < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        rows, cols = math.ceil(height * grow / factor) * factor, math.ceil(width * grow / factor) * factor
    return rows, cols


def qwen_patches(pixels: torch.Tensor, patch: int, merge: int, frames: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """An image (channels, H, W), or a video's frames (F, channels, H, W) with F a multiple of ``frames``,
    as a Qwen-VL tower reads it: (t·h·w, channels · frames · patch²) patches, temporal patch after temporal
    patch, each in merge-block order (each ``merge × merge`` block consecutive, blocks row-major), an image's
    frame repeated ``frames`` times inside each patch; and its grid (t, h, w) in patches."""
    video = pixels if pixels.dim() == 4 else pixels[None].expand(frames, -1, -1, -1)
    depth, channels, height, width = video.shape
    t, rows, cols = depth // frames, height // patch, width // patch
    x = video.reshape(t, frames, channels, rows // merge, merge, patch, cols // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * rows * cols, channels * frames * patch * patch), (t, rows, cols)


def header_size(source: bytes | str | os.PathLike) -> tuple[int, int] | None:
    """(width, height) of encoded image bytes or an image file, upright, read from its header only
    (no pixels decoded); None if it cannot be read."""
    try:
        opened = io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else source
        with Image.open(opened) as image:
            width, height = image.size
            return (height, width) if _orientation(image) in (5, 6, 7, 8) else (width, height)
    except Exception:  # noqa: BLE001 - any failure to parse a header means "unreadable"
        return None


def _orientation(image: Image.Image) -> int:
    """The EXIF orientation (1: upright; 5-8 swap width and height) of an image's header."""
    if "exif" not in image.info:  # a PNG's getexif() would decode the pixels to look for one
        return 1
    return int(image.getexif().get(0x0112, 1))


def _convert(image: Image.Image, channels: int) -> Image.Image:
    """``image`` in mode RGB (3) or L (1); transparent pixels over white, as transformers does."""
    mode = "RGB" if channels == 3 else "L"
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)), image)
    return image if image.mode == mode else image.convert(mode)


def _hf_size(size: Any, default_to_square: bool, path: Path) -> tuple[tuple[int, int] | None, int | None]:
    """(size, shortest_edge) from a processor's ``size`` field."""
    if isinstance(size, int):  # old configs; both processors read an int as the shortest edge
        return ((size, size), None) if default_to_square else (None, size)
    if isinstance(size, dict) and set(size) == {"height", "width"}:
        return (int(size["height"]), int(size["width"])), None
    if isinstance(size, dict) and set(size) == {"shortest_edge"}:
        return None, int(size["shortest_edge"])
    raise ValueError(f"{path}: field 'size' = {size!r} is not supported (height and width, or shortest_edge)")


def image_processor_config(directory: str | os.PathLike) -> tuple[Path, dict]:
    """Where a checkpoint's image-processor config is, and what it says: ``preprocessor_config.json``, else
    the ``image_processor`` entry of ``processor_config.json``; FileNotFoundError when neither has one."""
    directory = Path(directory)
    if (path := directory / "preprocessor_config.json").is_file():
        return path, json.loads(path.read_text())
    if (path := directory / "processor_config.json").is_file():
        config = json.loads(path.read_text())
        if isinstance(config.get("image_processor"), dict):
            return path, config["image_processor"]
    raise FileNotFoundError(f"{directory} has no image processor config (preprocessor_config.json)")


def has_image_processor(directory: str | os.PathLike) -> bool:
    try:
        image_processor_config(directory)
    except FileNotFoundError:
        return False
    return True
