"""Hugging Face Llama-family decoders as hetero GPTs and back: the config mapped field by field, the
weights renamed.

Architectures: ``LlamaForCausalLM`` (Llama 2, 3.x), ``MistralForCausalLM``, ``Qwen2ForCausalLM`` (biases
on q, k, v), ``Qwen3ForCausalLM`` (RMSNorm of q and k per head, its own head_dim), and the mixtures of
experts ``Qwen3MoeForCausalLM``, ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM`` (top-k of softmax-routed
SwiGLU experts, renormalized as ``norm_topk_prob`` says, always for Mixtral; Qwen2-MoE's shared expert and
its sigmoid gate as hetero's shared experts and ``shared_expert_gate``) and ``Glm4MoeForCausalLM``
(DeepSeek-V3's sigmoid routing with its selection bias, groups and routed scale, the router in fp32,
ungated shared experts, dense first layers, partial rotary as ``rotary_dim``; its multi-token prediction
layers are passed over and carried back) and ``OlmoeForCausalLM`` (its q and k norms over all heads:
``qk_norm_across_heads``). The experts are read in either key layout (``hf_experts``),
exported back in the layout they came in, and a GPT with experts trained from scratch goes out as the
family its routing matches (``hf_export_config.hf_config``). Their ``router_aux_loss_coef`` is not mapped: hetero's
``balance_loss`` is a per-row loss that transformers' pooled one is not (``balance_pooled`` computes that
one), and stays as the module's YAML sets it. GQA, RoPE theta and the ``llama3`` and ``yarn`` scalings,
tied embeddings, the RMSNorm eps and ``pad_token_id`` (the embedding row its lookups do not train) carry over. A field hetero does not model, or a value it does not
model (another activation, sliding-window attention that the sequence reaches, biases on the output
projection), is refused by name, as are the families of ``NOT_MODELLED`` and quantized weights. Fields
that do not change what the weights compute (token ids, dtype, caching, initialization) are passed over:
``BOOKKEEPING``.

HF's Llama layout already rotates by halves, as hetero's RoPE does: q and k are not permuted.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from hetero.errors import ConfigError
from hetero.interop.hf_checkpoint import HFCheckpoint, load_into, renamed
from hetero.interop.qwen_vl import DEEPSTACK
from hetero.models.gpt.config import GPTConfig, RopeScaling
from hetero.models.gpt.hf_experts import StackedExperts
from hetero.models.gpt.model import GPT

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral",
                 "Qwen2MoeForCausalLM": "qwen2_moe", "Glm4MoeForCausalLM": "glm4_moe", "OlmoeForCausalLM": "olmoe",
                 "DeepseekV3ForCausalLM": "deepseek_v3"}
ROUTED_BY_SIGMOID = ("glm4_moe", "deepseek_v3")  # DeepSeek-V3's routing

# Families hetero knows and does not import, with what is missing: named in the refusal instead of the
# generic list of what it imports.
NOT_MODELLED = {
    "GptOssForCausalLM": "gpt-oss's attention sinks and its clamped SwiGLU (with biases and alpha) are not modelled",
    "DeepseekV2ForCausalLM": "DeepSeek-V2's routing (softmax scores, group-limited greedy top-k: topk_method) is not "
                             "modelled; its latent attention is (as DeepSeek-V3's)",
    "Qwen3NextForCausalLM": "gated delta-net (linear attention) layers are not modelled",
    "Llama4ForCausalLM": "chunked attention, no-rope layers and its interleaved experts are not modelled",
}

BOOKKEEPING = {
    "architectures", "model_type", "transformers_version", "_name_or_path", "dtype", "torch_dtype", "use_cache",
    "bos_token_id", "eos_token_id", "initializer_range", "output_hidden_states",
    "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "tokenizer_class", "max_window_layers", "output_router_logits", "router_aux_loss_coef",
}

TRAINED_LENGTH = "hetero_seq_len"  # the length a GPT hetero trained from scratch was trained at (``hf_export_config``)

MODELLED = {
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "tie_word_embeddings", "rope_theta", "rope_parameters", "rope_scaling", "attention_bias", "attention_dropout",
    "mlp_bias", "pretraining_tp", "sliding_window", "use_sliding_window", "layer_types", TRAINED_LENGTH, DEEPSTACK,
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers", "router_jitter_noise", "shared_expert_intermediate_size", "qkv_bias",
    "n_routed_experts", "n_shared_experts", "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace",
    "use_qk_norm", "partial_rotary_factor", "num_nextn_predict_layers", "clip_qkv", "pad_token_id",
    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "qk_head_dim", "v_head_dim", "rope_interleave",
}

_ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "low_freq_factor",
              "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "truncate", "mrope_section",
              "mrope_interleaved", "partial_rotary_factor", "mscale", "mscale_all_dim"}


def gpt_config(hf: dict, seq_len: int | None = None, module: str = "llm") -> GPTConfig:
    """The GPT config of HF config ``hf`` (a ``config.json``), trained at ``seq_len`` (default: the length
    hetero trained it at, for its own export of a GPT trained from scratch, else the checkpoint's
    ``max_position_embeddings``)."""
    where = f"{module}.init.hf config.json"
    architectures = hf.get("architectures") or []
    for name in architectures:
        if name in NOT_MODELLED:
            raise ConfigError(f"{where}: architectures=[{name!r}] is not imported: {NOT_MODELLED[name]}")
    unknown = [a for a in architectures if a not in ARCHITECTURES]
    if not architectures or unknown:
        raise ConfigError(f"{where}: architectures={architectures} is not one hetero imports; it imports "
                          f"{', '.join(ARCHITECTURES)}")
    family = ARCHITECTURES[architectures[0]]
    quantized = hf.get("quantization_config")
    if quantized is not None:
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else quantized
        raise ConfigError(f"{where}: quantization_config (quant_method={method!r}) means quantized weights, which "
                          "hetero does not read; dequantize the checkpoint to bf16 or fp32 first (transformers: "
                          "load it with its dequantize option and save_pretrained) and import that copy")
    extra = sorted(set(hf) - MODELLED - BOOKKEEPING)
    if extra:
        raise ConfigError(f"{where}: hetero does not model the field(s) {', '.join(extra)}; "
                          "import a checkpoint without them")

    def refuse(field: str, value, why: str) -> None:
        raise ConfigError(f"{where}: {field}={value!r} is not modelled ({why})")

    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", hf["hidden_act"], "hetero's GPT uses SwiGLU with silu")
    if hf.get("attention_dropout", 0.0):
        refuse("attention_dropout", hf["attention_dropout"], "hetero's attention has no dropout")
    if hf.get("mlp_bias", False):
        refuse("mlp_bias", True, "hetero's MLP has no biases")
    if hf.get("pretraining_tp", 1) != 1:
        refuse("pretraining_tp", hf["pretraining_tp"], "only 1 computes the plain projections")
    if family not in ("qwen2", "glm4_moe") and hf.get("attention_bias", False):
        refuse("attention_bias", True, "it adds a bias to the output projection too; hetero biases q, k, v only")
    length = seq_len or hf.get(TRAINED_LENGTH) or hf["max_position_embeddings"]
    window = hf.get("sliding_window")
    windowed = hf.get("use_sliding_window")
    if windowed is None:  # Mistral's configs have no switch: its window applies whenever set
        windowed = family in ("mistral", "mixtral")
    if windowed and window is not None and window < length:
        refuse("sliding_window", window, f"sliding-window attention; train at seq_len <= {window}")
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        refuse("layer_types", sorted(set(layer_types)), "every layer attends to the full sequence in hetero")
    theta, scaling = _rope(hf, where)
    sections, interleaved = _mrope(hf)
    if hf.get("clip_qkv") is not None:
        refuse("clip_qkv", hf["clip_qkv"], "hetero does not clamp q, k and v")
    experts = _experts(hf, family, refuse) if family in ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe", *ROUTED_BY_SIGMOID) else {}
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    rotary = _rotary_dim(hf, head_dim or hf["hidden_size"] // heads)
    latent = _latent(hf, scaling, refuse) if family == "deepseek_v3" else {}
    if latent:
        head_dim, rotary = latent.pop("head_dim"), latent.pop("rotary_dim")
    return GPTConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=hf["intermediate_size"], seq_len=length,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), pad_token_id=hf.get("pad_token_id"), rope_theta=theta,
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        head_dim=head_dim if head_dim and head_dim != hf["hidden_size"] // heads else None,
        qkv_bias=family == "qwen2" or (family == "qwen2_moe" and bool(hf.get("qkv_bias", True)))
        or (family == "glm4_moe" and bool(hf.get("attention_bias", False))),
        qk_norm=family in ("qwen3", "qwen3_moe", "olmoe") or (family == "glm4_moe" and bool(hf.get("use_qk_norm", False))),
        qk_norm_across_heads=family == "olmoe",
        rotary_dim=rotary, rope_scaling=scaling, mrope_sections=sections,
        mrope_interleaved=interleaved, deepstack_layers=list(hf.get(DEEPSTACK, [])), **experts, **latent,
    )


def _experts(hf: dict, family: str, refuse) -> dict:
    """The GPT config's expert fields of a Qwen3-MoE or Mixtral config."""
    if hf.get("router_jitter_noise", 0.0):
        refuse("router_jitter_noise", hf["router_jitter_noise"], "hetero's router adds no noise")
    if family in ROUTED_BY_SIGMOID:  # DeepSeek-V3's routing, its router in fp32
        return dict(num_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"],
                    expert_ffn_size=hf["moe_intermediate_size"], normalize_gates=bool(hf.get("norm_topk_prob", True)),
                    gate="sigmoid", selection_bias=True, expert_groups=hf.get("n_group") or 1,
                    groups_per_token=hf.get("topk_group") or 1, routed_scale=float(hf.get("routed_scaling_factor", 1.0)),
                    shared_experts=hf.get("n_shared_experts") or 0,
                    dense_layers=list(range(hf.get("first_k_dense_replace") or 0)), router_fp32=True)
    if family == "olmoe":  # softmax top-k, its experts intermediate_size wide
        return dict(num_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"], expert_ffn_size=hf["intermediate_size"],
                    normalize_gates=bool(hf.get("norm_topk_prob", False)))
    if family == "mixtral":
        return dict(num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                    expert_ffn_size=hf["intermediate_size"], normalize_gates=True)
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    # transformers' rule: a layer has experts unless listed, and then only every step-th (1-based)
    dense |= {i for i in range(hf["num_hidden_layers"]) if (i + 1) % step}
    routed = dict(num_experts=hf.get("num_experts") or hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                  expert_ffn_size=hf["moe_intermediate_size"], normalize_gates=bool(hf.get("norm_topk_prob", False)),
                  dense_layers=sorted(dense))
    if family == "qwen3_moe":
        return routed
    shared, width = hf["shared_expert_intermediate_size"], hf["moe_intermediate_size"]
    if shared % width:
        refuse("shared_expert_intermediate_size", shared, f"hetero's shared experts are whole experts of "
               f"moe_intermediate_size={width}")
    return routed | dict(shared_experts=shared // width, shared_expert_gate=True)


def _latent(hf: dict, scaling: RopeScaling, refuse) -> dict:
    """DeepSeek-V3's multi-head latent attention as GPT config fields: a head's q and k are its un-turned
    and turned channels (``head_dim``, the last ``rotary_dim`` turned), the logits scaled by YaRN's
    ``mscale_all_dim`` factor squared when its rope is scaled (transformers' ``yarn_apply_mscale``)."""
    heads = hf["num_attention_heads"]
    if (hf.get("num_key_value_heads") or heads) != heads:
        refuse("num_key_value_heads", hf["num_key_value_heads"], f"latent attention expands keys and values for "
               f"each of the {heads} heads")
    if hf.get("attention_bias", False):
        refuse("attention_bias", True, "hetero's latent attention has no biases")
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    all_dim = params.get("mscale_all_dim") or 0
    scale = yarn_mscale(scaling.factor, all_dim) ** 2 if scaling.type != "none" and all_dim else 1.0
    return dict(head_dim=hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"], rotary_dim=hf["qk_rope_head_dim"],
                kv_lora_rank=hf["kv_lora_rank"], q_lora_rank=hf.get("q_lora_rank") or 0, v_head_dim=hf["v_head_dim"],
                rope_interleaved=bool(hf.get("rope_interleave", True)), softmax_scale=scale)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale of a context stretched ``factor`` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rotary_dim(hf: dict, head_dim: int) -> int | None:
    """The channels of a head RoPE turns under partial rotary (``partial_rotary_factor``); None: all."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    factor = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    return None if factor == 1.0 else int(head_dim * factor)


def beyond_layers(name: str, config: GPTConfig) -> bool:
    """Whether HF weight ``name`` belongs to a layer past the GPT's (GLM-4-MoE's multi-token prediction
    layers, ``num_nextn_predict_layers``): passed over on import, carried back on export."""
    match = _LAYER.fullmatch(name)
    return match is not None and int(match.group(1)) >= config.num_layers


def _rope(hf: dict, where: str) -> tuple[float, RopeScaling]:
    """RoPE theta and scaling from ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "mrope":  # how configs of Qwen2-VL and Qwen2.5-VL before transformers 5 name plain M-RoPE
        kind = "default"
    extra = sorted(set(params) - _ROPE_KEYS)
    if extra:
        raise ConfigError(f"{where}: rope parameter(s) {', '.join(extra)} are not modelled")
    if kind == "default":
        return theta, RopeScaling()
    if kind not in ("llama3", "yarn"):
        raise ConfigError(f"{where}: rope_type={kind!r} is not modelled; hetero models default, llama3, yarn")
    if params.get("truncate", True) is not True:
        raise ConfigError(f"{where}: rope truncate=false is not modelled")
    original = params.get("original_max_position_embeddings") or hf["max_position_embeddings"]
    scaling = RopeScaling(type=kind, factor=float(params["factor"]), original_max_position=int(original))
    if kind == "llama3":
        scaling.low_freq_factor = float(params["low_freq_factor"])
        scaling.high_freq_factor = float(params["high_freq_factor"])
    else:
        scaling.beta_fast = float(params.get("beta_fast", 32.0))
        scaling.beta_slow = float(params.get("beta_slow", 1.0))
        scaling.attention_factor = params.get("attention_factor")
        if scaling.attention_factor is None and params.get("mscale") and params.get("mscale_all_dim"):
            scaling.attention_factor = yarn_mscale(scaling.factor, params["mscale"]) / yarn_mscale(
                scaling.factor, params["mscale_all_dim"])
    return theta, scaling


