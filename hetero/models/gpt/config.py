"""GPTConfig: the sizes of the model and what its layout must divide."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from hetero.kinds.layout_checks import shape_errors, transformer_layout_errors
from hetero.parallel.blocks import stage_layers
from hetero.parallel.layout import Layout
from hetero.parallel.options import ParallelOptions


ROPE_SCALINGS = ("none", "llama3", "yarn")
GATES = ("softmax", "sigmoid")
BACKENDS = ("native", "megatron")  # the model code: hetero's own, or megatron-core's GPTModel (``megatron.py``)


@dataclass
class RopeScaling:
    """RoPE frequencies stretched past the pretraining context: ``llama3`` (Llama 3.1's piecewise
    scaling) or ``yarn`` (YaRN's ramp between interpolated and original frequencies, with cos and sin
    scaled by ``attention_factor``); ``none`` keeps the base frequencies."""

    type: str = "none"
    factor: float = 1.0
    original_max_position: int = 8192
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; default 0.1 * ln(factor) + 1


@dataclass
class GPTConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int | None = None
    ffn_hidden_size: int | None = None
    seq_len: int = 64
    tie_embeddings: bool = False
    # the token whose embedding row takes no gradient from its lookups (transformers' padding_idx, set from
    # pad_token_id on import; with tie_embeddings the output layer still trains it); None: every row trains
    pad_token_id: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    head_dim: int | None = None  # default hidden_size // num_heads
    rotary_dim: int | None = None  # RoPE turns the first rotary_dim channels of each head (GLM-4's partial rotary); default all
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2)
    qk_norm: bool = False  # RMSNorm of each head's queries and keys before RoPE (Qwen3)
    qk_norm_across_heads: bool = False  # with qk_norm: one RMSNorm over all heads' queries, one over keys (OLMoE)
    # Multi-head latent attention (DeepSeek-V2/V3, ``mla.py``): kv_lora_rank > 0 makes each head's keys and
    # values from one kv_lora_rank-wide latent per token and its rotary channels (the last rotary_dim of
    # head_dim) from one set shared by the heads; q_lora_rank > 0 routes queries through a latent too
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    v_head_dim: int | None = None  # default head_size
    rope_interleaved: bool = False  # MLA: rotary channels stored as pairs (DeepSeek's rope_interleave)
    softmax_scale: float = 1.0  # attention logits times this beyond 1/sqrt(head_size) (DeepSeek's YaRN mscale²)
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    # M-RoPE (Qwen2-VL and later): the head's rotary frequencies split among temporal, height and width
    # positions, mrope_sections[i] frequencies each (summing to head_size / 2), in contiguous sections
    # (Qwen2/2.5-VL) or interleaved t, h, w, t, h, w, ... (Qwen3-VL); empty: one position per token.
    mrope_sections: list[int] = field(default_factory=list)
    mrope_interleaved: bool = False
    # DeepStack (Qwen3-VL): an input edge carries, beside each placeholder's embedding, one more hidden_size
    # wide feature per layer listed here, added to the residual stream at that placeholder after the layer.
    deepstack_layers: list[int] = field(default_factory=list)
    # Mixture of experts (``moe.py``): num_experts > 0 replaces every layer's MLP by top_k of num_experts
    # SwiGLU experts (expert_ffn_size wide) chosen per token, plus shared_experts that every token uses.
    num_experts: int = 0
    top_k: int = 2
    expert_ffn_size: int | None = None  # default ffn_size
    shared_experts: int = 0
    shared_expert_gate: bool = False  # Qwen2-MoE: the shared experts' output times sigmoid(a linear of the token)
    # with experts, the layers that keep a dense SwiGLU MLP (ffn_hidden_size wide): Qwen-MoE's mlp_only_layers
    # and decoder_sparse_step, DeepSeek-V3's first_k_dense_replace
    dense_layers: list[int] = field(default_factory=list)
    gate: str = "softmax"  # the router's scores: softmax over experts, or each expert's sigmoid
    normalize_gates: bool = False  # rescale the chosen top_k scores to sum to 1
    # DeepSeek-V3's routing: a per-expert bias added to the scores only to choose experts (a buffer, loaded,
    # not trained), experts_groups groups of which each token picks its top_k experts within the
    # groups_per_token groups whose two best scores sum highest, and the chosen gates times routed_scale
    selection_bias: bool = False
    expert_groups: int = 1
    groups_per_token: int = 1
    routed_scale: float = 1.0
    # the router's logits computed in fp32 also under bf16 autocast (DeepSeek-V3's router; Megatron's
    # moe_router_dtype=fp32): near-tied experts are then chosen as in fp32
    router_fp32: bool = False
    balance_loss: float = 0.0  # coefficient of the per-row load-balancing loss
    # the load-balancing loss as transformers' load_balancing_loss_func computes it instead: every MoE layer's
    # softmax routing pooled over a forward's whole batch (a microbatch on one DP rank), averaged over them
    balance_pooled: bool = False
    router_z_loss: float = 0.0  # coefficient of the router z-loss (logsumexp of the logits, squared)
    capacity_factor: float = 0.0  # 0: dropless; else each expert takes at most ceil(factor·tokens·top_k/experts)
    backend: str = "native"  # one of BACKENDS

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def rotary_size(self) -> int:
        return self.rotary_dim or self.head_size

    @property
    def v_size(self) -> int:
        return self.v_head_dim or self.head_size

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def expert_size(self) -> int:
        return self.expert_ffn_size or self.ffn_size

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    def moe_layer(self, index: int) -> bool:
        """Whether layer ``index``'s MLP is the mixture of experts."""
        return self.moe and index not in self.dense_layers

    def errors(self, module: str, layout: Layout, options: ParallelOptions | None = None) -> list[str]:
        """Everything about this model that ``layout`` (and ``options``) cannot run; empty when fine."""
        errors = shape_errors(
            module,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            seq_len=self.seq_len,
        )
        if errors:
            return errors
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            errors.append(f"{module}.model.pad_token_id={self.pad_token_id} is not a token of the vocabulary of "
                          f"{self.vocab_size}; use 0..{self.vocab_size - 1} or null")
        if self.rope_scaling.type not in ROPE_SCALINGS:
            errors.append(f"{module}.model.rope_scaling.type={self.rope_scaling.type!r} is not one of "
                          f"{', '.join(ROPE_SCALINGS)}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            errors.append(
                f"{module}.model.num_heads={self.num_heads} does not divide "
                f"{module}.model.hidden_size={self.hidden_size}; pick a head count that divides it"
            )
        elif self.head_size % 2:
            errors.append(
                f"{module}.model: each head is {self.head_size} wide (hidden_size={self.hidden_size} / "
                f"num_heads={self.num_heads}, or head_dim), but rotary embeddings turn pairs of channels; make it even"
            )
        if self.qk_norm_across_heads and not self.qk_norm:
            errors.append(f"{module}.model.qk_norm_across_heads=true spans the q/k norms over all heads, and "
                          f"{module}.model.qk_norm=false; set qk_norm=true")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_size):
            errors.append(f"{module}.model.rotary_dim={self.rotary_dim} must be even and in 2..{self.head_size} "
                          "(the head's width)")
        errors += self._mrope_errors(module) + self._deepstack_errors(module, layout) + self._latent_errors(module)
        if self.tie_embeddings and layout.pp > 1:
            errors.append(
                f"{module}.model.tie_embeddings=true needs the embedding and the output layer on one "
                f"pipeline stage, but {module}.layout.pp={layout.pp}; untie them or use pp=1"
            )
        if self.num_heads % self.kv_heads:
            errors.append(
                f"{module}.model.num_kv_heads={self.kv_heads} does not divide "
                f"{module}.model.num_heads={self.num_heads}"
            )
        errors += self._moe_errors(module, layout, options) + self._backend_errors(module, layout, options)
        return errors + transformer_layout_errors(
            module,
            layout,
            num_heads=self.num_heads,
            num_kv_heads=self.kv_heads,
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_size,
            num_layers=self.num_layers,
            seq_len=self.seq_len,
            vocab_size=self.vocab_size,
            sequence_parallel=options is not None and options.sequence_parallel,
            fsdp=options is not None and options.fsdp,
        )

    def _mrope_errors(self, module: str) -> list[str]:
        sections, half = list(self.mrope_sections), self.rotary_size // 2
        if not sections:
            return [f"{module}.model.mrope_interleaved=true needs mrope_sections"] if self.mrope_interleaved else []
        field = f"{module}.model.mrope_sections={sections}"
        if len(sections) != 3 or min(sections) < 0:
            return [f"{field} must be three counts of frequencies (temporal, height, width), each >= 0"]
        if sum(sections) != half:
            turned = (f"a head of {self.head_size} channels turns" if self.rotary_dim is None
                      else f"the {self.rotary_size} rotary channels of a head turn")
            return [f"{field} sum to {sum(sections)}, but {turned} {half} frequencies; make them sum to {half}"]
        if self.mrope_interleaved and (3 * sections[1] > half + 1 or 3 * sections[2] > half):
            return [f"{field} with mrope_interleaved=true: height takes frequencies 1, 4, 7, ... and width "
                    f"2, 5, 8, ... of the {half}, so at most {(half + 1) // 3} and {half // 3}"]
        return []

    def _latent_errors(self, module: str) -> list[str]:
        """What multi-head latent attention needs."""
        field = f"{module}.model"
        if not self.kv_lora_rank:
            wrong = [name for name in ("q_lora_rank", "v_head_dim", "rope_interleaved") if getattr(self, name)]
            return [f"{field}.{name}={getattr(self, name)} belongs to multi-head latent attention, and "
                    f"{field}.kv_lora_rank=0; set kv_lora_rank or drop it" for name in wrong]
        errors = []
        if self.kv_lora_rank < 0 or self.q_lora_rank < 0:
            errors.append(f"{field}.kv_lora_rank={self.kv_lora_rank} and q_lora_rank={self.q_lora_rank} must be >= 0")
        if self.rotary_dim is None or self.rotary_dim >= self.head_size:
            errors.append(f"{field}: multi-head latent attention turns the last rotary_dim channels of each head and "
                          f"expands the others from the latent; set rotary_dim below head_dim={self.head_size}")
        mismatched = {"num_kv_heads": self.num_kv_heads not in (None, self.num_heads), "qkv_bias": self.qkv_bias,
                      "qk_norm": self.qk_norm, "mrope_sections": bool(self.mrope_sections)}
        for name in (name for name, wrong in mismatched.items() if wrong):
            errors.append(f"{field}.{name}={getattr(self, name)} does not apply to multi-head latent attention "
                          f"(kv_lora_rank={self.kv_lora_rank}); drop it")
        if self.backend == "megatron":
            errors.append(f"{module}.model.backend=megatron: multi-head latent attention runs on the native backend")
        return errors

    def _deepstack_errors(self, module: str, layout: Layout) -> list[str]:
        layers, field_ = list(self.deepstack_layers), f"{module}.model.deepstack_layers={list(self.deepstack_layers)}"
        if not layers:
            return []
        if layers != sorted(set(layers)) or not 0 <= layers[0] <= layers[-1] < self.num_layers:
            return [f"{field_} must be distinct layers 0..{self.num_layers - 1} in rising order"]
        errors = []
        first = stage_layers(self.num_layers, 0, layout.pp)
        if layers[-1] not in first:
            errors.append(f"{field_}: DeepStack's features reach the first pipeline stage only, which holds layers "
                          f"{first.start}..{first.stop - 1} of {self.num_layers} at {module}.layout.pp={layout.pp}; "
                          f"use a pp whose first stage holds layer {layers[-1]}")
        if self.backend == "megatron":
            errors.append(f"{module}.model.backend=megatron does not add DeepStack's features; use backend=native")
        return errors

    def _moe_errors(self, module: str, layout: Layout, options: ParallelOptions | None) -> list[str]:
        field = f"{module}.model"
        if not self.moe:
            return []  # ep > 1 without experts: the graph's check names it
        errors = []
        if not 1 <= self.top_k <= self.num_experts:
            errors.append(f"{field}.top_k={self.top_k} must be in 1..{field}.num_experts={self.num_experts}")
        if self.gate not in GATES:
            errors.append(f"{field}.gate={self.gate!r} is not one of {', '.join(GATES)}")
        for name in ("shared_experts", "balance_loss", "router_z_loss", "capacity_factor"):
            if getattr(self, name) < 0:
                errors.append(f"{field}.{name}={getattr(self, name)} must be >= 0")
        errors += self._group_errors(field)
        if any(not 0 <= i < self.num_layers for i in self.dense_layers) or len(set(self.dense_layers)) == self.num_layers:
            errors.append(f"{field}.dense_layers={self.dense_layers} must name some of the layers 0..{self.num_layers - 1}, "
                          "not all")
        if self.balance_pooled and layout.pp > 1:
            errors.append(f"{field}.balance_pooled=true pools every MoE layer of a forward, and {module}.layout.pp="
                          f"{layout.pp} puts them on different stages; use pp=1 or the per-row balance loss")
        if self.balance_pooled and options is not None and options.activation_checkpointing:
            errors.append(f"{field}.balance_pooled=true does not run under {module}.parallel.activation_checkpointing="
                          "true (the recomputed layers would pool again); turn one off")
        if self.shared_expert_gate and not self.shared_experts:
            errors.append(f"{field}.shared_expert_gate=true gates the shared experts, and {field}.shared_experts=0")
        if self.num_experts % layout.ep:
            errors.append(f"{module}.layout.ep={layout.ep} does not divide {field}.num_experts={self.num_experts}; "
                          f"choose ep from {', '.join(str(d) for d in range(1, self.num_experts + 1) if self.num_experts % d == 0)}")
        tokens = self.seq_len // layout.cp
        if layout.tp > 1 and tokens % layout.tp:
            errors.append(f"{module}: under {module}.layout.tp={layout.tp} each TP rank routes its part of the "
                          f"sequence through the experts, but the {tokens} tokens a CP rank holds do not split over "
                          f"tp={layout.tp}; use a sequence length that is a multiple of cp*tp={layout.cp * layout.tp}")
        if options is not None and options.fsdp and (layout.ep > 1 or layout.tp > 1):
            errors.append(f"{module}.parallel.fsdp=true with experts runs at ep=1 and tp=1 (got ep={layout.ep}, "
                          f"tp={layout.tp}); turn fsdp off or set ep=1 and tp=1")
        return errors

    def _group_errors(self, field: str) -> list[str]:
        groups, per_token = self.expert_groups, self.groups_per_token
        if groups == 1 and per_token == 1:
            return []
        if groups < 1 or self.num_experts % groups or self.num_experts // groups < 2:
            return [f"{field}.expert_groups={groups} must divide {field}.num_experts={self.num_experts} into groups "
                    "of at least 2 experts (a group is ranked by its two best scores)"]
        if not 1 <= per_token <= groups or self.top_k > per_token * (self.num_experts // groups):
            return [f"{field}.groups_per_token={per_token} must be in 1..{groups} and hold the top_k={self.top_k} "
                    f"experts a token picks ({self.num_experts // groups} a group)"]
        return []

    def _backend_errors(self, module: str, layout: Layout, options: ParallelOptions | None) -> list[str]:
        """What the chosen backend cannot run; the megatron backend's refusals."""
        if self.backend not in BACKENDS:
            return [f"{module}.model.backend={self.backend!r} is not one of {', '.join(BACKENDS)}"]
        if self.backend == "native":
            return []
        where = f"{module}.model.backend=megatron"
        errors = []
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            errors.append(f"{where} needs megatron-core: pip install -e '.[megatron]' (megatron-core 0.16.1)")
        if layout.cp > 1:
            errors.append(f"{where} does not run context parallelism ({module}.layout.cp={layout.cp}): "
                          "megatron-core's CP attention needs TransformerEngine; use backend=native for cp > 1")
        if self.qk_norm_across_heads:
            errors.append(f"{where} normalizes q and k per head ({module}.model.qk_norm_across_heads=true); use the "
                          "native backend")
        if self.pad_token_id is not None:
            errors.append(f"{where} trains every embedding row, the pad token's too ({module}.model.pad_token_id="
                          f"{self.pad_token_id}); set {module}.model.pad_token_id=null to train it, or use the native "
                          "backend")
        if self.rotary_dim is not None and self.rotary_dim != self.head_size:
            errors.append(f"{where} turns every channel of a head ({module}.model.rotary_dim={self.rotary_dim}); use "
                          "the native backend")
        if self.moe:
            errors += self._megatron_expert_errors(module, layout, options)
        if options is not None and options.fsdp:
            errors.append(f"{where} does not shard with FSDP2 ({module}.parallel.fsdp=true); use dp replicas")
        return errors

    def _megatron_expert_errors(self, module: str, layout: Layout, options: ParallelOptions | None) -> list[str]:
        """The experts megatron-core's MoE layer runs with the native semantics (``megatron_router``)."""
        where, errors = f"{module}.model.backend=megatron", []
        deepseek = {"selection_bias": self.selection_bias, "expert_groups": self.expert_groups != 1,
                    "routed_scale": self.routed_scale != 1.0}
        for name in (name for name, set_ in deepseek.items() if set_):
            errors.append(f"{where} does not run {module}.model.{name}={getattr(self, name)} yet; use the native "
                          "backend")
        if self.balance_pooled:
            errors.append(f"{where} does not compute the pooled balance loss ({module}.model.balance_pooled=true); "
                          "use the native backend")
        if self.dense_layers:
            errors.append(f"{where} does not run dense layers among the experts' ({module}.model.dense_layers="
                          f"{self.dense_layers}) yet; use the native backend")
        if self.shared_expert_gate:
            errors.append(f"{where} does not run the shared experts' gate ({module}.model.shared_expert_gate=true) "
                          "yet; use the native backend")
        if self.capacity_factor > 0:
            errors.append(f"{where} runs experts dropless only ({module}.model.capacity_factor="
                          f"{self.capacity_factor}): megatron-core picks the tokens it drops by its own policy")
        if self.gate == "sigmoid" and not self.normalize_gates and self.top_k > 1:
            errors.append(f"{where} renormalizes sigmoid gates when top_k > 1; set {module}.model.normalize_gates=true")
        if layout.tp > 1 and not (options is not None and options.sequence_parallel):
            errors.append(f"{where} with experts and {module}.layout.tp={layout.tp} needs "
                          f"{module}.parallel.sequence_parallel=true (megatron-core's MoE layer refuses TP without it)")
        return errors
