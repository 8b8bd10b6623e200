"""The gpt kind's ``megatron`` backend: megatron-core's ``GPTModel`` (its local layer spec) built for one
module's layout, from the native model's weights.

The kind builds the native ``GPT`` as always (so both backends start from the same weights for a seed);
``to_megatron`` then builds megatron-core's model with the module's own process groups (a
``ProcessGroupCollection``, no global ``parallel_state``) and copies this rank's shards in through the
name map (``megatron_names``). ``MegatronGPT`` runs it with the native forward's signature: hetero's
placeholder inserts go into the embeddings before sequence parallelism scatters them, RoPE angles and
packed documents' masks are the native model's, and the loss is a vocab-parallel cross-entropy over the
module's TP group. ``megatron_state`` shows its weights and AdamW state under native names and
placements, for checkpoints and Hugging Face import and export.

Megatron's tensor-parallel weights are plain tensors marked ``tensor_model_parallel`` (the runtime counts
their squares once per TP rank). The norms are torch's RMSNorm (``RMSNorm`` below: megatron's own wrapper
refuses sequence parallelism); the weights whose gradients are partial sums over TP (every norm's under
sequence parallelism, the per-head q and k norms' under any TP, the experts' router) are marked
``partial_over_tp``, and the runtime reduces them, as megatron's ``finalize_model_grads`` would. With
experts each rank holds its EP group's share of them whole (marked ``expert_shard``: their gradients are
summed over the ranks holding the same experts, their squares once per EP rank), routed by
``megatron_router.AuxLossRouter``.

megatron-core is an optional extra (``hetero[megatron]``); on CPU it needs the substitutions in
``hetero.testing.megatron_cpu``, which only tests apply.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hetero.data.digits import IGNORE_INDEX
from hetero.kernels.documents import Documents
from hetero.models.gpt import megatron_state
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.megatron_names import megatron_shards, native_tensors
from hetero.models.gpt.model import GPT, place_rows
from hetero.models.gpt.rope import mrope_of, rope_angles, rope_frequencies
from hetero.models.gpt.moe import Routing
from hetero.parallel.blocks import stage_layers
from hetero.parallel.layout import Layout
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.options import ParallelOptions


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm as megatron-core's layer specs build a norm."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__(hidden_size, eps=eps)


def layer_specs(config: GPTConfig, layers: int):
    """megatron-core's local layer spec for each of a stage's ``layers``, every norm ``RMSNorm``; with
    experts its MoE layer (experts one after another, ``SequentialMLP``) routed by ``AuxLossRouter``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec = get_gpt_layer_local_spec(num_experts=config.num_experts or None, moe_grouped_gemm=False,
                                    qk_layernorm=config.qk_norm, normalization="RMSNorm")
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = RMSNorm
    if config.qk_norm:
        attention = spec.submodules.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = RMSNorm
    if config.moe:
        from hetero.models.gpt.megatron_router import AuxLossRouter

        spec.submodules.mlp.submodules.router = functools.partial(AuxLossRouter, gpt=config)
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=RMSNorm)


def expert_config(config: GPTConfig, ep: int) -> dict[str, Any]:
    """megatron-core's settings for the native mixture of experts: its top-k over the same scores (softmax
    before the top-k unless the gates are renormalized, which equals a softmax over the chosen logits;
    sigmoid gates renormalized), dropless, experts not split over TP, its own auxiliary losses off
    (``megatron_router``). Tokens reach the experts by its all-gather dispatcher over the EP group (its
    all-to-all one creates a CUDA stream when built, so no test could run it)."""
    if not config.moe:
        return {}
    return dict(
        num_moe_experts=config.num_experts, moe_router_topk=config.top_k, moe_ffn_hidden_size=config.expert_size,
        moe_shared_expert_intermediate_size=config.shared_experts * config.expert_size or None,
        moe_router_score_function=config.gate,
        moe_router_pre_softmax=config.gate == "softmax" and not config.normalize_gates,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False, expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
        moe_router_dtype="fp32" if config.router_fp32 else None,
    )


def transformer_config(config: GPTConfig, layout: Layout, options: ParallelOptions):
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp, pp = layout.tp, layout.pp
    # activation checkpointing: megatron-core recomputes every layer in the backward
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    # YaRN scales cos and sin by its attention factor, so the scores by its square: megatron-core's rotary
    # (``rotary`` gives it the angles alone) leaves that to the softmax scale
    _, attention = rope_frequencies(config.head_size, config.rope_theta, config.rope_scaling)
    return TransformerConfig(
        **(recompute if options.activation_checkpointing else {}), **expert_config(config, layout.ep),
        softmax_scale=attention**2 / math.sqrt(config.head_size) if attention != 1.0 else None,
        num_layers=config.num_layers, hidden_size=config.hidden_size, num_attention_heads=config.num_heads,
        num_query_groups=config.kv_heads, kv_channels=config.head_size, ffn_hidden_size=config.ffn_size,
        normalization="RMSNorm", layernorm_epsilon=config.norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=config.qkv_bias, qk_layernorm=config.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=options.sequence_parallel and tp > 1,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, use_cpu_initialization=True,
        # megatron's fused kernels are CUDA-only; the runtime compiles nothing either
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
    )