def _mrope(hf: dict) -> tuple[list[int], bool]:
    """M-RoPE's sections and interleaving (a Qwen-VL's language model, ``hetero.interop.qwen_vl``), none for
    a plain decoder."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    return list(params.get("mrope_section") or []), bool(params.get("mrope_interleaved", False))


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_IN_LAYER = {
    "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo", "self_attn.q_norm": "attention.q_norm", "self_attn.k_norm": "attention.k_norm",
    "self_attn.q_a_proj": "attention.wq_a", "self_attn.q_a_layernorm": "attention.q_a_norm",
    "self_attn.q_b_proj": "attention.wq_b", "self_attn.kv_a_proj_with_mqa": "attention.wkv_a",
    "self_attn.kv_a_layernorm": "attention.kv_a_norm", "self_attn.kv_b_proj": "attention.wkv_b",
    "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3", "mlp.down_proj": "feed_forward.w2",
    "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "feed_forward.router", "mlp.experts": "feed_forward.experts",  # experts: ``hf_experts``' stacks
    "mlp.shared_expert.gate_proj": "feed_forward.shared.w1", "mlp.shared_expert.up_proj": "feed_forward.shared.w3",
    "mlp.shared_expert.down_proj": "feed_forward.shared.w2", "mlp.shared_expert_gate": "feed_forward.shared_gate",
}
_MIXTRAL = {"block_sparse_moe.gate": "feed_forward.router", "block_sparse_moe.experts": "feed_forward.experts"}
# GLM-4-MoE's (and DeepSeek's) ungated shared experts, read in; written as the source spelled them (``weight_names``)
_SHARED_EXPERTS = {f"mlp.shared_experts.{theirs}": f"feed_forward.shared.{ours}"
                   for theirs, ours in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))}
_SELECTION_BIAS = ("mlp.gate.e_score_correction_bias", "feed_forward.selection_bias")  # whole names in a layer
_TOP = {"model.embed_tokens": "tok_embeddings", "model.norm": "norm", "lm_head": "output"}


def gpt_name(hf_name: str) -> str:
    """hetero's name of HF weight ``hf_name`` (``model.layers.3.mlp.up_proj.weight`` -> ``layers.3.feed_forward.w3.weight``)."""
    module, _, leaf = hf_name.rpartition(".")
    if (match := _LAYER.fullmatch(hf_name)) and match.group(2) == _SELECTION_BIAS[0]:
        return f"layers.{match.group(1)}.{_SELECTION_BIAS[1]}"
    if match := _LAYER.fullmatch(module):
        layer, inner = match.groups()
        for names in (_IN_LAYER, _MIXTRAL, _SHARED_EXPERTS):
            if inner in names:
                return f"layers.{layer}.{names[inner]}.{leaf}"
    elif module in _TOP:
        return f"{_TOP[module]}.{leaf}"
    raise ConfigError(f"HF weight {hf_name!r} has no place in hetero's GPT")


