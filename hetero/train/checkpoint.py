"""Checkpoints of a multi-module job: saved per module, resharded on load, resumed automatically.

Every module's weights and optimizer state go through ``torch.distributed.checkpoint`` under keys
``<module>.model.*`` and ``<module>.optimizer.*`` (DTensor shards, pipeline stages with global layer
names; a frozen module has weights alone, its trained parameters' optimizer state when some are frozen:
a resume that trains what was frozen starts those modules' AdamW afresh and says so), so a checkpoint saved under one set of layouts loads under another: DCP reads each rank's new
shard from whichever saved shards hold it. What only makes sense on one rank — error-feedback buffers,
DiLoCo's outer state and inner weights, activation-compression compensation, the RNG — goes into a
rank-local file that a resume reads only when the layouts and compression settings are unchanged; after
a layout change it starts fresh (and rank 0 says so). The data position is the step: batch ``k`` is a
pure function of the seed and ``k``.

A module imported with ``init.hf`` also keeps, under ``hf/<module>``, what ``hetero convert`` needs of its
source to write it back as the source's kind of checkpoint (``hetero.interop.hf_source``).

The runtime side is ``Checkpointable``: the modules on this rank and its rank-local state.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from hetero.config import CheckpointConfig
from hetero.errors import ConfigError
from hetero.interop.hf_source import KEPT, ImportedSource
from hetero.train.checkpoint_files import (
    CheckpointError,
    SafeFileSystemReader,
    check_metadata,
    commit,
    complete_checkpoints,
    load_local,
    partial_dir,
    read_manifest,
    remove_partials,
    save_local,
    step_dir,
)


class Checkpointable(Protocol):
    step: int
    device: torch.device

    def checkpoint_modules(self) -> dict[str, tuple[nn.Module, torch.optim.Optimizer]]:
        """The modules this rank holds: each one's model and optimizer."""
        ...

    def local_state(self) -> dict[str, Any]:
        """This rank's state that has no meaning on another rank (tensors and plain containers)."""
        ...

    def load_local_state(self, state: dict[str, Any]) -> None: ...

    def reset_local_state(self) -> None:
        """Start rank-local state afresh from the (just loaded) weights, after a layout change."""
        ...


@dataclass(frozen=True)
class RunIdentity:
    """What a checkpoint must share with the run that loads it, and what decides rank-local reuse."""

    models: dict[str, dict[str, Any]]  # module -> {"kind": ..., "model": {...}}: must match
    data: dict[str, Any]  # seed, global batch size, sample reuse: the data order; must match
    local: dict[str, Any]  # layouts and compression settings: rank-local state is reused only if equal

    def as_json(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self)))


def resolve_resume(config: CheckpointConfig, root: Path) -> Path | None:
    """The checkpoint to resume from, or None; a named one that does not exist is an error."""
    if config.resume == "never":
        return None
    if config.resume == "auto":
        found = complete_checkpoints(root)
        return found[-1] if found else None
    path = Path(config.resume)
    if not path.is_dir():
        raise ConfigError(
            f"train.checkpoint.resume={config.resume}: no checkpoint directory there; pass a step_* directory, "
            f"auto (the newest under {root}, if any) or never"
        )
    return path


def check_resumable(path: Path, identity: RunIdentity) -> tuple[dict[str, Any], bool]:
    """Verify checkpoint ``path`` for this run (files, safe metadata, same models and data order) before
    any process group exists. Returns its manifest and whether rank-local state carries over."""
    manifest = read_manifest(path)
    check_metadata(path)
    saved = manifest["identity"]
    current = identity.as_json()
    if set(saved["models"]) != set(current["models"]):
        raise CheckpointError(
            f"checkpoint {path} holds modules {sorted(saved['models'])}, this run has {sorted(current['models'])}; "
            f"resume with the same modules or set train.checkpoint.resume=never"
        )
    diffs = []
    for name, model in current["models"].items():
        old = saved["models"][name]
        diffs += [f"{name}.kind: saved {old['kind']!r}, now {model['kind']!r}"] if old["kind"] != model["kind"] else []
        diffs += [
            f"{name}.model.{key}: saved {old['model'].get(key)!r}, now {value!r}"
            for key, value in model["model"].items()
            if old["model"].get(key) != value
        ]
    if diffs:
        raise CheckpointError(
            f"checkpoint {path} was saved for another model ({'; '.join(diffs)}); restore those settings "
            f"or set train.checkpoint.resume=never"
        )
    for key, value in current["data"].items():
        if saved["data"].get(key) != value:
            raise CheckpointError(
                f"checkpoint {path} was saved with {key}={saved['data'].get(key)!r}, this run has {value!r}: the data "
                f"position would not carry over; keep {key} or set train.checkpoint.resume=never"
            )
    return manifest, saved["local"] == current["local"]


