"""The Qwen-VL processor's image steps in hetero's one image pipeline (``ImagePipeline.from_hf`` of a
``Qwen2VLImageProcessor`` config, ``qwen_patches``) against transformers' processor read from the same
directory: real photographs (scikit-image's) cropped to many sizes and aspect ratios, tiny and past
``max_pixels``, for Qwen2.5-VL's settings (patch 14, CLIP's mean and std) and Qwen3-VL's (patch 16, 0.5):
``pixel_values`` and ``image_grid_thw`` bit for bit."""

import pytest
import skimage.data
import torch
import transformers
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from hetero.data.images import ImagePipeline, qwen_patches, smart_resize

SETTINGS = {
    "qwen2.5-vl": dict(min_pixels=56 * 56, max_pixels=28 * 28 * 64),
    "qwen3-vl": dict(size={"shortest_edge": 64 * 64, "longest_edge": 32 * 32 * 48}, patch_size=16,
                     image_mean=[0.5] * 3, image_std=[0.5] * 3),
}
CROPS = [(0, 0, 300, 451), (10, 20, 140, 96), (0, 0, 28, 600), (50, 50, 57, 63), (0, 0, 512, 512), (5, 7, 9, 30)]


def photos():
    for name in ("astronaut", "chelsea", "coffee"):
        photo = Image.fromarray(getattr(skimage.data, name)())
        for top, left, height, width in CROPS:
            yield photo.crop((left, top, left + width, top + height))


@pytest.mark.parametrize("family", list(SETTINGS))
def test_pixels_and_grids_equal_the_processors(tmp_path, family):
    Qwen2VLImageProcessorPil(**SETTINGS[family]).save_pretrained(tmp_path)
    theirs = transformers.AutoImageProcessor.from_pretrained(tmp_path)
    ours = ImagePipeline.from_hf(tmp_path)
    grids = set()
    for image in photos():
        expected = theirs(images=[image], return_tensors="pt")
        patches, grid = qwen_patches(ours(image), ours.patch_size, ours.merge, ours.temporal_patch)
        assert grid == tuple(expected["image_grid_thw"][0].tolist())
        assert torch.equal(patches, expected["pixel_values"]), (image.size, grid)
        grids.add(grid)
    print(f"\n{family}: {len(grids)} grids, e.g. {sorted(grids)[:4]}")
    assert len(grids) == len(CROPS)  # each crop size its own grid


def test_smart_resize_rounds_halves_to_even_and_keeps_within_the_pixels():
    assert smart_resize(42, 70, 28, 56 * 56, 10**9) == (56, 56)  # 1.5 -> 2 and 2.5 -> 2 blocks
    height, width = smart_resize(3000, 4000, 28, 3136, 28 * 28 * 64)
    assert height * width <= 28 * 28 * 64 and height % 28 == width % 28 == 0 and (height, width) == (168, 252)
    assert smart_resize(10, 12, 28, 56 * 56, 10**9) == (56, 84)
    with pytest.raises(ValueError, match="more than 200 times"):
        smart_resize(1, 300, 28, 3136, 10**6)
