"""The end of a training step that every rank of a multi-module job agrees on: which modules hold a
non-finite gradient, one gradient-norm clip over every module, and each module's optimizer step."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from hetero.train.module_runtime import ModuleRuntime


def nonfinite_modules(
    names: Sequence[str], modules: Mapping[str, ModuleRuntime], bad_losses: Mapping[str, bool]
) -> dict[str, list[int]]:
    """Modules with a NaN or infinite gradient (or a loss flagged in ``bad_losses``) on some rank, and
    those ranks; the same on every rank. Check before the gradient sync, which would spread the values."""
    flags = torch.zeros(len(names), dist.get_world_size())
    for i, name in enumerate(names):
        module = modules.get(name)
        bad = (module is not None and module.nonfinite()) or bad_losses.get(name, False)
        flags[i, dist.get_rank()] = float(bad)
    dist.all_reduce(flags)
    return {name: [int(r) for r in torch.nonzero(flags[i]).flatten()] for i, name in enumerate(names) if flags[i].any()}


def clip_world_wide(names: Sequence[str], modules: Mapping[str, ModuleRuntime], grad_clip: float) -> float:
    """Global gradient norm over every module, agreed by every rank; clip when it exceeds ``grad_clip``
    (> 0). Infinite when any gradient is not finite."""
    squares = torch.zeros(len(names), dtype=torch.float64)
    for i, name in enumerate(names):
        if name in modules:
            squares[i] = modules[name].squared_grad_norm()
    # Every rank of a module holds the same value and the others hold 0: MAX agrees world-wide. (Under
    # DiLoCo a module's replicas hold different local gradients; MAX then takes the largest norm.)
    nonfinite = (~torch.isfinite(squares)).to(torch.float64)
    squares = torch.nan_to_num(squares, nan=0.0, posinf=0.0)
    dist.all_reduce(squares, op=dist.ReduceOp.MAX)
    dist.all_reduce(nonfinite, op=dist.ReduceOp.MAX)
    if nonfinite.any():
        return math.inf
    norm = math.sqrt(float(squares.sum()))
    if grad_clip > 0 and norm > grad_clip:
        factor = grad_clip / (norm + 1e-6)
        for module in modules.values():
            module.scale_grads(factor)
    return norm


def sync_clip_and_step(names: Sequence[str], modules: Mapping[str, ModuleRuntime], grad_clip: float, step: int) -> float:
    """Each module's replica sync, the world-wide clip, then (when the norm is finite) every optimizer
    step at its learning rate for ``step``; returns the gradient norm."""
    for module in modules.values():
        module.replica_sync.before_step()
    grad_norm = clip_world_wide(names, modules, grad_clip)
    if math.isfinite(grad_norm):
        for module in modules.values():
            for group in module.optimizer.param_groups:
                group["lr"] = module.setup.optimizer.lr_at(step)
            module.optimizer.step()
            module.replica_sync.after_step()
    return grad_norm
