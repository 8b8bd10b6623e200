"""Apply a module's layout to the vision encoder: TP over heads and MLP, activation checkpointing, FSDP2.

Data parallelism is the runtime's gradient sync (or FSDP2). The encoder's sequence is short and its
inputs are bounded, so it runs with cp=1 and pp=1 (the config check says so).
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hetero.kinds.vit.model import VisionEncoder
from hetero.parallel.blocks import attention_mlp_plan, wrap_blocks
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.options import ParallelOptions


def parallelize_vision(model: VisionEncoder, mesh: ModuleMesh, options: ParallelOptions) -> VisionEncoder:
    if mesh.layout.tp > 1:
        tp_mesh = mesh.mesh["tp"]
        for block in model.layers.values():
            parallelize_module(block, tp_mesh, attention_mlp_plan("mlp."))
        if model.projector is not None:
            parallelize_module(model.projector, tp_mesh, {"proj_in": ColwiseParallel(), "proj_out": RowwiseParallel()})
    wrap_blocks(model, model.layers, mesh, options)
    return model
