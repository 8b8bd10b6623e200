"""Apply a module's layout to the vision encoder: the pipeline stage's blocks, TP over heads and MLP,
activation checkpointing, FSDP2.

Data parallelism is the runtime's gradient sync (or FSDP2). The encoder's sequence is short, so it runs
with cp=1 (the config check says so).
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hetero.models.vit.model import VisionEncoder
from hetero.parallel.blocks import attention_mlp_plan, keep_stage_layers, wrap_blocks
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.options import ParallelOptions


def keep_stage(model: VisionEncoder, stage: int, num_stages: int) -> None:
    """Drop everything pipeline stage ``stage`` does not own: the embedding after the first stage, the
    features' norm, the projector and the merger before the last; block names stay global."""
    keep_stage_layers(model.layers, stage, num_stages)
    if stage > 0:
        model.patch_embed, model.cls_token, model.pos_embed, model.pre_norm = None, None, None, None
    if stage < num_stages - 1:
        model.feature_norm, model.projector, model.merger, model.is_last_stage = None, None, None, False


def parallelize_vision(model: VisionEncoder, mesh: ModuleMesh, options: ParallelOptions) -> VisionEncoder:
    if mesh.layout.pp > 1:
        keep_stage(model, mesh.coord.pp, mesh.layout.pp)
    if mesh.layout.tp > 1:
        tp_mesh = mesh.mesh["tp"]
        for block in model.layers.values():
            parallelize_module(block, tp_mesh, attention_mlp_plan("mlp."))
        for head in (model.projector, model.merger):
            if head is not None:
                parallelize_module(head, tp_mesh, {"proj_in": ColwiseParallel(), "proj_out": RowwiseParallel()})
    wrap_blocks(model, model.layers, mesh, options)
    return model
