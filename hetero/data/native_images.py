"""Images at their native resolution, several per document, packed with text into rows.

An image keeps its aspect ratio and its resolution, cut to whole patches, unless it holds more than
``max_patches``: then it is scaled down to the most that fit (``fit_to_patches``). Its patch grid, and
so its token count, varies from image to image. A document is a
run of segments, images and texts: each image becomes as many placeholder tokens as it has patches,
and the document's labels are its next tokens, with placeholders never predicted
(``multimodal_document``). Documents pack into rows (``hetero.data.packing``); ``image_columns``
gives the batch's per-image columns: ``image_patches`` (every image's patches, image after image,
row-major, channels × patch × patch values each, as ``VisionEncoder.patches`` orders them),
``image_grid`` (height, width in patches), ``image_row`` and ``image_start`` (its first placeholder).

The photographs are scikit-image's (``skimage.data``, installed with the wheel: no download), cut into
random crops of many aspect ratios (``photo_crops``).
"""

from __future__ import annotations

import math

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


def multimodal_document(segments: list[torch.Tensor], patch_size: int) -> dict:
    """A document of ``segments``: images (channels, H, W), already fitted, and texts (1-D token ids),
    ending with a text. Its ``tokens``/``labels`` and its ``images``: (offset, patches, grid) each."""
    if not segments or segments[-1].dim() != 1:
        raise ValueError("a multimodal document ends with a text segment (its last token has nothing to predict)")
    parts, images, offset = [], [], 0
    for segment in segments:
        if segment.dim() == 1:
            parts.append(segment.long())
        else:
            grid = (segment.shape[1] // patch_size, segment.shape[2] // patch_size)
            images.append((offset, patchify(segment, patch_size), grid))
            parts.append(torch.full((grid[0] * grid[1],), IMAGE_TOKEN, dtype=torch.long))
        offset += len(parts[-1])
    sequence = torch.cat(parts)
    placeholder = torch.zeros(len(sequence), dtype=torch.bool)
    for start, patches, _ in images:
        placeholder[start : start + len(patches)] = True
    labels = sequence[1:].clone()
    labels[placeholder[1:]] = IGNORE_INDEX
    return {"tokens": sequence[:-1], "labels": labels, "images": images}


def image_columns(rows: list[Row], width: int) -> dict[str, torch.Tensor]:
    """The per-image columns of a batch of packed rows (see the module docstring)."""
    patches, grids, owners, starts = [], [], [], []
    for r, row in enumerate(rows):
        offset = 0
        for part in row.parts:
            for start, image_patches, grid in part.get("images", ()):
                patches.append(image_patches)
                grids.append(grid)
                owners.append(r)
                starts.append(offset + start)
            offset += len(part["tokens"])
    return {
        "image_patches": torch.cat(patches).float() if patches else torch.zeros(0, width),
        "image_grid": torch.tensor(grids, dtype=torch.long).reshape(-1, 2),
        "image_row": torch.tensor(owners, dtype=torch.long),
        "image_start": torch.tensor(starts, dtype=torch.long),
    }


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
