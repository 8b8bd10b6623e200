"""What hetero.bench.gpu_check imports, against what the GPU image and the carried wheels provide.

The GPU image has Python 3.12, torch 2.11, torchvision, transformers, triton and their dependencies
(``IMAGE``); ``scripts/gpu_wheels.txt`` lists the wheels carried for the rest. Three checks:

``--static`` (any Python, no torch; ``tests/test_gpu_wheels.py`` runs it): walks every ``import`` statement of
every hetero module that ``hetero.bench.gpu_check`` reaches, module-level ones and those inside functions,
and sorts every third-party top-level name imported: the image's, a carried wheel's, or one the check never
reaches (``NOT_ON_THE_CHECK_PATH``, each with its importers and why). Fails on any other name (unless the
import is inside ``try: ... except ImportError``), on a module-level import of a name the image lacks in a
module imported with the check, and on a ``NOT_ON_THE_CHECK_PATH`` name imported from a module not listed.

``--stubbed`` (under the image's Python with the wheels on the path and no torch needed: e.g. a Python 3.12
environment with the image's other packages): imports ``hetero.bench.gpu_check`` and every hetero module
the walk reached, the torch family (torch, torchvision, triton) replaced by stubs, and prints where every
other module came from (standard library, the image's site-packages, the carried wheels, the checkout);
then reads the data the jobs take from the carried wheels (scikit-learn's digits and scikit-image's
textures without importing either, the genome in pyrodigal's wheel and its gene calls).

``--dry-run`` (an environment with torch, e.g. the project's): the check's CPU dry run in this process with
every installed module that neither the image nor the wheels provide hidden, as if not installed.

    python scripts/gpu_imports.py --static
    PYTHONPATH=.:build/gpu_site /path/to/python3.12 scripts/gpu_imports.py --stubbed
    python scripts/gpu_imports.py --dry-run [CHECK_ARGS]     (3-6 minutes on 2 cores)
"""

from __future__ import annotations

import abc
import argparse
import ast
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
import sysconfig
import traceback
import types
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEEL_LIST = ROOT / "scripts" / "gpu_wheels.txt"
CHECK = "hetero.bench.gpu_check"
TORCH_FAMILY = ("torch", "torchvision", "triton", "torchgen", "functorch")
# Top-level names the GPU image provides: the torch family, transformers and their dependencies, and
# Pillow (torchvision's).
IMAGE = frozenset({*TORCH_FAMILY, "transformers", "numpy", "safetensors", "tokenizers", "huggingface_hub",
                   "yaml", "regex", "tqdm", "packaging", "filelock", "PIL", "sympy", "networkx", "jinja2",
                   "fsspec", "typing_extensions", "setuptools"})
# Wheels carried only for data files inside them, read by hetero.data.wheel_files without importing the
# package (importing either would need SciPy, which is not carried).
DATA_ONLY = frozenset({"sklearn", "skimage"})
# Names the static walk finds but the check never imports: name -> {importer module: why it is not reached}.
NOT_ON_THE_CHECK_PATH: dict[str, dict[str, str]] = {
    "wandb": {"hetero.train.run_log": "only hetero.train's run log (train.wandb); the check calls train_step",
              "hetero.bench.throughput": "only the throughput benchmark's --wandb"},
    "torchft": {"hetero.parallel.compression.torchft_replicas": "only compression.diloco.replicas=torchft"},
    "av": {"hetero.data.videos": "only videos in users' LLaVA records (a video file); no check job reads one, and "
                                 "its wheel (FFmpeg inside, ~35 MB) would not fit beside the others"},
    "matplotlib": {"hetero.plan.report": "only hetero plan --plot",
                   "hetero.plan.sweep": "only the sweep's plot"},
    "sklearn": {"hetero.data.example": "only the LLaVA-style example writer (hetero.testing.bad_samples, "
                                       "hetero.bench.frozen)"},
    "skimage": {"hetero.data.example": "only the LLaVA-style example writer",
                "hetero.data.native_images": "only load_photos, for the photo documents (no check job uses "
                                             "them)"},
}


