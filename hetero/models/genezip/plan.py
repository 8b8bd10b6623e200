"""Apply a module's layout to GeneZip: TP over the heads and MLP of every block (encoders, main network,
decoders: the GPT block's plan), activation checkpointing, FSDP2.

Everything between blocks (embedding, boundary router, chunk selection, de-chunking, output) runs on the
replicated residual stream, so it is the same on every TP rank and needs no plan. Data parallelism is the
runtime's gradient sync (or FSDP2). Sequences are a few hundred bases and chunking gathers across the
whole sequence, so GeneZip runs with cp=1 and pp=1 (the config check says so).
"""

from __future__ import annotations

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor.parallel import parallelize_module

from hetero.models.genezip.model import Blocks, GeneZip
from hetero.models.gpt.plan import block_plan
from hetero.parallel.fsdp import apply_fsdp
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.options import ParallelOptions


def parallelize_genezip(model: GeneZip, mesh: ModuleMesh, options: ParallelOptions) -> GeneZip:
    stacks = [m.layers for m in model.modules() if isinstance(m, Blocks)]
    if mesh.layout.tp > 1:
        for layers in stacks:
            for block in layers.values():
                parallelize_module(block, mesh.mesh["tp"], block_plan())
    if options.activation_checkpointing:
        for layers in stacks:
            for name in list(layers):
                layers[name] = checkpoint_wrapper(layers[name])
    if options.fsdp:
        apply_fsdp(model, [block for layers in stacks for block in layers.values()], mesh, options)
    return model
