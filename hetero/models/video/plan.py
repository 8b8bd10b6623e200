"""Apply a module's layout to the video generator: TP over heads and MLP, activation checkpointing, FSDP2.

Data parallelism is the runtime's gradient sync (or FSDP2). Frames are short chunks and the KV cache is
bounded by the memory policy, so the generator runs with cp=1 and pp=1 (the config check says so).
Every score bias (the slot-distance and patch-offset tables, and the learned memory's log-importance
that enters as an argument) is shared by all heads; under TP each rank's heads add only their part of its
gradient, so hooks sum those gradients over the TP group: on the tables, and on the bias argument (which
carries the router's gradient back to a router replicated on every TP rank).
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.tensor.parallel import parallelize_module

from hetero.models.video.model import VideoGenerator
from hetero.parallel.blocks import attention_mlp_plan, wrap_blocks
from hetero.parallel.gradient_sum import sum_gradient, summed
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.options import ParallelOptions


def _sum_bias_gradient(group: dist.ProcessGroup):
    def pre_hook(module, args):
        x, distances, past, bias = args
        if bias is not None and bias.requires_grad:
            bias = sum_gradient(bias, group)
        return x, distances, past, bias

    return pre_hook


def parallelize_video(model: VideoGenerator, mesh: ModuleMesh, options: ParallelOptions) -> VideoGenerator:
    if mesh.layout.tp > 1:
        tp_mesh = mesh.mesh["tp"]
        for block in model.layers.values():
            parallelize_module(block, tp_mesh, attention_mlp_plan(""))
            group = tp_mesh.get_group()
            for table in (block.attention.distance_bias, block.attention.offset_bias):
                table.register_hook(lambda grad, group=group: summed(grad, group))
            block.attention.register_forward_pre_hook(_sum_bias_gradient(group))
    wrap_blocks(model, model.layers, mesh, options)
    return model
