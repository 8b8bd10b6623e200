"""A part of a whole-VLM Hugging Face checkpoint (a LLaVA's or a Qwen-VL's tower, projector or language
model) read as the checkpoint of that module alone, so that each kind's import code reads it unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hetero.errors import ConfigError


class VLMPart:
    """One part of a whole-VLM checkpoint (``HFCheckpoint`` or ``KeptSource``), read as the checkpoint of that
    module alone: its config (the part's, with an ``architectures``), names without the part's prefix
    (the LM's as in a ``*ForCausalLM``), each mapped to the whole checkpoint's by ``raw``. The part's
    weights sit under the prefix of the one whose name ends in ``anchor``."""

    def __init__(self, whole: Any, part: str, config: dict, anchor: str, kind: str):
        self.whole, self.part, self.path, self.config = whole, part, whole.path, config
        names = whole.names()
        found = next((n for n in names if n.endswith(anchor)), None)
        if found is None:
            raise ConfigError(f"{whole.path}: no {anchor} among its weights: not {kind}")
        self.prefix = found.removesuffix(anchor)
        self.head = next((n for n in names if n.endswith("lm_head.weight")), None) if part == "text" else None
        self._names = {self._local(n): n for n in names if self._local(n) is not None}

    def _local(self, raw: str) -> str | None:
        if raw == self.head:
            return "lm_head.weight"
        if not raw.startswith(self.prefix):
            return None
        return ("model." if self.part == "text" else "") + raw.removeprefix(self.prefix)

    def raw(self, name: str) -> str:
        """The whole checkpoint's name of this part's ``name``."""
        if name not in self._names:
            raise KeyError(f"{self.path}: no tensor {name!r} in its {self.part} part")
        return self._names[name]

    @property
    def files(self) -> dict[str, Path]:
        return {name: self.whole.files[raw] for name, raw in self._names.items() if raw in self.whole.files}

    @property
    def bytes_read(self) -> int:
        return self.whole.bytes_read

    def names(self) -> list[str]:
        return list(self._names)

    def tensor(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        return self.whole.tensor(self.raw(name), index)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.whole.shape(self.raw(name))

    def dtype(self, name: str) -> torch.dtype:
        return self.whole.dtype(self.raw(name))

    def tensors(self, names) -> Iterator[tuple[str, torch.Tensor]]:
        local = {self.raw(name): name for name in names}
        for raw, tensor in self.whole.tensors(local):
            yield local[raw], tensor
