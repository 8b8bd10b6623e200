"""What parity tests read off a parallel rank: every gradient whole, under its single-process name."""

from __future__ import annotations

import torch
from torch import nn

from hetero.parallel.data import AllReduceGradSync
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.options import ParallelOptions


def synced_full_grads(
    named: list[tuple[str, nn.Parameter]], mesh: ModuleMesh, options: ParallelOptions
) -> dict[str, torch.Tensor]:
    """Sum gradients over DP (FSDP2 already has), then gather TP shards (collective over TP); names drop
    activation checkpointing's wrapper so they match the reference model's."""
    if mesh.layout.dp > 1 and not options.fsdp:
        AllReduceGradSync(named, mesh.group("dp")).sync()
    grads = {}
    for name, p in named:
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name.replace("_checkpoint_wrapped_module.", "")] = grad.detach().clone()
    return grads