# Optimizer state keyed by parameter name (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``): pipeline
# stages hold different parameters, and a per-stage list of param groups would collide under one key.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _module_state(modules: dict[str, tuple[nn.Module, torch.optim.Optimizer | None]]) -> dict[str, Any]:
    state = {}
    for name, (model, optimizer) in modules.items():
        if hasattr(model, "checkpoint_state"):  # another implementation, kept under native names (megatron's)
            state[name] = model.checkpoint_state(optimizer)
            continue
        if optimizer is None:  # nothing of it trains: its weights alone
            state[name] = {"model": get_model_state_dict(model, options=_OPTIONS)}
            continue
        model_state, optimizer_state = get_state_dict(model, optimizer, options=_OPTIONS)
        state[name] = {"model": model_state, "optimizer": optimizer_state}
    return state


def _without_saved_optimizer(state: dict[str, Any], path: Path) -> list[str]:
    """Modules of ``state`` whose optimizer state checkpoint ``path`` lacks (saved while they, or some of
    their parameters, were frozen): their optimizer is left out of ``state``, to start afresh."""
    saved = set(SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata)
    missing = [name for name, parts in state.items() if "optimizer" in parts
               and any(f"{name}.optimizer.{key}" not in saved for key in parts["optimizer"])]
    for name in missing:
        del state[name]["optimizer"]
    return missing


class Checkpointer:
    """Saves and loads one job's checkpoints; every rank holds one and calls it at the same points.
    ``sources``: the modules imported with ``init.hf`` (``hetero.interop.hf_source.imported_sources``),
    whose sources each checkpoint keeps."""

    def __init__(self, config: CheckpointConfig, root: Path, identity: RunIdentity,
                 sources: Mapping[str, ImportedSource] | None = None):
        self.config, self.root, self.identity = config, root, identity
        self.sources = dict(sources or {})
        self.fresh_optimizers: list[str] = []  # modules the last load left without optimizer state
        self._pending: Future | None = None
        self._commit_error: BaseException | None = None
        self._committed = threading.Event()
        self._group: dist.ProcessGroup | None = None

    def attach(self) -> None:
        """Create the process group async saves talk over (on every rank, after the modules' groups)."""
        if self.config.async_save and self.config.every:
            self._group = dist.new_group(backend="gloo")

    def due(self, step: int, last_step: int) -> bool:
        return self.config.every > 0 and (step % self.config.every == 0 or step == last_step)

    def save(self, runtime: Checkpointable, step: int, losses: Mapping[str, float] | None = None) -> None:
        """Write a checkpoint of ``runtime`` after ``step``; it becomes visible only once complete.
        ``losses``: that step's loss figures, kept in the manifest (a resume with no step left reports them)."""
        self.wait()
        rank = dist.get_rank()
        partial, final = partial_dir(self.root, step), step_dir(self.root, step)
        if rank == 0:
            remove_partials(self.root)
            partial.mkdir(parents=True)
            for module, source in self.sources.items():
                source.keep(partial / KEPT / module)
        dist.barrier()
        local = runtime.local_state() | {"rng": torch.get_rng_state()}
        save_local(local, partial / "local" / f"rank{rank}.pt")
        state = _module_state(runtime.checkpoint_modules())
        manifest = {"step": step, "world_size": dist.get_world_size(), "identity": self.identity.as_json()}
        if losses is not None:
            manifest["losses"] = {key: float(value) for key, value in losses.items()}
        writer = FileSystemWriter(str(partial))
        if not self.config.async_save:
            dcp.save(state, storage_writer=writer)
            if rank == 0:
                commit(partial, final, manifest, self.config.keep)
            return
        future = dcp.async_save(state, storage_writer=writer, process_group=self._group)
        self._committed.clear()
        if rank == 0:  # DCP's coordinator finishes only after every rank has written its files
            future.add_done_callback(lambda done: self._commit_when_written(done, partial, final, manifest))
        else:
            self._committed.set()
        self._pending = future

    def _commit_when_written(self, done: Future, partial: Path, final: Path, manifest: dict[str, Any]) -> None:
        try:
            done.result()
            commit(partial, final, manifest, self.config.keep)
        except BaseException as err:  # raised on the training thread at the next wait()
            self._commit_error = err
        finally:
            self._committed.set()

    def wait(self) -> None:
        """Block until an async save in flight is written (and, on rank 0, committed)."""
        if self._pending is not None:
            self._pending.result()
            self._committed.wait()  # the future's callbacks may still be running when result() returns
            self._pending = None
        if self._commit_error is not None:
            error, self._commit_error = self._commit_error, None
            raise CheckpointError(f"the async checkpoint save failed: {error}") from error

    def close(self) -> None:
        self.wait()
        dist.barrier()  # rank 0's commit of the last save is on disk before anyone reads it

    def load(self, runtime: Checkpointable, path: Path, same_local: bool) -> int:
        """Load checkpoint ``path`` (checked by ``check_resumable``) into ``runtime``; the step it ends."""
        manifest = read_manifest(path)
        modules = runtime.checkpoint_modules()
        state = _module_state(modules)
        fresh = _without_saved_optimizer(state, path)
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)))
        for name, (model, optimizer) in modules.items():
            if hasattr(model, "load_checkpoint_state"):
                model.load_checkpoint_state(state[name], optimizer)
                continue
            if "optimizer" not in state[name]:
                set_model_state_dict(model, state[name]["model"], options=_OPTIONS)
                continue
            set_state_dict(
                model, optimizer, model_state_dict=state[name]["model"], optim_state_dict=state[name]["optimizer"],
                options=_OPTIONS,
            )
        everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, fresh)
        self.fresh_optimizers = sorted({name for names in everyone for name in names})
        if same_local:
            self.load_rank_local(runtime, path)
        else:
            runtime.reset_local_state()
        runtime.step = int(manifest["step"])
        return runtime.step

    @staticmethod
    def load_rank_local(runtime: Checkpointable, path: Path) -> None:
        """This rank's rank-local state and RNG from checkpoint ``path``, saved under the same layouts."""
        local = load_local(path / "local" / f"rank{dist.get_rank()}.pt", runtime.device)
        torch.set_rng_state(local.pop("rng"))
        runtime.load_local_state(local)


