"""Apply a module's layout to the vision encoder (hetero's ViT or a Qwen tower): the pipeline stage's blocks,
TP over heads and MLP (and the mergers' inner width), activation checkpointing, FSDP2.

Data parallelism is the runtime's gradient sync (or FSDP2). The encoder's sequence is short, so it runs
with cp=1 (the config check says so).
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hetero.models.vit.model import VisionEncoder
from hetero.models.vit.qwen_tower import QwenVisionTower
from hetero.parallel.blocks import attention_mlp_plan, keep_stage_layers, wrap_blocks
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.options import ParallelOptions


# a Qwen tower's block: q, k, v and the MLP's inner units split by heads and units, the outputs reduced
QWEN_BLOCK = {"attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(), "attention.v": ColwiseParallel(),
              "attention.proj": RowwiseParallel(), "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(),
              "mlp.down": RowwiseParallel()}


def keep_stage(model: VisionEncoder, stage: int, num_stages: int) -> None:
    """Drop everything pipeline stage ``stage`` does not own: the embedding after the first stage, the
    features' norm, the projector and the merger before the last; block names stay global."""
    keep_stage_layers(model.layers, stage, num_stages)
    if stage > 0:
        model.patch_embed, model.cls_token, model.pos_embed, model.pre_norm = None, None, None, None
    if stage < num_stages - 1:
        model.feature_norm, model.projector, model.merger, model.is_last_stage = None, None, None, False


def _block_plan(model: VisionEncoder | QwenVisionTower, block) -> dict:
    if not isinstance(model, QwenVisionTower):
        return attention_mlp_plan("mlp.")
    return {name: style for name, style in QWEN_BLOCK.items() if name != "mlp.gate" or block.mlp.gate is not None}


def parallelize_vision(model: VisionEncoder | QwenVisionTower, mesh: ModuleMesh, options: ParallelOptions
                       ) -> VisionEncoder | QwenVisionTower:
    if mesh.layout.pp > 1:
        keep_stage(model, mesh.coord.pp, mesh.layout.pp)
    if mesh.layout.tp > 1:
        tp_mesh = mesh.mesh["tp"]
        heads = [model.merger, *model.deepstack.values()] if isinstance(model, QwenVisionTower) else [
            model.projector, model.merger]
        for block in model.layers.values():
            parallelize_module(block, tp_mesh, _block_plan(model, block))
        for head in heads:
            if head is not None:
                parallelize_module(head, tp_mesh, {"proj_in": ColwiseParallel(), "proj_out": RowwiseParallel()})
    wrap_blocks(model, model.layers, mesh, options)
    return model
