"""Shard sets: webdataset tar shards per split, written atomically, with a manifest that vouches for them.

A shard set is a directory holding, for each split, tar shards written by ``webdataset.ShardWriter``
(``<split>-000000.tar``, ...), plus ``manifest.json`` listing every shard with its sample count, byte
size and SHA-256. The whole set is written into a hidden temporary directory next to the target and
renamed into place only when complete, so an interrupted write never leaves a directory that looks like
a shard set: a directory is a complete set exactly when it holds a manifest. Readers check each shard
against the manifest before decoding it, so a truncated or corrupted file is reported by name.

Samples are dicts in webdataset's convention: ``__key__`` plus one entry per file extension, encoded
and decoded by webdataset's default handlers (``npy`` arrays, ``txt`` strings, ``cls`` integers,
``json`` objects, ...).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import webdataset as wds

MANIFEST = "manifest.json"
FORMAT = "hetero-shards/1"


class ShardError(RuntimeError):
    """A shard set that cannot be read as written: missing manifest, missing, truncated or corrupt shard."""


def write_shard_set(
    out_dir: str | os.PathLike,
    splits: Mapping[str, Iterable[dict[str, Any]]],
    samples_per_shard: int,
    meta: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write ``splits`` (split name -> samples) as a shard set in ``out_dir`` and return its manifest.

    ``meta`` is stored in the manifest as is (what the data is, how it was made). An existing
    non-empty ``out_dir`` raises ``FileExistsError`` unless ``overwrite`` is set; it is then replaced
    only after the new set is complete.
    """
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard={samples_per_shard} must be at least 1")
    out_dir = Path(out_dir)
    if not overwrite:
        _refuse_existing(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    try:
        manifest = {
            "format": FORMAT,
            "meta": meta or {},
            "splits": {
                name: _write_split(staging, name, samples, samples_per_shard)
                for name, samples in splits.items()
            },
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        staging.chmod(0o755)  # mkdtemp makes it private to its owner; a shard set is for every reader
        _move_into_place(staging, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def ensure_shard_set(
    out_dir: str | os.PathLike, write: Callable[[], dict[str, Any]], wanted: Mapping[str, Any]
) -> dict[str, Any]:
    """The manifest of the shard set in ``out_dir``, calling ``write`` first if no complete set is there;
    ``ShardError`` naming every field of ``wanted`` that the set's ``meta`` records differently, and
    ``FileExistsError`` saying what ``out_dir`` holds if it is neither empty nor a shard set.

    Safe when several processes call it at once: one rename wins and the others read its set.
    """
    out_dir = Path(out_dir)
    if not (out_dir / MANIFEST).exists():
        try:
            _refuse_existing(out_dir)  # before ``write`` makes the samples: a foreign directory is refused at once
            return write()
        except FileExistsError:
            if not (out_dir / MANIFEST).exists():
                raise
    manifest = load_manifest(out_dir)
    differences = [
        f"{key}={manifest['meta'].get(key)!r} (wanted {value!r})"
        for key, value in wanted.items()
        if manifest["meta"].get(key) != value
    ]
    if differences:
        raise ShardError(
            f"{out_dir} holds a different shard set ({manifest['meta'].get('dataset', 'unnamed data')}): "
            f"{', '.join(differences)}; delete that directory or choose another one"
        )
    return manifest


def load_manifest(shard_dir: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the complete shard set in ``shard_dir``; ``ShardError`` if there is none."""
    path = Path(shard_dir) / MANIFEST
    if not path.is_file():
        raise ShardError(
            f"{path} does not exist: {shard_dir} is not a complete shard set (never written, or the write "
            f"was interrupted); write it again"
        )
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ShardError(f"{path}: format {manifest.get('format')!r} is not {FORMAT!r}")
    return manifest


def read_split(shard_dir: str | os.PathLike, split: str, bad_shards: str = "error") -> list[dict[str, Any]]:
    """All decoded samples of ``split``, in the order they were written.

    Every rank reads the whole split: webdataset's node and worker splitting are turned off because
    they split by global rank (``RANK``/``WORLD_SIZE``), while hetero gives each module's DP rank its
    rows by that module's own DP coordinate. A missing or corrupt shard raises ``ShardError``, or with
    ``bad_shards="skip"`` is left out with a warning (every rank skips the same shards).
    """
    shard_dir = Path(shard_dir)
    splits = load_manifest(shard_dir)["splits"]
    if split not in splits:
        raise ShardError(f"{shard_dir / MANIFEST} has no split {split!r}; it has {sorted(splits)}")
    samples: list[dict[str, Any]] = []
    for shard in splits[split]["shards"]:
        try:
            samples.extend(read_shard(shard_dir / shard["file"], shard))
        except ShardError as err:
            if bad_shards != "skip":
                raise
            warnings.warn(f"{err}; skipped (train.bad_shards=skip): its {shard['count']} samples are left out")
    if not samples:
        raise ShardError(f"{shard_dir}: no readable shard in split {split!r}")
    return samples


def read_columns(
    shard_dir: str | os.PathLike, split: str, name: str, columns: Callable[[list[dict[str, Any]]], dict[str, Any]]
) -> dict[str, Any]:
    """``columns(read_split(shard_dir, split))`` (tensors, lists and numbers), kept beside the shards in
    ``.<name>-<split>.pt`` so that the next reader (another rank, the next job) loads a few tensors
    instead of decoding every sample. The file records the SHA-256 of each shard it came from: a set
    written again makes it stale, and a stale or unreadable file is rebuilt. Written atomically; read
    with ``weights_only``. (Shards that change on disk afterwards go unnoticed by readers of the file.)"""
    shard_dir = Path(shard_dir)
    splits = load_manifest(shard_dir)["splits"]
    digests = [shard["sha256"] for shard in splits.get(split, {}).get("shards", [])]
    path = shard_dir / f".{name}-{split}.pt"
    try:
        cached = torch.load(path, weights_only=True)
        if cached["shards"] == digests:
            return cached["columns"]
    except (OSError, RuntimeError, EOFError, KeyError, TypeError, pickle.UnpicklingError):
        pass  # absent, partial or from another version: rebuilt below
    built = columns(read_split(shard_dir, split))
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    torch.save({"shards": digests, "columns": built}, partial)
    os.replace(partial, path)  # several ranks may race here: each writes its own file, one rename wins
    return built


def _refuse_existing(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(
            f"{out_dir} already exists and is not empty: it holds {contents(out_dir)}; choose another path or "
            f"overwrite it"
        )


def contents(path: str | os.PathLike, shown: int = 4) -> str:
    """What ``path`` holds, for a message: a file, a shard set and its data, or its first ``shown``
    entries (each shard set among them with its data)."""
    path = Path(path)
    if not path.is_dir():
        return "a file"
    if (path / MANIFEST).is_file():
        return _shard_set(path)
    entries = sorted(path.iterdir())
    named = [f"{entry.name}/ ({_shard_set(entry)})" if (entry / MANIFEST).is_file()
             else entry.name + ("/" if entry.is_dir() else "") for entry in entries[:shown]]
    return ", ".join(named) + (f" and {len(entries) - shown} more" if len(entries) > shown else "")


def _shard_set(shard_dir: Path) -> str:
    try:
        return f"a shard set of {load_manifest(shard_dir)['meta'].get('dataset', 'unnamed data')}"
    except (ShardError, ValueError, KeyError, TypeError):
        return f"a {MANIFEST} that is not a shard set's"


def _write_split(
    staging: Path, split: str, samples: Iterable[dict[str, Any]], samples_per_shard: int
) -> dict[str, Any]:
    counts: dict[str, int] = {}
    writer = None
    try:
        for sample in samples:
            if writer is None:  # opened lazily: ShardWriter creates its first file on construction
                pattern = str(staging / f"{split}-%06d.tar")
                writer = wds.ShardWriter(pattern, maxcount=samples_per_shard, verbose=0, mtime=0)
            writer.write(sample)
            name = Path(writer.fname).name
            counts[name] = counts.get(name, 0) + 1
    finally:
        if writer is not None:
            writer.close()
    if not counts:
        raise ValueError(f"split {split!r} has no samples")
    shards = [
        {"file": name, "count": count, **_fingerprint(staging / name)} for name, count in counts.items()
    ]
    return {"count": sum(counts.values()), "shards": shards}


def _fingerprint(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"bytes": path.stat().st_size, "sha256": digest}


def _move_into_place(staging: Path, out_dir: Path, overwrite: bool) -> None:
    old = None
    if overwrite and out_dir.exists():
        old = staging.with_suffix(".old")
        out_dir.rename(old)
    try:
        staging.rename(out_dir)
    except OSError as err:
        # Another process renamed its copy into place first (rename onto a non-empty directory fails).
        if old is not None and not out_dir.exists():
            old.rename(out_dir)
        raise FileExistsError(f"{out_dir} appeared while it was being written: {err}") from err
    if old is not None:
        shutil.rmtree(old)


def read_shard(path: Path, entry: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The decoded samples of one shard, checked against its manifest ``entry`` (size, SHA-256, count)."""
    if not path.is_file():
        raise ShardError(f"shard {path} is listed in the manifest but missing")
    found = _fingerprint(path)
    if found != {"bytes": entry["bytes"], "sha256": entry["sha256"]}:
        raise ShardError(
            f"shard {path} is truncated or corrupt: {found['bytes']} bytes with SHA-256 "
            f"{found['sha256'][:12]}..., the manifest expects {entry['bytes']} bytes with "
            f"{entry['sha256'][:12]}...; write the set again"
        )
    # A list of one URL (not a string) so that braces in the path are not expanded as shard patterns; a
    # fixed seed keeps webdataset from drawing one from Python's global random state.
    dataset = wds.WebDataset(
        [str(path)], shardshuffle=False, nodesplitter=None, workersplitter=None, empty_check=False, seed=0
    ).decode()
    samples = list(dataset)
    if len(samples) != entry["count"]:
        raise ShardError(f"shard {path} holds {len(samples)} samples; the manifest lists {entry['count']}")
    return samples