@dataclass(frozen=True)
class Wheel:
    requirement: str
    names: tuple[str, ...]
    why: str


@dataclass(frozen=True)
class Use:
    name: str  # top-level module name
    importer: str  # hetero module
    line: int
    lazy: bool  # inside a function, or in a module the check imports only from inside a function
    guarded: bool  # inside ``try: ... except ImportError``


@dataclass
class Walk:
    eager: set[str] = field(default_factory=set)  # hetero modules importing the check imports
    reached: set[str] = field(default_factory=set)  # and those imported from inside functions too
    uses: list[Use] = field(default_factory=list)  # third-party imports of every reached module


def read_wheels(path: Path = WHEEL_LIST) -> list[Wheel]:
    """``scripts/gpu_wheels.txt``: requirement, top-level names (comma-separated), ``# why``."""
    wheels = []
    for raw in path.read_text().splitlines():
        line, _, why = raw.partition("#")
        if not line.strip():
            continue
        requirement, names = line.split()
        wheels.append(Wheel(requirement, tuple(names.split(",")), why.strip()))
    return wheels


def module_file(name: str) -> Path | None:
    """The source of hetero module ``name`` in this checkout, or None if there is no such module."""
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = [handler.type] if not isinstance(handler.type, ast.Tuple) else list(handler.type.elts)
    caught = ("ImportError", "ModuleNotFoundError", "Exception")
    return handler.type is None or any(isinstance(n, ast.Name) and n.id in caught for n in names)


def _imports(module: str, tree: ast.AST) -> list[tuple[list[str], int, bool, bool]]:
    """Every import in ``tree``: (candidate absolute module names, line, inside a function, guarded)."""
    source = module_file(module)
    package = module if source is not None and source.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, lazy: bool, guarded: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            lazy = True
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return  # never runs
        if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
            for child in node.body:
                visit(child, lazy, True)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, lazy, guarded)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(([alias.name], node.lineno, lazy, guarded))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found.append(([target, *(f"{target}.{a.name}" for a in node.names)], node.lineno, lazy, guarded))
        for child in ast.iter_child_nodes(node):
            visit(child, lazy, guarded)

    visit(tree, False, False)
    return found


def walk(root: str = CHECK) -> Walk:
    """Every hetero module ``root`` reaches through import statements, and their third-party imports."""
    edges: dict[str, list[tuple[str, bool]]] = {}  # module -> (hetero module it imports, lazily)
    result = Walk()
    queue = [root]
    while queue:
        module = queue.pop()
        if module in edges:
            continue
        edges[module] = []
        source = module_file(module)
        tree = ast.parse(source.read_text(), str(source))
        for candidates, line, lazy, guarded in _imports(module, tree):
            for name in candidates:
                top = name.split(".")[0]
                if top != "hetero":
                    if name is candidates[0] and top not in sys.stdlib_module_names and top != "__future__":
                        result.uses.append(Use(top, module, line, lazy, guarded))
                    continue
                parts = name.split(".")
                for i in range(1, len(parts) + 1):  # a package's __init__ runs before its submodules
                    prefix = ".".join(parts[:i])
                    if module_file(prefix) is not None:
                        edges[module].append((prefix, lazy))
                        queue.append(prefix)
    result.reached = set(edges)
    queue = [root]
    while queue:
        module = queue.pop()
        if module in result.eager:
            continue
        result.eager.add(module)
        queue += [target for target, lazy in edges[module] if not lazy]
    result.uses = [Use(u.name, u.importer, u.line, u.lazy or u.importer not in result.eager, u.guarded)
                   for u in result.uses]
    return result


