"""Hugging Face checkpoints out of hetero: one module of a running job, from whatever layout it runs under
(``export_hf``), or of a saved hetero checkpoint (``convert_checkpoint``, ``hetero convert``).

Every rank of the job calls ``export_hf``; the module's ranks take part. Each of its weights is gathered
whole on the pipeline stage that holds it (TP and FSDP2 shards), and one rank per stage (tp, cp and dp
all 0) writes that stage's file, ``model-<stage>-of-<stages>.safetensors``. After a barrier the module's
first rank writes ``config.json`` and ``model.safetensors.index.json``, which maps every weight to its
file. Each file is written under a temporary name and renamed once complete, the index last: a
directory with an index is a whole checkpoint. The ranks must share the file system.

Names and config come from the module's kind (``Kind.hf_export``). A module imported with ``init.hf``
keeps its source's config (the file itself where the kind exports it unchanged, as a ``gpt`` does) and
side files (generation config, tokenizer, processor), each tensor's dtype there, and copies from it the
tensors it passes over (a vision tower's pooling head, its blocks after the feature layer), so an import
followed by an export gives the same files' tensors bit for bit. ``convert_checkpoint`` takes all that
from the copy the checkpoint kept of the source (``hf_source.py``), so it writes what the live job would.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hetero.errors import ConfigError
from hetero.interop.hf_checkpoint import DTYPES, INDEX, HFCheckpoint, HFExport
from hetero.interop.hf_source import CONFIG, KEPT, SIDE_FILES, KeptSource
from hetero.kinds.registry import KindRegistry


def export_hf(runtime, module: str, path: str | Path) -> Path:
    """Write ``module`` of ``runtime`` (a ``hetero.runtime.Runtime``) to directory ``path``."""
    path = Path(path)
    node = runtime.graph.nodes[module]
    source = HFCheckpoint(node.settings.init.hf) if node.settings.init.hf is not None else None
    export = node.kind.hf_export(node.config, source)
    if not export.config:
        raise ConfigError(f"{module}: a {node.kind.name} module has no Hugging Face checkpoint of its own; write the "
                          "whole VLM it belongs to (export_vlm, hetero convert --vlm)")
    files = write_stages(runtime, module, export, source, path, 0, node.layout.pp)
    dist.barrier()
    if dist.get_rank() == node.layout.ranks[0]:
        finish(path, files, export.config, source)
    dist.barrier()
    return path


def write_stages(runtime, module: str, export: HFExport, source: HFCheckpoint | None, path: Path, first: int,
                 total: int) -> list[str]:
    """Every rank: write this rank's pipeline stage of ``module`` as file ``first + stage`` of ``total``
    where it is the stage's writer (tp, cp and dp all 0), its weights gathered whole (TP and FSDP2
    shards); the carried tensors go with stage 0. The names of all the module's files."""
    node = runtime.graph.nodes[module]
    state = runtime.modules.get(module)
    if state is not None:
        coord = state.mesh.coord
        # the same order on every rank of the stage; another implementation's weights under native names
        model = state.model
        weights = model.weights_state() if hasattr(model, "weights_state") else model.state_dict()
        whole = hf_tensors(export, source, ((name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor)
                                            for name, tensor in weights.items()))
        if coord.tp == coord.cp == coord.dp == 0:
            if coord.pp == 0 and source is not None:
                whole |= {name: source.tensor(carried) for name, carried in export.carried.items()}
            path.mkdir(parents=True, exist_ok=True)
            write_atomically(path / shard_name(first + coord.pp, total), lambda f: save_tensors(whole, f))
    return [shard_name(first + stage, total) for stage in range(node.layout.pp)]


