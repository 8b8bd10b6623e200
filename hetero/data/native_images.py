"""Images at their native resolution, several per document, packed with text into rows.

An image keeps its aspect ratio and its resolution, cut to whole patches, unless it holds more than
``max_patches``: then it is scaled down to the most that fit (``fit_to_patches``). Its patch grid, and
so its token count, varies from image to image. A document is a
run of segments, images and texts: each image becomes as many placeholder tokens as it has patches,
and the document's labels are its next tokens, with placeholders never predicted
(``multimodal_document``); its images are resized and cut into patches only when read
(``NativeImage``). Documents pack into rows (``hetero.data.packing``); ``image_places`` and
``image_patches`` give the batch's per-image columns: ``image_patches`` (every image's patches, image after image,
row-major, channels × patch × patch values each, as ``VisionEncoder.patches`` orders them),
``image_grid`` (height, width in patches), ``image_row`` and ``image_start`` (its first placeholder).

The photographs are scikit-image's (``skimage.data``, installed with the wheel: no download), cut into
random crops of many aspect ratios (``photo_crops``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from hetero.data.digits import IGNORE_INDEX
from hetero.data.packing import Row

IMAGE_TOKEN = 0  # the placeholder token id (as hetero.testing.references)
PHOTOS = ("astronaut", "camera", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field", "moon",
          "page", "text", "coins", "clock", "brick", "grass", "gravel", "cat")


def patch_grid(height: int, width: int, patch_size: int, max_patches: int) -> tuple[int, int]:
    """The grid (rows, columns of patches) of an image: its own size in whole patches, or, past
    ``max_patches``, the largest grid of its aspect ratio that fits (at least one patch each way)."""
    scale = min(1.0, math.sqrt(max_patches / ((height / patch_size) * (width / patch_size))))
    rows, cols = max(1, int(height * scale / patch_size)), max(1, int(width * scale / patch_size))
    while rows * cols > max_patches:  # rounding of a very thin image
        rows, cols = (rows - 1, cols) if rows >= cols and rows > 1 else (rows, cols - 1)
    return rows, cols


def fit_to_patches(image: torch.Tensor, patch_size: int, max_patches: int) -> torch.Tensor:
    """``image`` (channels, H, W) resized (bilinear, antialiased) to its ``patch_grid``."""
    rows, cols = patch_grid(image.shape[1], image.shape[2], patch_size, max_patches)
    size = (rows * patch_size, cols * patch_size)
    if tuple(image.shape[1:]) == size:
        return image
    return F.interpolate(image[None].float(), size=size, mode="bilinear", antialias=True, align_corners=False)[0]


def patchify(image: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(channels, H, W) -> (H/p * W/p, channels * p * p): row-major patches."""
    channels, height, width = image.shape
    p = patch_size
    x = image.reshape(channels, height // p, p, width // p, p)
    return x.permute(1, 3, 0, 2, 4).reshape((height // p) * (width // p), channels * p * p)


@dataclass(frozen=True)
class NativeImage:
    """An image at native resolution whose patches are made when read: its grid is known before."""

    image: torch.Tensor  # (channels, H, W), not yet fitted
    patch_size: int
    max_patches: int

    @property
    def grid(self) -> tuple[int, int]:
        return patch_grid(self.image.shape[1], self.image.shape[2], self.patch_size, self.max_patches)

    def patches(self) -> torch.Tensor:
        return patchify(fit_to_patches(self.image, self.patch_size, self.max_patches), self.patch_size)


def multimodal_document(segments: list[torch.Tensor | NativeImage]) -> dict:
    """A document of ``segments``: images and texts (1-D token ids), ending with a text. Its
    ``tokens``/``labels`` and its ``images``: (offset, image, grid) each."""
    if not segments or not isinstance(segments[-1], torch.Tensor):
        raise ValueError("a multimodal document ends with a text segment (its last token has nothing to predict)")
    parts, images, offset = [], [], 0
    for segment in segments:
        if isinstance(segment, torch.Tensor):
            parts.append(segment.long())
        else:
            grid = segment.grid
            images.append((offset, segment, grid))
            parts.append(torch.full((grid[0] * grid[1],), IMAGE_TOKEN, dtype=torch.long))
        offset += len(parts[-1])
    sequence = torch.cat(parts)
    placeholder = torch.zeros(len(sequence), dtype=torch.bool)
    for start, _, (rows, cols) in images:
        placeholder[start : start + rows * cols] = True
    labels = sequence[1:].clone()
    labels[placeholder[1:]] = IGNORE_INDEX
    return {"tokens": sequence[:-1], "labels": labels, "images": images}


def image_places(rows: list[Row]) -> tuple[dict[str, torch.Tensor], list[NativeImage]]:
    """The per-image bookkeeping of a batch of packed rows (``image_grid``, ``image_row``,
    ``image_start``: see the module docstring), and its images in that order."""
    images, grids, owners, starts = [], [], [], []
    for r, row in enumerate(rows):
        offset = 0
        for part in row.parts:
            for start, image, grid in part.get("images", ()):
                images.append(image)
                grids.append(grid)
                owners.append(r)
                starts.append(offset + start)
            offset += len(part["tokens"])
    return {
        "image_grid": torch.tensor(grids, dtype=torch.long).reshape(-1, 2),
        "image_row": torch.tensor(owners, dtype=torch.long),
        "image_start": torch.tensor(starts, dtype=torch.long),
    }, images


def image_patches(images: list[NativeImage], width: int) -> torch.Tensor:
    """``images``' patches, image after image (``image_patches``)."""
    return torch.cat([image.patches() for image in images]).float() if images else torch.zeros(0, width)


def load_photos(channels: int = 1) -> list[torch.Tensor]:
    """scikit-image's photographs as (channels, H, W) in [0, 1]: grayscale (1) or RGB (3)."""
    import skimage.data  # imported late as it is slow

    photos = []
    for name in PHOTOS:
        image = np.asarray(getattr(skimage.data, name)(), dtype=np.float32) / 255.0
        image = image[..., None] if image.ndim == 2 else image[..., :3]
        if channels == 1:
            image = image.mean(-1, keepdims=True)
        elif image.shape[-1] == 1:
            image = np.repeat(image, 3, -1)
        photos.append(torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1))))
    return photos


def photo_crops(photos: list[torch.Tensor], count: int, generator: torch.Generator, min_side: int = 24) -> list[torch.Tensor]:
    """``count`` random crops of the photographs: each of a random photo, a random aspect ratio
    (1:4 to 4:1) and a random size, at native resolution (not yet fitted)."""
    crops = []
    for _ in range(count):
        photo = photos[int(torch.randint(len(photos), (), generator=generator))]
        _, height, width = photo.shape
        ratio = 4.0 ** (2 * float(torch.rand((), generator=generator)) - 1)  # width / height
        side = min_side + float(torch.rand((), generator=generator)) * (min(height, width) - min_side)
        h = max(min_side, min(height, int(side / math.sqrt(ratio))))
        w = max(min_side, min(width, int(side * math.sqrt(ratio))))
        top = int(torch.randint(height - h + 1, (), generator=generator))
        left = int(torch.randint(width - w + 1, (), generator=generator))
        crops.append(photo[:, top : top + h, left : left + w])
    return crops
