"""The last steps every model's plan applies to its blocks: activation checkpointing, then FSDP2."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from hetero.parallel.fsdp import apply_fsdp
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.options import ParallelOptions


def wrap_blocks(model: nn.Module, blocks: nn.ModuleDict, mesh: ModuleMesh, options: ParallelOptions) -> None:
    """Recompute each block in backward and/or shard parameters over dp×cp, as ``options`` ask."""
    if options.activation_checkpointing:
        for name in list(blocks):
            blocks[name] = checkpoint_wrapper(blocks[name])
    if options.fsdp:
        apply_fsdp(model, blocks.values(), mesh)
