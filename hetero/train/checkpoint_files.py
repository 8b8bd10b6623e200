"""A checkpoint on disk: where it lives, when it counts as complete, and how it is read without trust.

    <checkpoint dir>/step_000010/        complete: renamed into place after every file was written
        .metadata, __<rank>_0.distcp     torch.distributed.checkpoint: weights and optimizer states
        local/rank<r>.pt                 rank-local state (torch.save of tensors and plain containers)
        hf/<module>/                     of a module imported with init.hf: its source's config and side
                                         files, tensor dtypes, passed-over tensors (hetero.interop.hf_source)
        hetero.json                      step (and its losses), data position, modules and layouts, SHA-256
                                         of every file
    <checkpoint dir>/.step_000020.partial  a save in progress or interrupted: never loaded

A save writes into the ``.partial`` directory and rank 0 commits it (``commit``: hashes, ``hetero.json``,
one ``rename``), so an interrupted save leaves the previous checkpoint as it was. Reading verifies every
file against ``hetero.json`` first, unpickles DCP's ``.metadata`` with an allowlist of DCP's own classes
and loads rank-local files with ``weights_only=True``: nothing in a checkpoint can run code.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

FORMAT = "hetero-checkpoint/1"
MANIFEST = "hetero.json"
_COMPLETE = re.compile(r"^step_(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt, unsafe or made for another model."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def partial_dir(root: Path, step: int) -> Path:
    return root / f".step_{step:06d}.partial"


def complete_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _COMPLETE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(partial: Path, final: Path, manifest: dict[str, Any], keep: int) -> None:
    """Seal a fully written ``partial`` directory as ``final`` and keep only the newest ``keep``."""
    files = sorted(p for p in partial.rglob("*") if p.is_file())
    manifest = manifest | {
        "format": FORMAT,
        "files": {str(p.relative_to(partial)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files},
    }
    staged = partial / (MANIFEST + ".tmp")
    with staged.open("w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    staged.rename(partial / MANIFEST)
    _fsync_dir(partial)
    partial.rename(final)
    _fsync_dir(final.parent)
    for old in complete_checkpoints(final.parent)[:-keep] if keep > 0 else ():
        doomed = old.with_name(f".{old.name}.deleting")  # no longer looks complete while it is removed
        old.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def remove_partials(root: Path) -> None:
    """Drop what interrupted saves left behind."""
    for path in root.glob(".step_*") if root.is_dir() else ():
        shutil.rmtree(path, ignore_errors=True)


def read_manifest(path: Path) -> dict[str, Any]:
    """The verified manifest of checkpoint ``path``: every listed file present with its recorded bytes."""
    manifest_path = path / MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist; pass an existing step_* directory or train.resume=auto")
    if not manifest_path.is_file():
        raise CheckpointError(
            f"checkpoint {path} has no {MANIFEST}: it is not a complete hetero checkpoint (interrupted save?); "
            f"resume from another one"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{manifest_path} is corrupt ({err}); resume from another checkpoint") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path}: format {manifest.get('format')!r} is not {FORMAT!r}")
    for name, entry in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path}: {name} is listed in {MANIFEST} but missing")
        found = {"bytes": file.stat().st_size, "sha256": _sha256(file)}
        if found != entry:
            raise CheckpointError(
                f"checkpoint {path}: {name} is truncated or corrupt ({found['bytes']} bytes, SHA-256 "
                f"{found['sha256'][:12]}...; {MANIFEST} records {entry['bytes']} bytes, {entry['sha256'][:12]}...); "
                f"resume from another checkpoint"
            )
    return manifest


def _allowed_global(module: str, name: str) -> bool:
    """The classes DCP's metadata pickles: its own records, torch sizes, dtypes and layouts, paths."""
    if module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"):
        return not name.startswith("__")
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
    return (module, name) in {
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, origin: Path):
        super().__init__(io.BytesIO(data))
        self.origin = origin

    def find_class(self, module: str, name: str) -> Any:
        if not _allowed_global(module, name):
            raise CheckpointError(
                f"{self.origin} asks to load {module}.{name}, which is not checkpoint metadata: the file may "
                f"carry code and was not loaded; use a checkpoint hetero wrote"
            )
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, with ``.metadata`` unpickled through the allowlist above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        metadata = _MetadataUnpickler(path.read_bytes(), path).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} does not hold DCP metadata")
        return metadata


def check_metadata(path: Path) -> None:
    """Unpickle ``path/.metadata`` through the allowlist, raising ``CheckpointError`` if it is unsafe."""
    SafeFileSystemReader(str(path)).read_metadata()


def save_local(state: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)


def load_local(path: Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    """Rank-local state, loaded with ``weights_only=True`` (tensors and plain containers only) onto ``device``
    (the CPU RNG state stays on the CPU)."""
    try:
        state = torch.load(path, weights_only=True, map_location=device)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{path} holds more than tensors and plain containers and was not loaded (it may carry code): "
            f"{str(err).splitlines()[0]}"
        ) from None
    if "rng" in state:
        state["rng"] = state["rng"].cpu()
    return state
