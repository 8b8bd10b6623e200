"""The name map between the native GPT and megatron-core's GPTModel (local layer spec): which tensor is
which, how TP splits it, and the two fusions. Pure tensor arithmetic, no process groups.

megatron-core fuses q, k and v per query group (each group's query heads, then its key head, then its
value head) and the gate and up projections per TP rank ([gate shard; up shard]). Either way a TP rank's
part of the fused tensor holds exactly its native shard of each piece (``Shard`` over TP as the native
plan places it), so the map works on whole tensors and on one rank's shards alike.

With experts: the router is replicated, the shared experts split over TP as a dense MLP is (megatron-core
runs them TP-parallel; the native plan keeps them whole on each TP rank), and each routed expert is one
``local_experts.<j>`` MLP, ``j`` counting this EP rank's experts, whose fc1 fuses its gate and up."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hetero.models.gpt.config import GPTConfig

# Native name -> (megatron-core name, the dimension TP splits or None). Per layer, under ``layers.{i}.`` and
# ``decoder.layers.{local i}.``; QKV and GATE_UP are the fused ones (both split on dimension 0).
TOP = {"tok_embeddings.weight": ("embedding.word_embeddings.weight", 0),
       "norm.weight": ("decoder.final_layernorm.weight", None),
       "output.weight": ("output_layer.weight", 0)}
LAYER = {"attention_norm.weight": ("input_layernorm.weight", None),
         "ffn_norm.weight": ("pre_mlp_layernorm.weight", None),
         "attention.q_norm.weight": ("self_attention.q_layernorm.weight", None),
         "attention.k_norm.weight": ("self_attention.k_layernorm.weight", None),
         "attention.wo.weight": ("self_attention.linear_proj.weight", 1),
         "feed_forward.w2.weight": ("mlp.linear_fc2.weight", 1),
         "feed_forward.router.weight": ("mlp.router.weight", None),
         "feed_forward.shared.w2.weight": ("mlp.shared_experts.linear_fc2.weight", 1)}
QKV = {"weight": "self_attention.linear_qkv.weight", "bias": "self_attention.linear_qkv.bias"}
GATE_UP = {"feed_forward.": "mlp.linear_fc1.weight", "feed_forward.shared.": "mlp.shared_experts.linear_fc1.weight"}
FUSED = ("attention.wq.", "attention.wk.", "attention.wv.", "feed_forward.w1.", "feed_forward.w3.",
         "feed_forward.shared.w1.", "feed_forward.shared.w3.")
EXPERTS = "feed_forward.experts."  # native stacks (experts, ...) of w1, w3 and w2, split over EP on dim 0
LOCAL_EXPERT = "mlp.experts.local_experts.{}."  # + linear_fc1.weight ([gate; up]), linear_fc2.weight


def is_expert(name: str) -> bool:
    """Whether native weight ``name`` is a stack of routed experts' (EP splits it on dimension 0)."""
    return "." + EXPERTS in name


def split_dim(name: str) -> int | None:
    """The dimension TP splits native weight ``name`` on (None: not split over TP)."""
    if name in TOP:
        return TOP[name][1]
    leaf = name.split(".", 2)[2]
    if leaf.startswith(FUSED):
        return 0
    if leaf.startswith(EXPERTS):
        return None
    return LAYER[leaf][1]