def process_groups(mesh: ModuleMesh):
    """The module's own groups that megatron-core's model reads (tp, pp, cp; embd for the embedding tied
    to the output over pipeline stages, which the backend refuses; with experts the EP group, the experts'
    TP group of one rank, and the ranks summing the experts' gradients). Gradients are reduced over dp
    by hetero's replica sync, not megatron's DDP."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = dict(tp=mesh.group("tp"), pp=mesh.group("pp"), cp=mesh.group("cp"), embd=None)
    if "expert_tp" in mesh.groups:
        ep = mesh.group("ep") if mesh.layout.ep > 1 else mesh.group("expert_tp")
        groups |= dict(ep=ep, expt_tp=mesh.group("expert_tp"), tp_ep=ep, expt_dp=mesh.group("expert_sync"),
                       tp_cp=mesh.group("tp"), tp_dp_cp=None)  # tp_dp_cp: megatron's global aux loss only, off
    return ProcessGroupCollection(**groups)


def gather_shards(group: dist.ProcessGroup) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """Every rank's shard of a tensor, in rank order (an all-gather over ``group``)."""
    def parts(value: torch.Tensor) -> list[torch.Tensor]:
        if group.size() == 1:
            return [value]
        out = [torch.empty_like(value) for _ in range(group.size())]
        dist.all_gather(out, value.contiguous(), group=group)
        return out

    return parts


