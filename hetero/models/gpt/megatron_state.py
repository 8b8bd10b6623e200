"""A megatron-backend module's weights and AdamW state as the native GPT's: native names and placements
(DTensors over the module's TP mesh where tp > 1; the routed experts' stacks over its EP mesh where
ep > 1), each holding this rank's part. Checkpoints,
``init.checkpoint``, ``init.hf`` and ``hetero convert`` read and write these, so a checkpoint moves
between the two backends and across layouts as it does between native layouts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.megatron_names import is_expert, megatron_shards, native_tensors, split_dim

MOMENTS = ("exp_avg", "exp_avg_sq")


class MegatronGPT(Protocol):
    """What these views read of ``hetero.models.gpt.megatron.MegatronGPT``."""

    config: GPTConfig
    layers: range  # the stage's layers, by native index
    tp_mesh: DeviceMesh | None  # the native plan's TP mesh (None at tp 1)
    expert_mesh: DeviceMesh | None  # the native plan's EP mesh (None at ep 1)

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...


def native_view(model: MegatronGPT, own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``own`` (by megatron-core parameter name: weights or one optimizer moment) under native names and
    placements, as copies."""
    local = native_tensors(own, model.config, model.layers, lambda value: [value])
    return {name: _placed(model, name, value) for name, value in local.items()}


def _placed(model: MegatronGPT, name: str, local: torch.Tensor) -> torch.Tensor:
    local = local.detach().clone()
    if is_expert(name):
        return local if model.expert_mesh is None else _dtensor(local, model.expert_mesh, 0)
    if model.tp_mesh is None:
        return local
    return _dtensor(local, model.tp_mesh, split_dim(name))


def _dtensor(local: torch.Tensor, mesh: DeviceMesh, dim: int | None) -> DTensor:
    """``local`` as this rank's part of a tensor over the 1-D ``mesh``: split on ``dim``, or replicated."""
    shape = list(local.shape)
    if dim is not None:
        shape[dim] *= mesh.size()
    placements = [Replicate()] if dim is None else [Shard(dim)]
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def from_view(model: MegatronGPT, view: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of ``native_view``: this rank's tensors by megatron-core parameter name."""
    local = {name: value.to_local() if isinstance(value, DTensor) else value for name, value in view.items()}
    return megatron_shards(local, model.config, model.layers, 1, 0)


def parameters(model: MegatronGPT) -> dict[str, torch.nn.Parameter]:
    return {name.removeprefix("gpt."): param for name, param in model.named_parameters()}


def weights_state(model: MegatronGPT) -> dict[str, torch.Tensor]:
    """The weights as the native model's state dict has them (a tied output under both names)."""
    view = native_view(model, {name: param.detach() for name, param in parameters(model).items()})
    if model.config.tie_embeddings and "tok_embeddings.weight" in view:
        view["output.weight"] = view["tok_embeddings.weight"]
    return view


def load_weights_state(model: MegatronGPT, view: dict[str, torch.Tensor]) -> None:
    params, values = parameters(model), from_view(model, view)
    missing = sorted(set(params) - set(values))
    if missing:
        raise KeyError(f"no native weight maps to megatron-core's {missing}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(values[name])


def optimizer_state(model: MegatronGPT, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """AdamW's state as ``get_state_dict`` flattens the native model's (``state.<name>.<key>`` and
    ``param_groups.<name>.<option>``); zeros where no step has run yet, so a load has somewhere to go."""
    params = {name: param for name, param in parameters(model).items() if param.requires_grad}
    group = optimizer.param_groups[0]
    on_param = group.get("fused") or group.get("capturable")  # where AdamW itself keeps the step count
    for param in params.values():
        if not optimizer.state[param]:
            step = torch.zeros((), dtype=torch.float32, device=param.device if on_param else torch.device("cpu"))
            optimizer.state[param] = {"step": step, **{key: torch.zeros_like(param) for key in MOMENTS}}
    out: dict[str, Any] = {}
    for key in MOMENTS:
        moments = native_view(model, {name: optimizer.state[param][key] for name, param in params.items()})
        out |= {f"state.{name}.{key}": value for name, value in moments.items()}
    step = next(iter(optimizer.state[param]["step"] for param in params.values()))
    options = {key: value for key, value in group.items() if key != "params"}
    for name in {key.split(".", 1)[1].rsplit(".", 1)[0] for key in out}:
        out[f"state.{name}.step"] = step.clone()
        out |= {f"param_groups.{name}.{option}": value for option, value in options.items()}
    return out


def load_optimizer_state(model: MegatronGPT, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    params = {name: param for name, param in parameters(model).items() if param.requires_grad}
    step = next(value for key, value in state.items() if key.endswith(".step"))
    for key in MOMENTS:
        values = from_view(model, {name[len("state."):-len(key) - 1]: value for name, value in state.items()
                                   if name.startswith("state.") and name.endswith("." + key)})
        for name, param in params.items():
            optimizer.state[param][key].copy_(values[name])
    for param in params.values():
        optimizer.state[param]["step"].copy_(step)
