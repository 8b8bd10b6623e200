"""Experiments written in Python, as a YAML file would give them, for tests that build a runtime on ranks.

    config = experiment(4, {"vision": module("vit", VISION, {"dp": 4}), "llm": module("gpt", LLM, {"tp": 2, "dp": 2})},
                        edges=[("vision", "llm")], global_batch=8, microbatches=2)
    runtime = build_runtime(config)  # hetero.testing.kinds: the built-in kinds

Each module's ``micro_batch_size`` is set so that the global batch splits into ``microbatches`` on every
module. The result goes through ``experiment_from_dict``, the same schema and checks as a YAML file.
"""

from __future__ import annotations

from dataclasses import asdict, is_dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from hetero.config import ExperimentConfig, experiment_from_dict
from hetero.runtime import Runtime

# The main job (colocated_vlm) at the batch its multi-rank tests were written for: 16 rows a step, the
# vision encoder's microbatches of 4 rows, the LLM's of 8 (the shipped recipe's 44 rows cost test time).
MAIN_JOB_SMALL_BATCH = ["batch.global_batch_size=16", "batch.micro_batch_size=8", "vision.micro_batch_size=4"]


def module(kind: str, config: Any, layout: dict, optim: Any = None, parallel: Any = None, **extra: Any) -> dict:
    """One module's block: ``config``, ``optim`` and ``parallel`` as dataclasses or dicts."""
    block = {"kind": kind, "model": _plain(config), "layout": dict(layout)}
    if optim is not None:
        block["optim"] = _plain(optim)
    if parallel is not None:
        block["parallel"] = _plain(parallel)
    return block | extra


def experiment(
    world_size: int, modules: dict[str, dict], *, edges=(), global_batch: int, microbatches: int, seed: int = 0,
    grad_clip: float = 0.0, train: dict | None = None, **top: Any,
) -> ExperimentConfig:
    raw: dict = {"world_size": world_size, "seed": seed, "name": "test",
                 "batch": {"global_batch_size": global_batch, "micro_batch_size": 1},
                 "train": {"grad_clip": grad_clip, "wandb": "disabled"} | (train or {})} | top
    for name, block in modules.items():
        dp = block["layout"].get("dp", 1)
        raw[name] = {"micro_batch_size": global_batch // (microbatches * dp)} | block
    raw["edges"] = [_edge(e) for e in edges]
    return experiment_from_dict(raw)


def _edge(edge) -> dict:
    if isinstance(edge, dict):
        return {k: _plain(v) for k, v in edge.items()}
    src, dst = edge
    return {"src": src, "dst": dst}


def _plain(value: Any) -> Any:
    return asdict(value) if is_dataclass(value) else value


def module_grads(runtime: Runtime) -> dict[str, torch.Tensor]:
    """Every gradient of this rank's modules, whole, named ``<module>.<parameter>`` as a single-process
    model names it (activation checkpointing's wrapper dropped). ``full_tensor()`` is collective over TP
    (and FSDP's shards): every rank of a module calls this."""
    grads: dict[str, torch.Tensor] = {}
    for name, state in runtime.modules.items():
        own = {}
        for pname, p in state.model.named_parameters():
            if not p.requires_grad:  # frozen
                continue
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            own[pname.replace('_checkpoint_wrapped_module.', '')] = g.detach().clone()
        if hasattr(state.model, "native"):  # another implementation's names and shards (megatron-core's)
            own = state.model.native(own)
        grads |= {f"{name}.{pname}": g for pname, g in own.items()}
    return grads


def load_weights(runtime: Runtime, name: str, state: dict[str, torch.Tensor]) -> None:
    """Give module ``name`` the weights of a single-process model's ``state_dict()`` (whole tensors on
    every rank; each rank keeps its shard). Every rank of the module calls this."""
    model = runtime.modules[name].model
    if hasattr(model, "load_native"):  # another implementation's names and shards (megatron-core's)
        model.load_native(state)
    else:
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
