"""What a hetero checkpoint keeps of the Hugging Face checkpoint a module was imported from (``init.hf``),
so that ``hetero convert`` writes offline what ``export_hf`` writes from the live job: the source's
``config.json`` and side files (generation config, tokenizer, processor) byte for byte, each tensor in
its source dtype, and the tensors the model passes over copied back.

    <step dir>/hf/<module>/
        config.json, generation_config.json, ...   the source's files, copied as they are (those present)
        source.json                                where the source was, each tensor's dtype, the carried ones
        carried.safetensors                        the tensors the model passes over (if any)

Rank 0 writes it into the checkpoint's ``.partial`` directory, so it is committed with the weights
(hashed in ``hetero.json``, renamed into place whole). The config is kept as it is: an import fixes
every field that shapes a weight (the YAML sets only a ``gpt``'s ``seq_len`` and a ``vit``'s
``feature_layer``, which shape none), so the trained weights always fit the source's config.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hetero.interop.hf_checkpoint import DTYPES, HFCheckpoint

if TYPE_CHECKING:
    from hetero.graph import Graph
    from hetero.kinds.registry import Kind

KEPT = "hf"  # under a checkpoint's step directory, one directory per imported module
CONFIG, RECORD, CARRIED = "config.json", "source.json", "carried.safetensors"
SIDE_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
    "chat_template.json", "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
)


@dataclass(frozen=True)
class ImportedSource:
    """A module of kind ``kind`` and model ``config`` imported from the HF checkpoint at ``path``."""

    kind: Kind
    config: Any
    path: Path

    def keep(self, directory: Path) -> None:
        """Write what ``KeptSource`` reads into ``directory`` (new)."""
        from safetensors.torch import save_file

        source = HFCheckpoint(self.path)
        carried = sorted(set(self.kind.hf_export(self.config, source).carried.values()))
        directory.mkdir(parents=True)
        for name in (CONFIG, *SIDE_FILES):
            if (self.path / name).is_file():
                shutil.copyfile(self.path / name, directory / name)
        if carried:
            save_file(dict(source.tensors(carried)), str(directory / CARRIED), metadata={"format": "pt"})
        record = {"path": str(self.path), "dtypes": _dtype_names(source), "carried": carried}
        (directory / RECORD).write_text(json.dumps(record, indent=1))


def imported_sources(graph: Graph) -> dict[str, ImportedSource]:
    """Every module of ``graph`` that starts from ``init.hf``, by name."""
    return {name: ImportedSource(node.kind, node.config, Path(node.settings.init.hf))
            for name, node in graph.nodes.items() if node.settings.init.hf is not None}


class KeptSource(HFCheckpoint):
    """The source kept at ``path`` (``ImportedSource.keep``), read as the ``HFCheckpoint`` an export takes:
    its config, every tensor's name and dtype, and (only) the carried tensors' data."""

    def __init__(self, path: str | Path):  # not HFCheckpoint's: the source's weights are not kept
        self.path = Path(path)
        self.config = json.loads((self.path / CONFIG).read_text())
        record = json.loads((self.path / RECORD).read_text())
        self.dtypes: dict[str, str] = record["dtypes"]
        self.files = dict.fromkeys(record["carried"], self.path / CARRIED)
        self.bytes_read = 0

    def names(self) -> list[str]:
        return list(self.dtypes)

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self.dtypes[name]]


def _dtype_names(source: HFCheckpoint) -> dict[str, str]:
    """Each tensor's safetensors dtype (``F32``, ``BF16``, ...), read from the files' headers."""
    from safetensors import safe_open

    names: dict[str, str] = {}
    for file in sorted(set(source.files.values())):
        with safe_open(file, framework="pt") as handle:
            names |= {name: handle.get_slice(name).get_dtype()
                      for name in handle.keys() if source.files.get(name) == file}
    return dict(sorted(names.items()))