def megatron_shards(native: dict[str, torch.Tensor], config: GPTConfig, layers: range, tp: int,
                    rank: int, ep: int = 1, ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """TP rank ``rank``'s part of each tensor of a stage holding ``layers``, under megatron-core's names,
    from native tensors split ``tp`` ways (whole tensors and ``tp`` > 1, or one rank's shards and
    ``tp`` = 1); experts likewise ``ep`` ways for EP rank ``ep_rank``; any that ``native`` has."""
    def shard(value: torch.Tensor, dim: int | None) -> torch.Tensor:
        return value if dim is None else value.chunk(tp, dim)[rank]

    out = {ours: shard(native[name], dim) for name, (ours, dim) in TOP.items() if name in native}
    if config.tie_embeddings:
        out.pop("output_layer.weight", None)
    hd = config.head_size
    for local, i in enumerate(layers):
        theirs, ours = f"layers.{i}.", f"decoder.layers.{local}."
        out |= {ours + mine: shard(native[theirs + name], dim) for name, (mine, dim) in LAYER.items()
                if theirs + name in native}
        for kind, mine in QKV.items():
            if theirs + f"attention.wq.{kind}" in native:
                q, k, v = (native[theirs + f"attention.w{x}.{kind}"] for x in "qkv")
                groups = k.shape[0] // hd
                fused = torch.cat([q.unflatten(0, (groups, -1)), k.unflatten(0, (groups, hd)),
                                   v.unflatten(0, (groups, hd))], 1)
                out[ours + mine] = fused.chunk(tp, 0)[rank].flatten(0, 1)
        for mlp, fused in GATE_UP.items():
            if theirs + mlp + "w1.weight" in native:
                gate, up = native[theirs + mlp + "w1.weight"], native[theirs + mlp + "w3.weight"]
                out[ours + fused] = torch.cat([shard(gate, 0), shard(up, 0)])
        if theirs + EXPERTS + "w1" in native:
            w1, w3, w2 = (native[theirs + EXPERTS + w].chunk(ep)[ep_rank] for w in ("w1", "w3", "w2"))
            for j in range(len(w1)):
                out[ours + LOCAL_EXPERT.format(j) + "linear_fc1.weight"] = torch.cat([w1[j], w3[j]])
                out[ours + LOCAL_EXPERT.format(j) + "linear_fc2.weight"] = w2[j]
    return out


def native_tensors(own: dict[str, torch.Tensor], config: GPTConfig, layers: range,
                   parts: Callable[[torch.Tensor], list[torch.Tensor]],
                   expert_parts: Callable[[torch.Tensor], list[torch.Tensor]] = lambda value: [value],
                   ) -> dict[str, torch.Tensor]:
    """The inverse of ``megatron_shards``: a stage's tensors under native names. ``own``: any of the
    stage's weights, gradients or optimizer moments by megatron-core's name; ``parts``: every TP rank's
    part of such a tensor, in rank order, for whole native tensors (an all-gather), or ``[tensor]`` for
    this rank's native shards; ``expert_parts`` the same over EP for the stacks of routed experts. A tied
    output comes back as the embedding alone, as ``named_parameters`` has it."""
    def whole(value: torch.Tensor, dim: int | None) -> torch.Tensor:
        return value if dim is None else torch.cat(parts(value), dim)

    native = {name: whole(own[ours], dim) for name, (ours, dim) in TOP.items() if ours in own}
    hd, per_group = config.head_size, config.num_heads // config.kv_heads
    for local, i in enumerate(layers):
        theirs, ours = f"layers.{i}.", f"decoder.layers.{local}."
        native |= {theirs + name: whole(own[ours + mine], dim) for name, (mine, dim) in LAYER.items()
                   if ours + mine in own}
        for kind, mine in QKV.items():
            if ours + mine in own:
                fused = torch.cat(parts(own[ours + mine])).unflatten(0, (-1, (per_group + 2) * hd))
                q, k, v = fused.split([per_group * hd, hd, hd], 1)
                for x, value in zip("qkv", (q, k, v)):
                    native[theirs + f"attention.w{x}.{kind}"] = value.flatten(0, 1)
        for mlp, fused in GATE_UP.items():
            if ours + fused in own:
                halves = [part.chunk(2) for part in parts(own[ours + fused])]
                native[theirs + mlp + "w1.weight"] = torch.cat([gate for gate, _ in halves])
                native[theirs + mlp + "w3.weight"] = torch.cat([up for _, up in halves])
        held = [ours + LOCAL_EXPERT.format(j) for j in range(config.num_experts)
                if ours + LOCAL_EXPERT.format(j) + "linear_fc1.weight" in own]
        if held:
            fc1 = torch.stack([own[expert + "linear_fc1.weight"] for expert in held])
            stacks = dict(zip(("w1", "w3"), fc1.chunk(2, 1)))
            stacks["w2"] = torch.stack([own[expert + "linear_fc2.weight"] for expert in held])
            for w, stack in stacks.items():
                native[theirs + EXPERTS + w] = torch.cat(expert_parts(stack.contiguous()))
    return native