class MegatronGPT(nn.Module):
    """megatron-core's ``GPTModel`` for one pipeline stage of a module, called like the native ``GPT``
    (batch-first tensors in and out) and computing the loss like ``token_loss_sum``."""

    def __init__(self, config: GPTConfig, mesh: ModuleMesh, options: ParallelOptions):
        super().__init__()
        from megatron.core import parallel_state
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.tensor_parallel import random as megatron_random

        layout = mesh.layout
        # Process-wide state megatron's layers expect: the local attention's scratch buffer, and the RNG
        # tracker its attention forks (no layer draws from it: dropout is 0).
        if parallel_state._GLOBAL_MEMORY_BUFFER is None:
            parallel_state._set_global_memory_buffer()
        if not megatron_random.get_cuda_rng_tracker().is_initialized():
            megatron_random.model_parallel_cuda_manual_seed(0, tp_rank=mesh.coord.tp, ep_rank=0, etp_rank=0)
        self.config = config
        self.sequence_parallel = options.sequence_parallel and layout.tp > 1
        self.gpt = GPTModel(
            transformer_config(config, layout, options),
            layer_specs(config, len(stage_layers(config.num_layers, mesh.coord.pp, layout.pp))),
            vocab_size=config.vocab_size, max_sequence_length=config.seq_len,
            pre_process=mesh.is_first_stage, post_process=mesh.is_last_stage,
            share_embeddings_and_output_weights=config.tie_embeddings, position_embedding_type="rope",
            scatter_embedding_sequence_parallel=False,  # the backend's own rotary angles: ``rotary``
            pg_collection=process_groups(mesh),
        )
        self.tp_group = mesh.group("tp")
        self.tp_mesh = mesh.mesh["tp"] if layout.tp > 1 else None  # the native plan's, for native views
        self.layers = stage_layers(config.num_layers, mesh.coord.pp, layout.pp)  # as the native stage's
        self.ep_group = mesh.group("ep") if layout.ep > 1 else None
        self.expert_mesh = mesh.expert_mesh
        for name, param in self.gpt.named_parameters():
            sums = self.sequence_parallel or "q_layernorm" in name or "k_layernorm" in name
            if layout.tp > 1 and (("layernorm" in name and sums) or ".mlp.router." in name):
                param.partial_over_tp = True  # the router's: each TP rank routes its part of the sequence
            if ".mlp.experts." in name:
                param.expert_shard = True  # this rank's experts, whole (not split over TP)
        for _, router in self.routed_layers():
            router.row_group = mesh.group("rows") if layout.tp > 1 else None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        return_hidden: bool = False,
        inserts: Sequence[tuple[int, torch.Tensor, torch.Tensor]] = (),
        documents: Documents | None = None,
        aux_scale: float | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As ``GPT.forward``; logits are this rank's part of the vocabulary (batch, seq, vocab / tp)."""
        from megatron.core import tensor_parallel

        gpt = self.gpt
        if gpt.pre_process:
            seq_len = x.shape[1]
            h = gpt.embedding(input_ids=x, position_ids=None).transpose(0, 1)  # (batch, seq, hidden)
            for index, values, rows in inserts:
                h = place_rows(h, index, values, rows)
            h = h.transpose(0, 1).contiguous()
            if self.sequence_parallel:
                h = tensor_parallel.scatter_to_sequence_parallel_region(h, group=self.tp_group)
        else:
            h = x.transpose(0, 1).contiguous()
            seq_len = h.shape[0] * (self.tp_group.size() if self.sequence_parallel else 1)
            gpt.decoder.set_input_tensor(h)
        if positions is None:
            positions = torch.arange(seq_len, device=h.device)
        for _, router in self.routed_layers():
            router.aux_scale = aux_scale
        mask = ~torch.ones(seq_len, seq_len, dtype=torch.bool, device=h.device).tril()[None, None]
        if documents is not None:  # each token attends within its document
            mask = mask | (documents.ids[:, :, None] != documents.ids[:, None, :])[:, None]
        h = gpt.decoder(hidden_states=h if gpt.pre_process else None, attention_mask=mask,
                        rotary_pos_emb=self.rotary(positions))
        if not gpt.post_process:
            return h.transpose(0, 1)
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
        logits, _ = gpt.output_layer(h, weight=weight)
        logits = logits.transpose(0, 1)
        return (logits, h.transpose(0, 1)) if return_hidden else logits

    def routed_layers(self) -> list[tuple[int, Routing]]:
        """(global layer index, router) of the stage's mixture-of-experts layers."""
        return [(self.layers[int(name.split(".")[3])], module) for name, module in self.named_modules()
                if isinstance(module, Routing)]  # gpt.decoder.layers.<local>.mlp.router

    def rotary(self, positions: torch.Tensor) -> torch.Tensor:
        """megatron-core's rotary angles, (seq, 1, 1, head_dim) or one row each (seq, batch, 1, head_dim),
        for the native model's positions (restarting per packed document) and frequencies (its scaling)."""
        config = self.config
        angles, _ = rope_angles(config.head_size, positions, config.rope_theta, config.rope_scaling, mrope_of(config))
        return angles[:, None, None] if angles.dim() == 2 else angles.transpose(0, 1)[:, :, None]

    def token_loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The native ``token_loss_sum`` from this rank's part of the vocabulary (megatron-core's own
        vocab-parallel cross-entropy reads the global TP group, so this one reduces over the module's)."""
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as reduce

        logits, group = logits.float(), self.tp_group
        peak = logits.detach().amax(-1)
        if group.size() > 1:
            dist.all_reduce(peak, dist.ReduceOp.MAX, group=group)
        shifted = logits - peak[..., None]
        width = logits.shape[-1]
        local = labels - group.rank() * width
        mine = (local >= 0) & (local < width)
        picked = shifted.gather(-1, local.clamp(0, width - 1)[..., None]).squeeze(-1) * mine
        if group.size() > 1:
            shifted_sum, picked = reduce(shifted.exp().sum(-1), group), reduce(picked, group)
        else:
            shifted_sum = shifted.exp().sum(-1)
        return ((shifted_sum.log() - picked) * (labels != IGNORE_INDEX)).sum()

    def whole_vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's part of the vocabulary put together (a TP all-gather)."""
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        return gather_from_tensor_model_parallel_region(logits, self.tp_group) if self.tp_group.size() > 1 else logits

    def native(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``values`` by this model's parameter names (weights, gradients), whole and under the native
        model's names (collective over TP)."""
        own = {name.removeprefix("gpt."): value for name, value in values.items()}
        experts = gather_shards(self.ep_group) if self.ep_group is not None else lambda value: [value]
        return native_tensors(own, self.config, self.layers, gather_shards(self.tp_group), experts)

    def load_native(self, state: dict[str, torch.Tensor]) -> None:
        """This rank's shards of a native ``state_dict`` (whole tensors; any stage's)."""
        ep = self.ep_group
        shards = megatron_shards(state, self.config, self.layers, self.tp_group.size(), self.tp_group.rank(),
                                 ep.size() if ep is not None else 1, ep.rank() if ep is not None else 0)
        own = [name for name in self.gpt.state_dict() if not name.endswith("_extra_state")]
        missing = sorted(set(own) - set(shards))
        if missing:
            raise KeyError(f"no native weight maps to megatron-core's {missing}")
        with torch.no_grad():
            for name, value in self.gpt.state_dict().items():
                if name in shards:
                    value.copy_(shards[name])

    def weights_state(self) -> dict[str, torch.Tensor]:
        """The weights under the native model's names and TP placements (``megatron_state``)."""
        return megatron_state.weights_state(self)

    def load_weights_state(self, view: dict[str, torch.Tensor]) -> None:
        megatron_state.load_weights_state(self, view)

    def checkpoint_state(self, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """What a checkpoint keeps of this module, as the native model's ``get_state_dict`` gives it."""
        state: dict[str, Any] = {"model": self.weights_state()}
        if optimizer is not None:
            state["optimizer"] = megatron_state.optimizer_state(self, optimizer)
        return state

    def load_checkpoint_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer | None) -> None:
        self.load_weights_state(state["model"])
        if optimizer is not None and "optimizer" in state:
            megatron_state.load_optimizer_state(self, optimizer, state["optimizer"])


def to_megatron(native: GPT, mesh: ModuleMesh, options: ParallelOptions) -> MegatronGPT:
    """megatron-core's model for this rank's stage, holding this rank's shards of ``native``'s weights
    (none on the meta device: ``init.hf`` fills them later)."""
    device = next(native.parameters()).device
    model = MegatronGPT(native.config, mesh, options)
    if device.type == "meta":
        return model
    model = model.to(device)
    model.load_native(native.state_dict())
    return model
