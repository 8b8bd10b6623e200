"""What every model's plan applies to its blocks: a pipeline stage's share of them, the TP plan of an
attention + MLP block, then activation checkpointing and FSDP2."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from hetero.parallel.fsdp import apply_fsdp
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.options import ParallelOptions


def stage_layers(num_layers: int, stage: int, num_stages: int) -> range:
    """Contiguous layers of a pipeline stage; earlier stages take one extra when it does not divide."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def keep_stage_layers(blocks: nn.ModuleDict, stage: int, num_stages: int) -> None:
    """Drop the blocks pipeline stage ``stage`` does not own; their names stay global."""
    keep = stage_layers(len(blocks), stage, num_stages)
    for name in list(blocks):
        if int(name) not in keep:
            del blocks[name]


def attention_mlp_plan(mlp: str) -> dict:
    """TP plan of a block with ``attention.wq/wk/wv/wo`` and an MLP ``{mlp}w1``/``{mlp}w2``: heads and the
    MLP's hidden units split over TP, the output projections reduce."""
    return {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        f"{mlp}w1": ColwiseParallel(),
        f"{mlp}w2": RowwiseParallel(),
    }


def wrap_blocks(model: nn.Module, blocks: nn.ModuleDict, mesh: ModuleMesh, options: ParallelOptions) -> None:
    """Recompute each block in backward and/or shard parameters over dp×cp, as ``options`` ask."""
    if options.activation_checkpointing:
        for name in list(blocks):
            blocks[name] = checkpoint_wrapper(blocks[name])
    if options.fsdp:
        apply_fsdp(model, blocks.values(), mesh, options)
