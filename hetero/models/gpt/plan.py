"""Apply a module's layout to a GPT (torchtitan style): pipeline split, TP/SP, CP, EP, activation
checkpointing, and FSDP2 when asked. Without FSDP2 the runtime synchronizes gradients over dp×cp itself
with a ``GradSync`` (experts' over their expert-data-parallel group).

Experts under TP: attention splits its heads over TP as in a dense block, while each TP rank routes its
own part of the sequence through the mixture of experts (sequence parallelism's part; without SP it takes
its part of the replicated stream and the outputs are gathered back). Every TP rank holds the whole
router, shared experts and experts (or its EP shard of them): the router's and shared experts' gradients
are partial sums over TP (``SequenceParallel`` weights, reduced with the others), the experts' are
summed over their expert-data-parallel group, which spans TP.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from hetero.models.gpt.model import GPT
from hetero.models.gpt.moe import MoEFeedForward
from hetero.parallel.blocks import keep_stage_layers, wrap_blocks
from hetero.parallel.context import ContextParallelAttention
from hetero.parallel.expert_parallel import ExpertAllToAll, shard_experts
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.options import ParallelOptions


def keep_stage(model: GPT, stage: int, num_stages: int) -> None:
    """Drop everything a pipeline stage does not own; layer names stay global."""
    keep_stage_layers(model.layers, stage, num_stages)
    if stage > 0:
        model.tok_embeddings = None
    if stage < num_stages - 1:
        model.norm = None
        model.output = None


GQA_COLUMNS = ("wq", "wk", "wv")  # grouped-query attention's projections split by heads


def block_plan(sequence_parallel: bool = False, qk_norm: bool = False, experts: bool = False,
               shared_experts: bool = False, shared_gate: bool = False,
               columns: tuple[str, ...] = GQA_COLUMNS) -> dict[str, nn.Module]:
    """TP plan of a GPT ``Block``: heads and SwiGLU units split, the output projections reduce (into a
    sequence-sharded residual stream under sequence parallelism). The per-head norms of q and k see
    this rank's heads (dim 1 of (batch, heads, seq, head_dim)): their weights are replicated and their
    gradients partial sums over the TP group, reduced with the other partial gradients. ``experts``: the
    block's MLP is a mixture of experts (with ``shared_experts``, and their ``shared_gate``), fed this rank's part of the sequence
    (the module docstring). ``columns``: the attention's projections split by heads (multi-head latent
    attention's: the q and kv expansions; its latents, their norms and the rotary key stay whole, so under SP
    its input, gathered, enters as a plain tensor)."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, nn.Module] = {f"attention.{name}": ColwiseParallel() for name in columns}
    plan["attention.wo"] = RowwiseParallel(output_layouts=residual)
    if not experts:
        plan |= {
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=residual),
        }
    else:  # the router and shared experts see this rank's tokens (flattened: dim 0)
        routed = ["router"] + ([f"shared.{w}" for w in ("w1", "w3", "w2")] if shared_experts else [])
        routed += ["shared_gate"] if shared_gate else []
        plan |= {f"feed_forward.{name}": SequenceParallel(sequence_dim=0, use_local_output=True) for name in routed}
        # Its part of the stream in (under SP as it is, else cut from the replicated one), the output back
        # into the stream's layout (without SP, the parts gathered).
        plan["feed_forward"] = PrepareModuleInputOutput(
            input_layouts=(residual, None), desired_input_layouts=(Shard(1), None), use_local_input=True,
            output_layouts=(Shard(1),), desired_output_layouts=(residual,), use_local_output=True)
    if qk_norm:
        plan |= {"attention.q_norm": SequenceParallel(sequence_dim=1, use_local_output=True),
                 "attention.k_norm": SequenceParallel(sequence_dim=1, use_local_output=True)}
    if sequence_parallel:
        plan |= {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None),
                use_local_output=columns != GQA_COLUMNS,
            ),
            "ffn_norm": SequenceParallel(),
        }
        if not experts:  # the experts take the sequence-sharded stream as it is
            plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def apply_tensor_parallel(model: GPT, mesh: ModuleMesh, sequence_parallel: bool) -> None:
    tp_mesh = mesh.mesh["tp"]
    # With sequence parallelism the residual stream between blocks is split over the sequence (Shard(1))
    # inside the TP group; attention and MLP gather it back (Replicate) for their column-parallel inputs.
    residual = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, nn.Module] = {}
    if model.tok_embeddings is not None:  # vocab-parallel embedding
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
        if sequence_parallel:
            model.sequence_part = (mesh.coord.tp, mesh.layout.tp)
    if model.output is not None:  # vocab-parallel logits, consumed by loss_parallel
        top["output"] = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
    if model.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, top)
    config = model.config
    across = config.qk_norm and config.qk_norm_across_heads  # OLMoE's norms over all heads: HeadsRMSNorm
    columns = (("wq_b" if config.q_lora_rank else "wq"), "wkv_b") if config.kv_lora_rank else GQA_COLUMNS
    for block in model.layers.values():
        experts = isinstance(block.feed_forward, MoEFeedForward)
        parallelize_module(block, tp_mesh, block_plan(sequence_parallel, config.qk_norm and not across, experts,
                                                      config.shared_experts > 0, config.shared_expert_gate, columns))
        if config.kv_lora_rank:  # the rotary key every head shares: its gradient summed over the heads' ranks
            block.attention.group = mesh.group("tp")
        for norm in (block.attention.q_norm, block.attention.k_norm) if across else ():
            # each rank's heads' channels of the weight, as wq and wk split their outputs; squares summed over TP
            norm.weight = nn.Parameter(distribute_tensor(norm.weight, tp_mesh, [Shard(0)]))
            norm.group = mesh.group("tp")
    if model.config.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        model.output.weight = model.tok_embeddings.weight  # same Shard(0) placement: re-tie the DTensor


def parallelize_gpt(model: GPT, mesh: ModuleMesh, options: ParallelOptions) -> GPT:
    layout, coord = mesh.layout, mesh.coord
    if layout.pp > 1:
        keep_stage(model, coord.pp, layout.pp)
    if layout.tp > 1:
        apply_tensor_parallel(model, mesh, options.sequence_parallel)
    if layout.cp > 1:
        for block in model.layers.values():
            block.attention.core = ContextParallelAttention(mesh.group("cp"), layout.cp, coord.cp, options.cp_attention)
    if model.config.moe:
        apply_expert_parallel(model, mesh)
    wrap_blocks(model, model.layers, mesh, options)
    return model


def apply_expert_parallel(model: GPT, mesh: ModuleMesh) -> None:
    """Each MoE layer's experts split over the EP group with an all-to-all dispatch (ep > 1), and its
    balance loss counting whole rows over the ranks holding parts of them (cp·tp > 1)."""
    layout = mesh.layout
    for block in model.layers.values():
        moe = block.feed_forward
        if not isinstance(moe, MoEFeedForward):  # a dense layer (dense_layers)
            continue
        if layout.cp * layout.tp > 1:
            moe.row_group = mesh.group("rows")
        if layout.ep > 1:
            assert mesh.expert_mesh is not None
            shard_experts(moe.experts, mesh.expert_mesh)
            moe.dispatch = ExpertAllToAll(mesh.group("ep"), layout.ep, mesh.coord.dp % layout.ep, model.config.num_experts)