def text_weights(checkpoint, config: GPTConfig, module: str = "llm"):
    """The tensors a GPT of ``config`` reads from ``checkpoint`` (a decoder, or a VLM's language model part):
    itself, with its experts stacked as hetero holds them where it has experts (``hf_experts``)."""
    return StackedExperts(checkpoint, config.num_experts, module) if config.moe else checkpoint


def check_weights(checkpoint: HFCheckpoint, config: GPTConfig, module: str = "llm") -> None:
    """Refuse a checkpoint holding a weight the GPT has no place for (an output projection's bias, a
    layer past ``num_layers``), or lacking one it needs: nothing is silently left out."""
    where = f"{module}.init.hf ({checkpoint.path})"
    ahead = checkpoint.config.get("num_nextn_predict_layers") or 0  # layers past the GPT's, passed over
    have = {gpt_name(name) for name in text_weights(checkpoint, config, module).names()
            if not (ahead and beyond_layers(name, config))}
    names = weight_names(config)
    need = {name for name in gpt_weights(config) if names(name) is not None}
    if extra := sorted(have - need - {"output.weight"}):
        raise ConfigError(f"{where}: weights {', '.join(extra[:4])} have no place in this GPT")
    if missing := sorted(need - have):
        raise ConfigError(f"{where}: lacks weights {', '.join(missing[:4])}")


