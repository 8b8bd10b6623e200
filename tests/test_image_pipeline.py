"""The image pipeline (``hetero/data/images.py``): scikit-image's photographs, encoded as PNG and JPEG,
decoded and preprocessed equal transformers' SigLIP and CLIP image processors (read back from their
``save_pretrained`` configs) within 1e-6; unreadable bytes fail naming where they came from; native
resolution follows ``patch_grid``; header sizes; configs it cannot follow are refused by name."""

import io
import json

import numpy as np
import pytest
import skimage.data
import torch
import transformers
from PIL import Image

from hetero.data.images import ImageError, ImagePipeline, header_size
from hetero.data.native_images import patch_grid

# The PIL classes by name: SiglipImageProcessor / CLIPImageProcessor fall back to them without
# torchvision, but with it they would resize with torchvision, which is not what is compared here.
PROCESSORS = {
    "siglip 224": lambda: transformers.SiglipImageProcessorPil(size={"height": 224, "width": 224}),
    "clip 224 (defaults)": lambda: transformers.CLIPImageProcessorPil(),
    "siglip 32": lambda: transformers.SiglipImageProcessorPil(size={"height": 32, "width": 32}),
    "clip 40, crop 32": lambda: transformers.CLIPImageProcessorPil(size={"shortest_edge": 40},
                                                                  crop_size={"height": 32, "width": 32}),
    "clip 24, crop 32x33 (padded)": lambda: transformers.CLIPImageProcessorPil(
        size={"shortest_edge": 24}, crop_size={"height": 32, "width": 33}),
    "siglip 37x301 bilinear": lambda: transformers.SiglipImageProcessorPil(size={"height": 37, "width": 301},
                                                                          resample=2),
}


def encoded(array: np.ndarray, fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, fmt)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def photos() -> dict[str, bytes]:
    """Real photographs as PNG and JPEG bytes: RGB, grayscale (camera), a tall crop, and one with alpha."""
    names = ("astronaut", "chelsea", "coffee", "rocket", "camera")
    arrays = {name: getattr(skimage.data, name)() for name in names}
    arrays["astronaut tall crop"] = arrays["astronaut"][37:400, 101:260]
    alpha = np.linspace(0, 255, 300 * 200, dtype=np.uint8).reshape(300, 200, 1)
    out = {f"{name}.{fmt.lower()}": encoded(a, fmt) for name, a in arrays.items() for fmt in ("PNG", "JPEG")}
    out["chelsea with alpha.png"] = encoded(np.concatenate([arrays["chelsea"][:300, :200], alpha], -1), "PNG")
    return out


@pytest.mark.parametrize("case", PROCESSORS)
def test_matches_transformers(case, photos, tmp_path):
    processor = PROCESSORS[case]()
    processor.save_pretrained(tmp_path)
    pipeline = ImagePipeline.from_hf(tmp_path)
    for name, data in photos.items():
        image = pipeline.decode(data, name)
        expected = processor(images=image, return_tensors="pt").pixel_values[0]
        got = pipeline(image)
        assert got.dtype == torch.float32 and got.shape == expected.shape, name
        assert (got - expected).abs().max().item() <= 1e-6, name
        assert pipeline.output_size(image.height, image.width) == tuple(got.shape[1:])


@pytest.mark.parametrize("kind", ["random bytes", "PNG cut in half", "JPEG cut in half", "empty"])
def test_unreadable_bytes_name_where(kind, photos):
    data = {"random bytes": np.random.default_rng(0).bytes(5000), "PNG cut in half": photos["coffee.png"],
            "JPEG cut in half": photos["coffee.jpeg"], "empty": b""}[kind]
    data = data[: len(data) // 2] if "half" in kind else data
    where = "data.json sample 12 image cat.png"
    with pytest.raises(ImageError, match=f"^{where}: not a readable image") as error:
        ImagePipeline.for_vision(224, 3).decode(data, where)
    assert isinstance(error.value, ValueError)


def test_native_resolution_keeps_aspect(photos):
    pipeline = ImagePipeline.for_vision(0, 3, patch_size=16, max_patches=64)
    for name, data in photos.items():
        image = pipeline.decode(data, name)
        rows, cols = patch_grid(image.height, image.width, 16, 64)
        got = pipeline(image)
        assert got.shape == (3, rows * 16, cols * 16) and rows * cols <= 64, name
        assert abs(np.log((cols / rows) / (image.width / image.height))) < 0.25, name
        assert -1.0 <= got.min() and got.max() <= 1.0
    small = Image.fromarray(skimage.data.astronaut()[:50, :90])  # fits: cut to whole patches, not scaled up
    assert pipeline(small).shape == (3, 48, 80)


def test_grayscale_digits():
    from sklearn.datasets import load_digits

    pipeline = ImagePipeline.for_vision(32, 1)
    digit = Image.fromarray((load_digits().images[0] * (255 / 16)).astype(np.uint8), mode="L")
    got = pipeline(digit)
    assert got.shape == (1, 32, 32) and got.min() == -1.0 and got.max() <= 1.0
    assert pipeline(Image.fromarray(skimage.data.astronaut())).shape == (1, 32, 32)  # RGB -> L


def test_header_size(photos, tmp_path):
    for name, data in photos.items():
        image = Image.open(io.BytesIO(data))
        assert header_size(data) == image.size, name
    (tmp_path / "cat.jpeg").write_bytes(photos["chelsea.jpeg"])
    assert header_size(tmp_path / "cat.jpeg") == (451, 300)
    assert header_size(b"not an image") is None and header_size(tmp_path / "missing.png") is None
    # A phone photo stored sideways: EXIF orientation 6 turns it upright, in the header and when decoded.
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    Image.fromarray(skimage.data.chelsea()).save(buffer, "JPEG", exif=exif)
    assert header_size(buffer.getvalue()) == (300, 451)
    assert ImagePipeline.for_vision(32, 3).decode(buffer.getvalue(), "sideways").size == (300, 451)


@pytest.mark.parametrize("field, value", [("do_pad", True), ("image_grid_pinpoints", [[336, 672]]),
                                          ("size", {"longest_edge": 448}),
                                          ("image_processor_type", "LlavaNextImageProcessor")])
def test_refuses_what_it_cannot_follow(field, value, tmp_path):
    transformers.SiglipImageProcessorPil().save_pretrained(tmp_path)
    path = tmp_path / "preprocessor_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=field):
        ImagePipeline.from_hf(tmp_path)
    path.write_text(json.dumps({**config, "do_pad": False}))  # an option switched off is fine
    assert ImagePipeline.from_hf(tmp_path).size == (224, 224)