def problems(found: Walk, wheels: list[Wheel]) -> list[str]:
    """What the GPU image plus the wheels would not import, as sentences (empty when all is well)."""
    carried = {name for wheel in wheels for name in wheel.names}
    out = []
    for use in sorted(found.uses, key=lambda u: (u.name, u.importer, u.line)):
        where = f"{use.importer} (line {use.line})"
        if use.importer in NOT_ON_THE_CHECK_PATH.get(use.name, {}):
            if not use.lazy and not use.guarded:
                out.append(f"{where} imports {use.name} with the check: make the import lazy")
        elif use.name in DATA_ONLY:
            out.append(f"{where} imports {use.name}, carried for its data files only (its import needs "
                       f"SciPy): read them with hetero.data.wheel_files")
        elif use.name in NOT_ON_THE_CHECK_PATH:
            out.append(f"{where} imports {use.name}, which the GPU image lacks: the check reaches this "
                       f"module; carry a wheel (scripts/gpu_wheels.txt), or list the importer in "
                       f"NOT_ON_THE_CHECK_PATH with why the check never runs it")
        elif use.name not in IMAGE and use.name not in carried and not use.guarded:  # a guarded one may fail
            out.append(f"{where} imports {use.name}: neither the GPU image nor scripts/gpu_wheels.txt "
                       f"provides it")
    return out


def static(argv_wheels: Path) -> int:
    found = walk()
    wheels = read_wheels(argv_wheels)
    names = defaultdict(set)
    for use in found.uses:
        names[use.name].add(use.importer.removeprefix("hetero.") + ("*" if use.lazy else ""))
    carried = {name: wheel.requirement for wheel in wheels for name in wheel.names}
    print(f"{CHECK} reaches {len(found.reached)} hetero modules ({len(found.eager)} imported with it); "
          f"third-party imports (* inside a function or a module imported from one):")
    for name in sorted(names):
        if name in NOT_ON_THE_CHECK_PATH:
            source = "never on the check's path"
        elif name in carried:
            source = carried[name] + (" (data only)" if name in DATA_ONLY else "")
        else:
            source = "image" if name in IMAGE else "MISSING"
        importers = sorted(names[name])
        shown = ", ".join(importers[:3]) + (f" and {len(importers) - 3} more" if len(importers) > 3 else "")
        print(f"  {name:<12} {source:<28} {shown}")
    found_problems = problems(found, wheels)
    for problem in found_problems:
        print("PROBLEM:", problem)
    print("static import check:", "FAILED" if found_problems else "ok")
    return 1 if found_problems else 0


# --- the stubbed import, for an environment without torch -------------------------------------------------


