"""A graph imported from a whole VLM written back as one such directory: a vit → projector → gpt graph from a
LLaVA (``LlavaForConditionalGeneration``, ``llava.py``) or a vit → gpt graph from a Qwen2.5-VL or Qwen3-VL
(``qwen_vl.py``), each module's ``init.hf`` the same directory. From the running job (``export_vlm``, every
rank calls it) or from a hetero checkpoint (``convert_vlm``, ``hetero convert --vlm``).

Each weight goes under its name in the source and in the source's dtype; the tensors the modules pass
over (a tower's final LayerNorm and pooling head, its blocks after the feature layer) are copied from
it; the source's ``config.json`` and side files (tokenizer, chat template, image processor, processor
config) are copied as they are. The modules' pipeline stages are the files, one each, the index last,
so an export of an untrained import gives the source's tensors bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from hetero.errors import ConfigError
from hetero.interop.hf_checkpoint import HFCheckpoint, HFExport
from hetero.interop.hf_export import finish, hf_tensors, save_tensors, saved_module, shard_name, write_atomically, write_stages
from hetero.interop.llava import is_llava
from hetero.interop.qwen_vl import is_qwen_vl
from hetero.kinds.registry import KindRegistry

KINDS = ("vit", "projector", "gpt")  # the graph's modules, in the order their files are numbered


def vlm_modules(kinds: dict[str, str]) -> list[str]:
    """The vision, projector (a LLaVA's) and LLM modules among ``kinds`` (module -> kind): one vit and one gpt,
    at most one projector."""
    chosen = []
    for kind in KINDS:
        names = [name for name, k in kinds.items() if k == kind]
        if len(names) > 1 or (not names and kind != "projector"):
            raise ConfigError(f"a whole VLM is one vit, one gpt and (a LLaVA) one projector module; the graph has "
                              f"{len(names)} of kind {kind} ({', '.join(names) or 'none'})")
        chosen += names
    return chosen


def whole_export(kind, config, source, module: str) -> HFExport:
    """``kind``'s export of ``module`` under the whole checkpoint's names."""
    if source is None or not (is_llava(source.config) or is_qwen_vl(source.config)):
        raise ConfigError(f"{module} was not imported from a whole VLM (its init.hf a LlavaForConditionalGeneration, "
                          "Qwen2_5_VLForConditionalGeneration or Qwen3VLForConditionalGeneration directory): only such "
                          "a graph is written back as one")
    part = kind.hf_export(config, source)

    def assemble(tensors: dict) -> dict:  # the part's tensors (its experts or the tower's qkv joined), renamed
        return {part.source_name(name): tensor for name, tensor in part.assemble(tensors).items()}

    return HFExport(source.config, part.name_of, carried={part.source_name(n): s for n, s in part.carried.items()},
                    assemble=assemble)


def _same_source(sources: dict[str, HFCheckpoint]) -> HFCheckpoint:
    first, *others = sources
    for other in others:
        if sources[other].config != sources[first].config:
            raise ConfigError(f"{first} and {other} were imported from different VLM checkpoints "
                              f"({sources[first].path}, {sources[other].path}); write them separately")
    return sources[first]


def export_vlm(runtime, path: str | Path) -> Path:
    """Write the graph of ``runtime`` (a ``hetero.runtime.Runtime``) to directory ``path`` as one VLM."""
    path = Path(path)
    nodes = runtime.graph.nodes
    modules = vlm_modules({name: node.kind.name for name, node in nodes.items()})
    sources = {m: HFCheckpoint(nodes[m].settings.init.hf) if nodes[m].settings.init.hf else None for m in modules}
    exports = {m: whole_export(nodes[m].kind, nodes[m].config, sources[m], m) for m in modules}
    source = _same_source(sources)
    total, files = sum(nodes[m].layout.pp for m in modules), []
    for module in modules:
        files += write_stages(runtime, module, exports[module], source, path, len(files), total)
    dist.barrier()
    if dist.get_rank() == 0:
        finish(path, files, source.config, source)
    dist.barrier()
    return path


def convert_vlm(checkpoint: str | Path, path: str | Path, registry: KindRegistry) -> Path:
    """Write the vit, (projector) and gpt modules of the hetero checkpoint ``checkpoint`` to ``path`` as one
    VLM, in one process, from the sources the checkpoint kept (the modules' kinds from ``registry``)."""
    from hetero.train.checkpoint_files import read_manifest

    checkpoint, path = Path(checkpoint), Path(path)
    models = read_manifest(checkpoint)["identity"]["models"]
    modules = vlm_modules({name: model["kind"] for name, model in models.items()})
    path.mkdir(parents=True, exist_ok=True)
    files, sources = [], {}
    for module in modules:
        kind, config, weights, sources[module] = saved_module(checkpoint, module, registry)
        export = whole_export(kind, config, sources[module], module)
        tensors = hf_tensors(export, sources[module], weights)
        tensors |= {name: sources[module].tensor(carried) for name, carried in export.carried.items()}
        files.append(shard_name(len(files), len(modules)))
        write_atomically(path / files[-1], lambda f: save_tensors(tensors, f))
    source = _same_source(sources)
    finish(path, files, source.config, source)
    return path