def check_module_sources(graph_models: dict[str, dict[str, Any]], sources: dict[str, Path]) -> dict[Path, Any]:
    """Before any process group: each ``init.checkpoint`` a complete checkpoint holding its module with the
    same kind and model (``graph_models``: this run's ``RunIdentity.models``). Returns each checkpoint's
    verified manifest (each read once)."""
    manifests: dict[Path, Any] = {}
    for name, path in sources.items():
        field = f"{name}.init.checkpoint={path}"
        try:
            manifests[path] = manifests[path] if path in manifests else read_manifest(path)
        except CheckpointError as err:
            raise ConfigError(f"{field}: {err}") from None
        saved = manifests[path]["identity"]["models"]
        if name not in saved:
            raise ConfigError(f"{field}: the checkpoint holds modules {sorted(saved)}, not {name}")
        model, old = graph_models[name], saved[name]
        diffs = [f"kind: saved {old['kind']!r}, now {model['kind']!r}"] if old["kind"] != model["kind"] else []
        diffs += [f"model.{key}: saved {old['model'].get(key)!r}, now {value!r}"
                  for key, value in model["model"].items() if old["model"].get(key) != value]
        if diffs:
            raise ConfigError(f"{field}: saved for another {name} ({'; '.join(diffs)})")
    return manifests


def load_module_weights(modules: dict[str, tuple[nn.Module, Any]], sources: dict[str, Path]) -> None:
    """Every rank: the weights of the modules it holds from their ``init.checkpoint`` (each checkpoint read
    collectively, also by ranks that take nothing from it), resharded to this run's layouts."""
    for path in sorted(set(sources.values())):
        wanted = {name: model for name, (model, _) in modules.items() if sources.get(name) == path}
        state = {name: {"model": model.weights_state() if hasattr(model, "weights_state")
                        else get_model_state_dict(model, options=_OPTIONS)} for name, model in wanted.items()}
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)))
        for name, model in wanted.items():
            if hasattr(model, "load_weights_state"):
                model.load_weights_state(state[name]["model"])
            else:
                set_model_state_dict(model, state[name]["model"], options=_OPTIONS)