class _Stub(abc.ABCMeta):  # an ABCMeta, so that a class may derive from a stub and an ABC
    """A stand-in for anything in the torch family: attributes, calls and subscripts give more stubs, a call
    with one function or class (a decorator's) gives it back, and it can be a base class."""

    def __getattr__(cls, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub(f"{cls.__name__}.{name}")

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and (inspect.isfunction(args[0]) or isinstance(args[0], type)):
            return args[0]
        return _stub(f"{cls.__name__}()")

    def __getitem__(cls, item):
        return cls

    def __iter__(cls):
        return iter(())

    def __bool__(cls):
        return False

    def __or__(cls, other):
        return cls

    __ror__ = __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __or__
    __truediv__ = __rtruediv__ = __pow__ = __rpow__ = __floordiv__ = __mod__ = __and__ = __rand__ = __or__

    def __neg__(cls):
        return cls

    def __lt__(cls, other):
        return False

    __le__ = __gt__ = __ge__ = __lt__

    def __int__(cls):
        return 0

    __index__ = __int__

    def __float__(cls):
        return 0.0

    def __enter__(cls):
        return cls

    def __exit__(cls, *exc):
        return False

    def __instancecheck__(cls, obj):
        return False


def _stub(name: str) -> type:
    return _Stub(name, (), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in TORCH_FAMILY:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "2.11.0+cu130" if spec.name == "torch" else "0.0"
        return module

    def exec_module(self, module):
        pass


def origin_of(module: types.ModuleType) -> str:
    """Where ``module`` came from: stdlib, image, wheels, checkout, stub (or built-in)."""
    if isinstance(module, _StubModule):
        return "stub"
    file = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", []) or []), None)
    if file is None:
        return "built-in"
    path = Path(file).resolve()
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    if path.is_relative_to(ROOT / "hetero"):
        return "checkout"
    for entry in sys.path:
        if entry and "gpu_site" in entry and path.is_relative_to(Path(entry).resolve()):
            return "wheels"
    if "site-packages" in path.parts:
        return "image"
    if path.is_relative_to(stdlib):
        return "stdlib"
    return f"other ({path})"


def stubbed() -> int:
    import warnings

    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")  # megatron-core's notes
    sys.meta_path.insert(0, _StubFinder())
    found = walk()
    failures = []
    importlib.import_module(CHECK)  # must work: what the check imports when it starts
    for module in sorted(found.reached - {CHECK}):
        try:
            importlib.import_module(module)
        except ImportError as error:  # acceptable only for a module the check never reaches
            missing = (error.name or "").split(".")[0]
            if missing not in NOT_ON_THE_CHECK_PATH:
                failures.append(f"{module}: {error!r}")
            else:
                print(f"  skipped {module}: it imports {missing} (never on the check's path)")
        except Exception:  # noqa: BLE001 - a stub limit, not a missing package: report it
            failures.append(f"{module}: {traceback.format_exc(limit=-3)}")
    failures += _data_check()
    by_origin: dict[str, set[str]] = defaultdict(set)
    for name, module in list(sys.modules.items()):
        top = name.split(".")[0]
        if module is not None and top not in sys.stdlib_module_names and not top.startswith("_"):
            by_origin[origin_of(sys.modules.get(top, module))].add(top)
    print(f"python {sys.version.split()[0]}; imported {CHECK} and {len(found.reached) - 1} more hetero "
          f"modules; top-level modules by origin:")
    for origin in sorted(by_origin):
        print(f"  {origin:<8} {' '.join(sorted(by_origin[origin]))}")
    bad = {name for name in by_origin} - {"stub", "image", "wheels", "checkout", "stdlib", "built-in"}
    failures += [f"modules from {origin}: {sorted(by_origin[origin])}" for origin in bad]
    for failure in failures:
        print("FAILED:", failure)
    print("stubbed import check:", "FAILED" if failures else "ok")
    return 1 if failures else 0


def _data_check() -> list[str]:
    """Read what the jobs take from the carried wheels, as they will on the GPU machine."""
    import numpy as np

    from hetero.data import genome, wheel_files
    from hetero.data.video_clips import TEXTURES

    failures = []
    images, labels = wheel_files.sklearn_digits()
    print(f"  sklearn digits: images {images.shape} {images.dtype}, labels {np.bincount(labels).tolist()}")
    for name in TEXTURES:
        image = wheel_files.skimage_image(name)
        print(f"  skimage texture {name}: {image.shape} {image.dtype}, mean {image.mean():.1f}")
    sequence = genome.load_genome()
    coding = genome.coding_mask(sequence[:200_000])
    print(f"  genome: {len(sequence):,} bases; pyrodigal calls {coding.mean():.1%} of the first 200 kb "
          f"coding")
    for name in ("sklearn", "skimage", "scipy"):
        if name in sys.modules:
            failures.append(f"{name} was imported")
    return failures


# --- the CPU dry run with what the image lacks blocked ----------------------------------------------------


def image_names() -> set[str]:
    """``IMAGE`` and every top-level name this environment installs for the image's distributions (torch,
    transformers, triton, Pillow and what they require, recursively)."""
    import re
    from importlib.metadata import PackageNotFoundError, distribution, packages_distributions

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    seen: set[str] = set()
    queue = ["torch", "torchvision", "transformers", "triton", "pillow", "numpy"]
    while queue:
        name = norm(queue.pop())
        if name in seen:
            continue
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:
            continue
        seen.add(name)
        queue += [re.match(r"[A-Za-z0-9_.-]+", r).group() for r in requires if "extra ==" not in r]
    provided = packages_distributions().items()
    return set(IMAGE) | {top for top, dists in provided if any(norm(d) in seen for d in dists)}


class _Blocker(importlib.abc.MetaPathFinder):
    """Stands in for ``sys.meta_path``'s PathFinder: finds nothing of what this environment installs but
    neither the GPU image nor the wheels provide, as if it were not installed, and notes who looked."""

    def __init__(self, blocked: set[str], finder, blocked_dists: set[str] = frozenset()) -> None:
        self.blocked = blocked
        self.blocked_dists = blocked_dists  # distribution names, lower case
        self.finder = finder
        self.looked: dict[str, set[str]] = defaultdict(set)

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.split(".")[0]
        if top in self.blocked:
            frames = [f.filename for f in inspect.stack()[1:]]
            caller = next((f for f in frames if "importlib" not in f and not f.startswith("<")), "?")
            self.looked[top].add(caller)
            return None
        return self.finder.find_spec(fullname, path, target)

    def find_distributions(self, *args, **kwargs):  # importlib.metadata asks the meta path finders
        for dist in self.finder.find_distributions(*args, **kwargs):
            if (dist.metadata["Name"] or "").lower() not in self.blocked_dists:
                yield dist

    def invalidate_caches(self):
        self.finder.invalidate_caches()


def dry_run(check_args: list[str]) -> int:
    """``hetero.bench.gpu_check`` on the CPU (one process, world size 1) with every module the GPU image and
    the wheels lack refused; what it tried to import and was refused, by whom."""
    import os
    from importlib.metadata import packages_distributions

    carried = {name for wheel in read_wheels() for name in wheel.names}
    installed = set(packages_distributions())
    blocked = installed - image_names() - carried - {"hetero"}  # SciPy among them: sklearn and skimage fail
    index = sys.meta_path.index(importlib.machinery.PathFinder)
    providers = packages_distributions()
    blocked_dists = {d.lower() for top in blocked for d in providers[top]
                     if all(t in blocked for t, ds in providers.items() if d in ds)}
    blocker = sys.meta_path[index] = _Blocker(blocked, importlib.machinery.PathFinder, blocked_dists)
    for name in [m for m in sys.modules if m.split(".")[0] in blocked]:
        del sys.modules[name]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    examples = sorted(blocked & {"scipy", "wandb", "torchft", "matplotlib", "joblib", "imageio"})
    print(f"refusing {len(blocked)} installed top-level names the image lacks, e.g. {', '.join(examples)}")
    from hetero.bench import gpu_check

    rc = gpu_check.main(check_args)
    imported = sorted({m.split(".")[0] for m in sys.modules} - set(sys.stdlib_module_names))
    print("third-party top-level modules imported:", " ".join(n for n in imported if not n.startswith("_")))
    ours = [str(ROOT / "hetero"), *(str(Path(p).parent) for name in carried - DATA_ONLY
                                     if (p := getattr(sys.modules.get(name), "__file__", None)))]
    refused = []
    for name, callers in sorted(blocker.looked.items()):
        mine = sorted(c for c in callers if c.startswith(tuple(ours)))
        if mine:
            refused.append(name)
            print(f"REFUSED: {name}, looked for by {', '.join(mine)}")
        else:
            who = ", ".join(sorted({c.split("site-packages/")[-1] for c in callers}))
            print(f"  {name} looked for only by {who} (not found, as on the image)")
    for name in sorted(DATA_ONLY & {m.split(".")[0] for m in sys.modules}):
        refused.append(name)
        print(f"REFUSED: {name} was imported; it is carried for its data files only")
    print("dry run with the image's modules only:", "FAILED" if rc or refused else "ok")
    return 1 if rc or refused else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--static", action="store_true", help="the import walk against the wheel list")
    parser.add_argument("--stubbed", action="store_true",
                        help="import with torch stubbed; read the wheels' data")
    parser.add_argument("--dry-run", nargs=argparse.REMAINDER, metavar="CHECK_ARGS",
                        help="run the check on the CPU (torch installed) refusing what the image lacks; the "
                             "rest of the line goes to the check (default: a short dry run)")
    parser.add_argument("--wheels", type=Path, default=WHEEL_LIST)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.dry_run is not None:
        return dry_run(args.dry_run or ["--device", "cpu", "--steps", "2", "--gpt-layers", "1",
                                        "--kernel-numel", "65536"])
    rc = static(args.wheels) if args.static or not args.stubbed else 0
    return rc or (stubbed() if args.stubbed else 0)


if __name__ == "__main__":
    raise SystemExit(main())
