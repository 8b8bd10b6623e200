"""The ``config.json`` a GPT trained from scratch goes out with: the transformers family its attention and
routing match (Llama, Qwen2, Qwen3; with experts Qwen3-MoE, Mixtral, GLM-4-MoE or OLMoE; with latent
attention DeepSeek-V3), anything else refused by name; and the context its RoPE settings declare."""

from __future__ import annotations

from hetero.errors import ConfigError
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.hf import ROUTED_BY_SIGMOID, TRAINED_LENGTH


def hf_config(config: GPTConfig) -> dict:
    """A ``config.json`` that ``transformers`` builds this GPT (trained from scratch) from: Qwen3 with q/k
    norm, Qwen2 with q/k/v biases, Llama otherwise; with experts the family of ``_moe_family``. Its ``max_position_embeddings`` is the context of
    the RoPE settings (``rope_context``), and the length it was trained at is ``hetero_seq_len``, a
    field of hetero's own that ``transformers`` keeps on the config and otherwise leaves alone."""
    if config.kv_lora_rank:
        architecture, model_type = _latent_family(config)
    elif config.moe:
        architecture, model_type = _moe_family(config)
    elif config.qk_norm:
        architecture, model_type = "Qwen3ForCausalLM", "qwen3"
    elif config.qkv_bias:
        architecture, model_type = "Qwen2ForCausalLM", "qwen2"
    else:
        architecture, model_type = "LlamaForCausalLM", "llama"
    if config.qk_norm_across_heads and model_type != "olmoe":
        raise ConfigError("model.qk_norm_across_heads=true: only OLMoE normalizes q and k over all heads, a GPT with "
                          "experts routed by softmax")
    if model_type not in ROUTED_BY_SIGMOID:
        if config.qk_norm and config.qkv_bias:
            raise ConfigError("a GPT with both qk_norm and qkv_bias matches no Hugging Face architecture hetero "
                              "exports (GLM-4-MoE: with experts routed by sigmoid)")
        if config.rotary_size != config.head_size:
            raise ConfigError(f"model.rotary_dim={config.rotary_dim}: a GPT trained from scratch exports as Llama, "
                              "Qwen2, Qwen3, Qwen3-MoE or Mixtral, which turn every channel of a head (GLM-4-MoE: "
                              "with experts routed by sigmoid)")
    rope: dict = {"rope_type": "default" if config.rope_scaling.type == "none" else config.rope_scaling.type,
                  "rope_theta": config.rope_theta}
    scaling = config.rope_scaling
    if scaling.type != "none":
        rope |= {"factor": scaling.factor, "original_max_position_embeddings": scaling.original_max_position}
    if scaling.type == "llama3":
        rope |= {"low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor}
    elif scaling.type == "yarn":
        rope |= {"beta_fast": scaling.beta_fast, "beta_slow": scaling.beta_slow}
        if scaling.attention_factor is not None:
            rope["attention_factor"] = scaling.attention_factor
    out = {
        "architectures": [architecture], "model_type": model_type, "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.ffn_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.kv_heads, "head_dim": config.head_size, "hidden_act": "silu",
        "max_position_embeddings": rope_context(config), TRAINED_LENGTH: config.seq_len,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings, "pad_token_id": config.pad_token_id, "rope_parameters": rope,
        "attention_dropout": 0.0,
        "dtype": "float32",
    }
    if model_type == "glm4_moe":
        rope["partial_rotary_factor"] = config.rotary_size / config.head_size
    if model_type != "qwen2":
        out["attention_bias"] = config.qkv_bias if model_type == "glm4_moe" else False
    if model_type == "deepseek_v3":  # head_dim is transformers' own: the rotary part
        out |= {"kv_lora_rank": config.kv_lora_rank, "q_lora_rank": config.q_lora_rank or None,
                "qk_nope_head_dim": config.head_size - config.rotary_size, "qk_rope_head_dim": config.rotary_size,
                "v_head_dim": config.v_size, "rope_interleave": config.rope_interleaved, "head_dim": config.rotary_size}
    if model_type == "qwen3_moe":
        out |= {"num_experts": config.num_experts, "num_experts_per_tok": config.top_k,
                "moe_intermediate_size": config.expert_size, "norm_topk_prob": config.normalize_gates,
                "decoder_sparse_step": 1, "mlp_only_layers": sorted(set(config.dense_layers))}
    elif model_type == "olmoe":
        out |= {"num_experts": config.num_experts, "num_experts_per_tok": config.top_k,
                "intermediate_size": config.expert_size, "norm_topk_prob": config.normalize_gates, "clip_qkv": None}
    elif model_type in ROUTED_BY_SIGMOID:
        out |= {"n_routed_experts": config.num_experts, "num_experts_per_tok": config.top_k,
                "moe_intermediate_size": config.expert_size, "norm_topk_prob": config.normalize_gates,
                "n_shared_experts": config.shared_experts, "routed_scaling_factor": config.routed_scale,
                "n_group": config.expert_groups, "topk_group": config.groups_per_token,
                "first_k_dense_replace": len(config.dense_layers), "num_nextn_predict_layers": 0}
        out |= {"use_qk_norm": config.qk_norm} if model_type == "glm4_moe" else {}
    elif model_type == "mixtral":
        out |= {"num_local_experts": config.num_experts, "num_experts_per_tok": config.top_k,
                "intermediate_size": config.expert_size, "router_jitter_noise": 0.0, "sliding_window": None}
    return out


def _latent_family(config: GPTConfig) -> tuple[str, str]:
    """A GPT with multi-head latent attention goes out as DeepSeek-V3: experts routed by sigmoid, the first
    layers dense, the logits' scale its own; anything else is refused by name."""
    for field, wrong, why in (
            ("num_experts", not config.moe, "its layers past first_k_dense_replace hold experts"),
            ("gate", config.gate != "sigmoid", "it routes by sigmoid"),
            ("shared_expert_gate", config.shared_expert_gate, "its shared experts are not gated"),
            ("capacity_factor", config.capacity_factor > 0, "it is dropless"),
            ("dense_layers", config.dense_layers != list(range(len(config.dense_layers))),
             "its dense layers are the first ones (first_k_dense_replace)"),
            ("softmax_scale", config.softmax_scale != 1.0, "its logits' scale follows from YaRN's mscale_all_dim")):
        if wrong:
            raise ConfigError(f"model.{field}={getattr(config, field)!r}: a GPT with multi-head latent attention "
                              f"exports as DeepSeek-V3, and {why}")
    return "DeepseekV3ForCausalLM", "deepseek_v3"


def _moe_family(config: GPTConfig) -> tuple[str, str]:
    """The transformers family a GPT with experts trained from scratch goes out as: softmax routing with
    q/k norm -> Qwen3-MoE; softmax, renormalized, without -> Mixtral; sigmoid -> GLM-4-MoE (DeepSeek-V3's
    routing; without a selection bias its bias is written as zeros); anything else is refused by name."""
    if config.gate == "sigmoid":
        for field, wrong, why in (
                ("shared_expert_gate", config.shared_expert_gate, "its shared experts are not gated"),
                ("capacity_factor", config.capacity_factor > 0, "it is dropless"),
                ("dense_layers", config.dense_layers != list(range(len(config.dense_layers))),
                 "its dense layers are the first ones (first_k_dense_replace)")):
            if wrong:
                raise ConfigError(f"model.{field}={getattr(config, field)!r}: a GPT with experts routed by sigmoid "
                                  f"exports as GLM-4-MoE, and {why}")
        return "Glm4MoeForCausalLM", "glm4_moe"
    if config.qk_norm_across_heads:
        for field, wrong, why in (("gate", config.gate != "softmax", "it routes by softmax"),
                                  ("shared_experts", config.shared_experts > 0, "it has no shared experts"),
                                  ("capacity_factor", config.capacity_factor > 0, "it is dropless"),
                                  ("qkv_bias", config.qkv_bias, "it does not bias q, k, v"),
                                  ("dense_layers", bool(config.dense_layers), "every layer has experts")):
            if wrong:
                raise ConfigError(f"model.{field}={getattr(config, field)!r}: a GPT with experts and q/k norms over "
                                  f"all heads exports as OLMoE, and {why}")
        return "OlmoeForCausalLM", "olmoe"
    for field, wrong, why in (("gate", config.gate != "softmax", "both families route by softmax"),
                              ("shared_experts", config.shared_experts > 0, "neither family has shared experts"),
                              ("capacity_factor", config.capacity_factor > 0, "both families are dropless"),
                              ("qkv_bias", config.qkv_bias, "neither family biases q, k, v")):
        if wrong:
            raise ConfigError(f"model.{field}={getattr(config, field)!r}: a GPT with experts exports as Qwen3-MoE or "
                              f"Mixtral, and {why}")
    if config.qk_norm:
        return "Qwen3MoeForCausalLM", "qwen3_moe"
    if config.normalize_gates and not config.dense_layers:
        return "MixtralForCausalLM", "mixtral"
    raise ConfigError("a GPT with experts and without model.qk_norm exports as Mixtral, which renormalizes its top-k "
                      f"gates (model.normalize_gates={config.normalize_gates}) and has no dense layers "
                      f"(model.dense_layers={config.dense_layers}); with q/k norm it exports as Qwen3-MoE")


def rope_context(config: GPTConfig) -> int:
    """The context the RoPE settings of ``config`` declare, its ``max_position_embeddings``: the original
    context (``rope_scaling.original_max_position``, 8192 unless set) times the scaling's ``factor``
    (the ratio ``transformers`` checks yarn's factor against), unscaled the original context itself; at
    least ``seq_len``, the positions it was trained at."""
    scaling = config.rope_scaling
    factor = scaling.factor if scaling.type != "none" else 1.0
    return max(round(scaling.original_max_position * factor), config.seq_len)