def saved_module(checkpoint: Path, module: str, registry: KindRegistry):
    """Module ``module`` of the hetero checkpoint directory ``checkpoint``, rebuilt in this process from
    the config it recorded as its kind in ``registry``, its weights read whole (DCP gathers every saved
    shard): its kind, config, ``(name, tensor)`` weights, and the source it was imported from as the
    checkpoint kept it (or None)."""
    import torch.distributed.checkpoint as dcp
    from omegaconf import OmegaConf

    from hetero.train.checkpoint_files import SafeFileSystemReader, read_manifest

    if (checkpoint / "config.json").is_file():
        raise ConfigError(f"{checkpoint} is a Hugging Face checkpoint, which needs no conversion: hetero reads it "
                          f"directly under any layout with {module}.init.hf={checkpoint}")
    models = read_manifest(checkpoint)["identity"]["models"]
    if module not in models:
        raise ConfigError(f"{checkpoint} holds modules {', '.join(models)}, not {module!r}")
    kind = registry[models[module]["kind"]]
    config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(kind.config), models[module]["model"]))
    model = kind.build(config)
    state = {module: {"model": model.state_dict()}}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(checkpoint)))
    kept = checkpoint / KEPT / module
    return kind, config, list(state[module]["model"].items()), KeptSource(kept) if kept.is_dir() else None


def convert_checkpoint(checkpoint: str | Path, module: str, path: str | Path, registry: KindRegistry) -> Path:
    """Write ``module`` of the hetero checkpoint directory ``checkpoint`` (a ``step_*`` directory of
    ``hetero train``) to ``path`` as a Hugging Face checkpoint, in one process (``saved_module``, its kind
    from ``registry``, which ``hetero convert`` assembles). A module
    imported with ``init.hf`` is written with the source the checkpoint kept (``hf_source.py``): its
    config and side files unchanged, its tensors in their source dtypes, the passed-over ones copied."""
    checkpoint, path = Path(checkpoint), Path(path)
    kind, config, weights, source = saved_module(checkpoint, module, registry)
    export = kind.hf_export(config, source)
    if not export.config:
        raise ConfigError(f"{module}: a {kind.name} module has no Hugging Face checkpoint of its own; convert the "
                          "whole VLM it belongs to (hetero convert --llava)")
    tensors = hf_tensors(export, source, weights)
    if source is not None:
        tensors |= {name: source.tensor(carried) for name, carried in export.carried.items()}
    path.mkdir(parents=True, exist_ok=True)
    file = shard_name(0, 1)
    write_atomically(path / file, lambda f: save_tensors(tensors, f))
    finish(path, [file], export.config, source)
    return path


def hf_tensors(export: HFExport, source: HFCheckpoint | None,
                weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The whole ``weights`` (name, tensor) the export writes, by HF name, on the CPU in their source's dtype."""
    named = {hf: tensor.detach().to("cpu") for name, tensor in weights if (hf := export.name_of(name)) is not None}
    return {hf: tensor.to(source.dtype(export.source_name(hf))) if source is not None else tensor
            for hf, tensor in export.assemble(named).items()}


def finish(path: Path, files: list[str], config: dict, source: HFCheckpoint | None) -> None:
    """Write ``config.json`` (the source's own file when ``config`` is its config), the source's side
    files, and the index of ``files`` (already in ``path``), the index last."""
    from safetensors import safe_open

    weight_map, total = {}, 0
    for file in files:
        with safe_open(path / file, framework="pt") as handle:
            for name in handle.keys():
                weight_map[name] = file
                sliced = handle.get_slice(name)
                total += math.prod(sliced.get_shape()) * DTYPES[sliced.get_dtype()].itemsize
    if source is not None and json.loads((source.path / CONFIG).read_text()) == config:
        write_atomically(path / CONFIG, partial(shutil.copyfile, source.path / CONFIG))
    else:
        write_atomically(path / CONFIG, lambda f: Path(f).write_text(json.dumps(config, indent=2)))
    for name in SIDE_FILES if source is not None else ():
        if (source.path / name).is_file():
            write_atomically(path / name, partial(shutil.copyfile, source.path / name))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_atomically(path / INDEX, lambda f: Path(f).write_text(json.dumps(index, indent=2)))


def shard_name(stage: int, stages: int) -> str:
    return f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"


def save_tensors(tensors: dict[str, torch.Tensor], file: str) -> None:
    from safetensors.torch import save_file

    save_file({name: t.contiguous() for name, t in tensors.items()}, file, metadata={"format": "pt"})


def write_atomically(final: Path, write) -> None:
    temporary = final.with_name(f".{final.name}.partial")
    write(str(temporary))
    os.replace(temporary, final)