def gpt_weights(config: GPTConfig) -> list[str]:
    """Every weight name of a whole (unsplit) GPT of ``config`` (built on the meta device: no memory)."""
    with torch.device("meta"):
        return list(GPT(config).state_dict())


def weight_names(config: GPTConfig, moe_block: str = "mlp", shared: str = "shared_expert"):
    """HF's name of each weight of a GPT of ``config``, None for an output layer tied to the embedding;
    ``moe_block``: what the checkpoint calls a layer's mixture of experts (Mixtral's hub files:
    ``block_sparse_moe``); ``shared``: its shared experts (Qwen2-MoE's ``shared_expert``, GLM-4-MoE's
    ``shared_experts``)."""
    def name_of(name: str) -> str | None:
        if config.tie_embeddings and name == "output.weight":
            return None
        theirs = hf_name(name).replace(".mlp.shared_expert.", f".mlp.{shared}.")
        return theirs.replace(".mlp.", f".{moe_block}.") if ".feed_forward." in name and config.moe else theirs

    return name_of


_OUT_LAYER = {ours: theirs for theirs, ours in _IN_LAYER.items()}
_OUT_TOP = {ours: theirs for theirs, ours in _TOP.items()}


def hf_name(name: str) -> str:
    """HF's name of hetero GPT weight ``name`` (the inverse of ``gpt_name``)."""
    layer, _, inner = name.removeprefix("layers.").partition(".")
    if name.startswith("layers.") and inner == _SELECTION_BIAS[1]:
        return f"model.layers.{layer}.{_SELECTION_BIAS[0]}"
    if (hf := renamed(name, "model.layers", _OUT_LAYER, _OUT_TOP)) is not None:
        return hf
    raise ConfigError(f"GPT weight {name!r} has no place in a Hugging Face checkpoint")


def load_gpt(model, path: str | Path) -> int:
    """Fill ``model`` (a GPT, whole or parallelized and materialized) from the HF checkpoint at ``path``,
    (a decoder, or a whole LLaVA's LM), each rank reading only the slices it holds; the bytes read."""
    from hetero.interop.parts import open_part

    part = open_part(path, "text")
    source = text_weights(part, model.config)
    names = weight_names(model.config, getattr(source, "block", "mlp"), getattr(source, "shared", "shared_expert"))
    if hasattr(model, "weights_state"):  # the megatron backend: read into its native view, then back
        view = model.weights_state()
        read = load_into(view, source, names)
        model.load_weights_state(view)
        return read
    return load_into(model.state_dict(keep_vars=True), source, names)
