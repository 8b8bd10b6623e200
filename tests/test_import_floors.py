"""The contract's packages never import the kinds themselves (DESIGN §10): the registry is assembled at
the entry points (``hetero.cli``, the rank entry ``hetero/train/run.py``, benchmarks, tests) and passed
down, and a kind brings its FLOPs, routing statistics and Hugging Face mapping through its ``Kind``."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "hetero"
FLOORS = ("kinds", "graph", "parallel", "runtime", "data", "interop", "train", "config.py")
ENTRY_POINTS = {ROOT / "train" / "run.py"}  # torchrun's entry assembles the registry for train()


def _model_imports(path: Path, source: str | None = None) -> list[int]:
    """Lines of ``path`` (or of ``source`` as if it were that file) importing ``hetero.models`` in any form,
    at module level or inside a function or an ``if TYPE_CHECKING:`` block."""
    lines = []
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            if any(a.name == "hetero.models" or a.name.startswith("hetero.models.") for a in node.names):
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            if node.module == "hetero.models" or node.module.startswith("hetero.models."):
                lines.append(node.lineno)
            elif node.module == "hetero" and any(a.name == "models" for a in node.names):
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:  # relative: resolve against the package
            package = path.parent.relative_to(ROOT.parent).parts
            base = ".".join(package[: len(package) - node.level + 1])
            target = f"{base}.{node.module}" if node.module else base
            names = [f"{target}.{a.name}" for a in node.names]
            if any(t == "hetero.models" or t.startswith("hetero.models.") for t in [target, *names]):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__"):
            if any(isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("hetero.models")
                   for a in node.args):
                lines.append(node.lineno)
    return lines


def _floor_files() -> list[Path]:
    files = []
    for floor in FLOORS:
        path = ROOT / floor
        files += [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))
    return [f for f in files if f not in ENTRY_POINTS]


def test_the_floors_do_not_import_the_models():
    files = _floor_files()
    assert len(files) > 50 and ROOT / "config.py" in files and ROOT / "graph" / "build.py" in files
    found = [f"{path.relative_to(ROOT.parent)}:{line}" for path in files for line in _model_imports(path)]
    assert not found, ("these contract modules import hetero.models; take the registry (or the Kind) as an "
                       "argument from the entry point instead:\n" + "\n".join(found))


def test_the_scan_sees_every_form_of_import():
    """The scan itself: each way of reaching hetero.models is caught, in functions and under
    TYPE_CHECKING too; other imports are not."""
    cases = {
        "import hetero.models": True,
        "import hetero.models.gpt.moe as moe": True,
        "from hetero.models import default_registry": True,
        "from hetero.models.gpt.moe import routed_layers": True,
        "from hetero import models": True,
        "from ..models import default_registry": True,
        "from .. import models": True,
        "import importlib\nimportlib.import_module('hetero.models.gpt')": True,
        "def f():\n    from hetero.models import default_registry": True,
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hetero.models.gpt.moe import Experts": True,
        "from hetero.kinds.registry import KindRegistry": False,
        "from hetero import errors": False,
        "from .graph import Graph": False,
        "x = 'hetero.models'": False,
    }
    for source, caught in cases.items():  # as if a module of hetero.graph (for the relative imports)
        assert bool(_model_imports(ROOT / "graph" / "build.py", source)) == caught, source
