"""Data files that ship inside installed wheels, read without importing the package that ships them.

scikit-learn's digits (``sklearn/datasets/data/digits.csv.gz``) and scikit-image's textures
(``skimage/data/<name>.png``) are plain files in those wheels. Importing ``sklearn`` or ``skimage`` to
read them would pull in SciPy (35 MB as a wheel) and more; reading the files directly needs only NumPy
and Pillow, so the GPU check's image (``scripts/gpu_check.sh``) carries the two wheels installed with
``--no-deps`` and nothing they depend on. The arrays are the ones ``sklearn.datasets.load_digits()`` and
``skimage.data.<name>()`` return (``tests/test_gpu_wheels.py`` compares them where both are installed).
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np

_PINS = {"sklearn": "scikit-learn==1.9.1", "skimage": "scikit-image==0.25.2"}


def package_dir(name: str) -> Path:
    """The directory of the installed top-level package ``name``, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{name} is not installed; install {_PINS.get(name, name)} (its wheel ships "
                                f"the data)")
    return Path(list(spec.submodule_search_locations)[0])


def _wheel_file(package: str, relative: str) -> Path:
    path = package_dir(package) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {package}; install "
                                f"{_PINS.get(package, package)}")
    return path


def sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1797 digits as ``load_digits()`` gives them: images (N, 8, 8) float64 in 0..16 and
    integer labels (N,)."""
    with gzip.open(_wheel_file("sklearn", "datasets/data/digits.csv.gz"), "rt", encoding="utf-8") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


def skimage_image(name: str) -> np.ndarray:
    """``skimage.data.<name>()`` for the images stored as ``skimage/data/<name>.png`` (brick, grass, gravel,
    camera, coins, text, ...): the PNG's pixels as uint8, decoded by Pillow."""
    from PIL import Image  # late: only images need it

    with Image.open(_wheel_file("skimage", f"data/{name}.png")) as image:
        return np.asarray(image)
