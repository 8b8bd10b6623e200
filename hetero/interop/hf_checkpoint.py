"""A Hugging Face checkpoint directory: ``config.json`` and its weights, one ``model.safetensors`` or
shards listed by ``model.safetensors.index.json``. Tensors are read lazily, one at a time (or a slice
of one), so a caller that takes only what it holds never has the whole model in memory:
``load_into`` fills a parallelized model (DTensor shards of TP or FSDP2, a pipeline stage's layers)
with the slices each rank holds. ``bytes_read`` counts what was read.

Needs the ``hf`` extra (``safetensors``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hetero.errors import ConfigError

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class HFCheckpoint:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        config = self.path / "config.json"
        if not config.is_file():
            raise ConfigError(f"{self.path} is not a Hugging Face checkpoint: it has no config.json")
        self.config: dict = json.loads(config.read_text())
        if (self.path / INDEX).is_file():
            weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
            self.files = {name: self.path / file for name, file in weight_map.items()}
        elif (self.path / SINGLE).is_file():
            from safetensors import safe_open

            with safe_open(self.path / SINGLE, framework="pt") as handle:
                self.files = dict.fromkeys(handle.keys(), self.path / SINGLE)
        else:
            raise ConfigError(f"{self.path} has no {SINGLE} or {INDEX}; hetero reads safetensors weights only")
        self.bytes_read = 0

    def names(self) -> list[str]:
        return list(self.files)

    def tensor(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Tensor ``name`` (only ``index`` of it, when given), read from its file."""
        from safetensors import safe_open

        if name not in self.files:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        with safe_open(self.files[name], framework="pt") as handle:
            tensor = handle.get_tensor(name) if index is None else handle.get_slice(name)[index]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name``, read from its file's header (no data)."""
        from safetensors import safe_open

        with safe_open(self.files[name], framework="pt") as handle:
            return tuple(handle.get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        """The dtype tensor ``name`` is stored in."""
        from safetensors import safe_open

        with safe_open(self.files[name], framework="pt") as handle:
            return DTYPES[handle.get_slice(name).get_dtype()]

    def tensors(self, names) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for each of ``names``, each file opened once."""
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[name], []).append(name)
        for file, held in by_file.items():
            with safe_open(file, framework="pt") as handle:
                for name in held:
                    yield name, handle.get_tensor(name)


def renamed(name: str, layers: str, in_layer: dict[str, str], top: dict[str, str]) -> str | None:
    """The HF name of hetero weight ``name`` by renaming its module: ``layers.<i>.<inner>`` becomes
    ``<layers>.<i>.<in_layer[inner]>``, a module outside the layers ``top[module]``; None if neither maps it."""
    module, _, leaf = name.rpartition(".")
    parts = module.split(".", 2)
    if parts[0] == "layers" and len(parts) == 3 and parts[2] in in_layer:
        return f"{layers}.{parts[1]}.{in_layer[parts[2]]}.{leaf}"
    if module in top:
        return f"{top[module]}.{leaf}"
    return None


@dataclass
class HFExport:
    """How a kind writes a model as a Hugging Face checkpoint: the ``config.json``; the HF name of each of
    the model's weights (``name_of``, None leaves one out, e.g. an output layer tied to the embedding); for
    a model imported from ``source``, that checkpoint's name of each exported weight (its dtype is kept)
    and the tensors copied from it unchanged (``carried``: export name -> source name), those the model
    passes over but the HF model needs; ``assemble``: the tensors the file holds, from those named by
    ``name_of`` (a mixture of experts' stacked weights become each expert's, or transformers' fused ones),
    applied to each pipeline stage's tensors."""

    config: dict
    name_of: Callable[[str], str | None]
    source_name: Callable[[str], str] = lambda name: name
    carried: dict[str, str] = field(default_factory=dict)
    assemble: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda tensors: tensors


def load_into(tensors: Mapping[str, torch.Tensor], checkpoint: HFCheckpoint, hf_name) -> int:
    """Copy into every tensor of ``tensors`` (a model's ``state_dict(keep_vars=True)``, materialized,
    e.g. after ``to_empty``) the slice of checkpoint tensor ``hf_name(name)`` that this rank holds: a
    DTensor's local shard, a plain tensor whole. A weight ``hf_name`` maps to None (an output layer tied to
    the embedding) is skipped. Returns the bytes read."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for name, tensor in tensors.items():
        hf = hf_name(name.replace("._checkpoint_wrapped_module", ""))
        if hf is None:
            continue
        if hf not in checkpoint.files:
            raise ConfigError(f"{checkpoint.path} has no weight {hf!r} (for {name})")
        if isinstance(tensor, DTensor):
            shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
            local, index = tensor.to_local(), tuple(slice(o, o + s) for o, s in zip(offset, shape))
        else:
            local, index = tensor, None
        data = checkpoint.tensor(hf, index)
        if tuple(data.shape) != tuple(local.shape):
            raise ConfigError(f"{checkpoint.path}: {hf} has shape {tuple(data.shape)} where {name} takes "
                              f"{tuple(local.shape)}")
        with torch.no_grad():
            local.copy_(data.to(local.dtype))
    return checkpoint.bytes_read
