"""Hugging Face mixtures of experts imported into hetero's GPT (``hetero/models/gpt/hf.py``,
``hf_experts.py``): tiny random Qwen3-MoE and Mixtral models built offline with ``transformers``, every
weight perturbed (Qwen2-MoE's shared expert and its gate too), saved in the hub's per-expert layout (``save_pretrained``) and in transformers 5's fused
one (its in-memory state as is); logits equal to transformers' within 1e-5 (fp32) in one process and under
ep2, ep2·tp2 with SP and ep2·pp2, each EP rank reading only its own experts' bytes. Exported back bit for bit in the
source's layout; a hetero MoE from scratch exported as Qwen3-MoE or Mixtral by its routing (the megatron
backend's import and export: ``test_megatron_backend``)."""

import json
import re

import pytest
import torch
import transformers
from safetensors.torch import save_file

from hetero.errors import ConfigError
from hetero.interop.hf_checkpoint import HFCheckpoint
from hetero.models.gpt.hf import gpt_config, load_gpt
from hetero.models.gpt.model import GPT

SIZES = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, num_experts_per_tok=2)
GLM = "glm-4-moe: deepseek routing, a shared expert, a dense first layer, partial rotary"
OLMOE = "olmoe: q and k norms over all heads"
DEEPSEEK = "deepseek-v3: latent attention, deepseek routing"
CASES = {
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=48, moe_intermediate_size=24, num_experts=4, head_dim=16)),
    "qwen3-moe renormalized": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                               dict(intermediate_size=48, moe_intermediate_size=24, num_experts=4, head_dim=16,
                                    norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=24, num_local_experts=4)),
    "qwen3-moe: a dense first layer, experts every second layer": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                                      head_dim=16, num_hidden_layers=4, mlp_only_layers=[0],
                                                      decoder_sparse_step=2)),
    "qwen2-moe: a gated shared expert, q/k/v biases": (
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                                      shared_expert_intermediate_size=32)),
    # DeepSeek-V3's routing (a selection bias, 4 groups of which a token keeps 2, a routed scale), a shared
    # expert, a dense first layer, partial rotary (half of each head), q/k norm and q/k/v biases
    GLM: ("Glm4MoeConfig", "Glm4MoeForCausalLM",
          dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, n_group=4, topk_group=2,
               routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3,
               head_dim=16, attention_bias=True, use_qk_norm=True, norm_topk_prob=True,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # multi-head latent attention (a q latent, rotary pairs interleaved, YaRN with DeepSeek's mscale on the
    # softmax and on cos/sin) beside DeepSeek-V3's routing
    DEEPSEEK: ("DeepseekV3Config", "DeepseekV3ForCausalLM",
               dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, n_group=4, topk_group=2,
                    routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3,
                    num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
                    rms_norm_eps=1e-5,  # the latent norms keep 1e-6 (as DeepSeek's code builds them)
                    v_head_dim=12, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                    "original_max_position_embeddings": 16, "mscale": 1.0,
                                                    "mscale_all_dim": 0.8})),
    "deepseek-v3: q straight from the hidden state, rotary in halves": (
        "DeepseekV3Config", "DeepseekV3ForCausalLM",
        dict(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4, n_group=1, topk_group=1,
             first_k_dense_replace=0, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
             qk_rope_head_dim=4, v_head_dim=8, rope_interleave=False)),
    # its config's pad_token_id (1): the embedding row its lookups do not train (padding_idx)
    OLMOE: ("OlmoeConfig", "OlmoeForCausalLM", dict(intermediate_size=24, num_experts=4)),
}


def saved(path, case: str, fused: bool = False):
    config_class, model_class, fields = CASES[case]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**(SIZES | fields))).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # 0 as built: then a left-out bias would not show
                buffer.add_(torch.randn_like(buffer) * 0.3)
    model.save_pretrained(path)
    if fused:  # transformers 5's in-memory layout: gate_up_proj (E, 2·ffn, hidden), down_proj (E, hidden, ffn)
        state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
        assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
        (path / "model.safetensors").unlink()
        save_file(state, path / "model.safetensors")
    return model


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert files", "fused files"])
@pytest.mark.parametrize("case", list(CASES))
def test_an_imported_moe_gives_transformers_logits(tmp_path, case, fused):
    reference = saved(tmp_path, case, fused)
    model = GPT(gpt_config(HFCheckpoint(tmp_path).config))
    load_gpt(model, tmp_path)
    tokens = torch.randint(0, SIZES["vocab_size"], (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        got = model.eval()(tokens)
    error = ((got - expected).abs().max() / expected.abs().max()).item()
    print(f"\n{case}, {'fused' if fused else 'per-expert'}: logits relative error {error:.1e}")
    assert error < 1e-5


@pytest.mark.parametrize("case,layout,parallel", [
    ("qwen3-moe renormalized", {"ep": 2, "dp": 2}, None),
    ("mixtral", {"ep": 2, "tp": 2, "dp": 2}, {"sequence_parallel": True}),
    ("qwen2-moe: a gated shared expert, q/k/v biases", {"ep": 2, "pp": 2, "dp": 2}, None),
    (GLM, {"ep": 2, "tp": 2, "dp": 2}, None),
    (DEEPSEEK, {"ep": 2, "pp": 2, "dp": 2}, None),
    (DEEPSEEK, {"ep": 2, "tp": 2, "dp": 2}, {"sequence_parallel": True}),
    (DEEPSEEK, {"ep": 2, "cp": 2, "dp": 2}, None),
], ids=["qwen3-moe ep2", "mixtral ep2·tp2+sp", "qwen2-moe ep2·pp2", "glm-4-moe ep2·tp2", "deepseek-v3 ep2·pp2",
        "deepseek-v3 ep2·tp2+sp", "deepseek-v3 ep2·cp2"])  # ep2·tp2 without SP: test_moe_training
def test_an_imported_moe_under_expert_parallelism_gives_transformers_logits_reading_its_experts(
        tmp_path, case, layout, parallel):
    """Every rank's loss and every last-stage rank's logits equal transformers'; at ep2 each rank reads the
    whole of every other weight and exactly its EP group's half of the experts' bytes (under tp2 its TP
    shards, under pp2 its stage's layers: not a round share)."""
    from test_hf_import import evaluated

    from hetero.testing.multiprocess import run_ranks

    reference = saved(tmp_path, case)
    tokens = torch.randint(0, SIZES["vocab_size"], (4, 40), generator=torch.Generator().manual_seed(2))
    labels = torch.cat([tokens[:, 1:], torch.full((4, 1), -100)], dim=1)
    with torch.no_grad():
        logits = reference(tokens).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).item()
    world = layout.get("tp", 1) * layout.get("cp", 1) * layout.get("pp", 1) * layout["dp"]
    results = run_ranks(evaluated, world, tmp_path, layout, {"tokens": tokens, "labels": labels}, parallel)
    checkpoint = HFCheckpoint(tmp_path)
    sizes = {name: t.numel() * t.element_size() for name, t in checkpoint.tensors(checkpoint.names())}
    experts = sum(size for name, size in sizes.items() if ".experts." in name)
    errors = [((got - logits[:, where]).abs().max() / logits.abs().max()).item()
              for *_, last in results if last is not None for where, got in [last]]
    assert len(errors) == world // layout.get("pp", 1)
    print(f"\n{case} {layout}: loss rel. errors " + ", ".join(f"{abs(r[0] - expected) / expected:.1e}" for r in results)
          + "; logits rel. errors " + ", ".join(f"{e:.1e}" for e in errors)
          + f"; bytes read per rank {[r[1] for r in results]} of {sum(sizes.values())} (experts {experts})")
    assert all(error < 1e-5 for error in errors), errors
    for loss, read, _ in results:
        assert abs(loss - expected) / expected < 1e-5, (loss, expected)
    if len(layout) == 2:  # ep·dp alone
        assert all(read == sum(sizes.values()) - experts // 2 for _, read, _ in results)


@pytest.mark.parametrize("changes,message", [
    ({"router_jitter_noise": 0.1}, r"router_jitter_noise=0\.1 is not modelled \(hetero's router adds no noise\)"),
])
def test_a_routing_hetero_does_not_model_is_refused_by_name(changes, message):
    fields = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **SIZES,
              "intermediate_size": 48, "moe_intermediate_size": 24, "num_experts": 4, "hidden_act": "silu"}
    with pytest.raises(ConfigError, match=message):
        gpt_config(json.loads(json.dumps(fields | changes)))


@pytest.mark.parametrize("config_class,message", [
    ("GptOssConfig", "attention sinks and its clamped SwiGLU"),
    ("DeepseekV2Config", r"DeepSeek-V2's routing \(softmax scores, group-limited greedy top-k"),
])
def test_a_family_hetero_does_not_model_is_refused_naming_what_is_missing(config_class, message):
    """transformers' own config of the family (its defaults, as its config.json has them)."""
    fields = getattr(transformers, config_class)().to_dict()
    fields["architectures"] = [config_class.replace("Config", "ForCausalLM")]
    with pytest.raises(ConfigError, match=rf"architectures=\['{fields['architectures'][0]}'\] is not imported: .*{message}"):
        gpt_config(json.loads(json.dumps(fields)))


@pytest.mark.parametrize("quantization", [
    {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
    {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
], ids=["fp8 (DeepSeek-V3's)", "mxfp4 (gpt-oss's)"])
def test_quantized_hub_weights_are_refused_until_dequantized(tmp_path, quantization):
    saved(tmp_path, "qwen3-moe")
    fields = HFCheckpoint(tmp_path).config | {"quantization_config": quantization}
    with pytest.raises(ConfigError, match=rf"quant_method='{quantization['quant_method']}'.*dequantize the checkpoint"):
        gpt_config(fields)


def test_norms_across_heads_without_qk_norm_or_on_megatron_are_refused():
    from dataclasses import replace

    from hetero.models.gpt.config import GPTConfig
    from hetero.parallel.layout import Layout

    config = GPTConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, seq_len=40, qk_norm_across_heads=True)
    one = Layout(tp=1, cp=1, dp=1, pp=1, ranks=(0,))
    assert any("llm.model.qk_norm_across_heads=true spans the q/k norms over all heads, and llm.model.qk_norm=false"
               in error for error in config.errors("llm", one))
    megatron = replace(config, qk_norm=True, backend="megatron").errors("llm", one)
    assert any("backend=megatron normalizes q and k per head" in error for error in megatron), megatron


def test_the_pad_tokens_row_imports_frozen_unless_the_module_trains_it(tmp_path):
    """OLMoE's ``pad_token_id`` imports as the row its lookups do not train; ``pad_token_id: null`` in the module's
    YAML trains it (the megatron backend's only way), and a pad token outside the vocabulary is refused."""
    from dataclasses import replace

    from hetero.models import default_registry
    from hetero.parallel.layout import Layout

    saved(tmp_path, OLMOE)
    gpt, one = default_registry()["gpt"], Layout(tp=1, cp=1, dp=1, pp=1, ranks=(0,))
    assert gpt.pretrained_config("llm", str(tmp_path), {}).pad_token_id == 1
    config = gpt.pretrained_config("llm", str(tmp_path), {"pad_token_id": None})
    assert config.pad_token_id is None
    megatron = replace(config, pad_token_id=1, qk_norm_across_heads=False, backend="megatron").errors("llm", one)
    assert any("backend=megatron trains every embedding row, the pad token's too (llm.model.pad_token_id=1); set "
               "llm.model.pad_token_id=null to train it" in error for error in megatron), megatron
    assert replace(config, pad_token_id=SIZES["vocab_size"]).errors("llm", one) == [
        f"llm.model.pad_token_id={SIZES['vocab_size']} is not a token of the vocabulary of {SIZES['vocab_size']}; use "
        f"0..{SIZES['vocab_size'] - 1} or null"]


def test_a_checkpoint_missing_an_expert_is_refused_naming_it(tmp_path):
    from hetero.models import default_registry

    saved(tmp_path, "mixtral")
    checkpoint = HFCheckpoint(tmp_path)
    state = {name: tensor for name, tensor in checkpoint.tensors(checkpoint.names()) if ".experts.3." not in name}
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match=r"block_sparse_moe\.experts holds experts 0, 1, 2; the config's 4 "
                                          r"experts are 0\.\.3"):
        default_registry()["gpt"].pretrained_config("llm", str(tmp_path), {})


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert files", "fused files"])
@pytest.mark.parametrize("case", ["qwen3-moe renormalized", "mixtral", "qwen2-moe: a gated shared expert, q/k/v biases",
                                  "qwen3-moe: a dense first layer, experts every second layer", GLM, OLMOE, DEEPSEEK])
def test_an_imported_moe_exports_bit_for_bit_in_its_sources_layout(tmp_path, case, fused):
    from hetero.interop.hf_export import hf_tensors
    from hetero.models import default_registry

    saved(tmp_path, case, fused)
    source = HFCheckpoint(tmp_path)
    model = GPT(gpt_config(source.config))
    load_gpt(model, tmp_path)
    export = default_registry()["gpt"].hf_export(model.config, source)
    written = hf_tensors(export, source, model.state_dict().items())
    assert export.config == source.config
    assert sorted(written) == sorted(source.names())
    for name, tensor in source.tensors(source.names()):
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name


def test_glm_multi_token_prediction_layers_are_passed_over_and_carried_back(tmp_path):
    """GLM-4.5's hub files hold its multi-token prediction layer after the last (``num_nextn_predict_layers``),
    which transformers does not build: hetero's import passes over it, its export writes it back as it was;
    without ``num_nextn_predict_layers`` such a layer is refused."""
    from safetensors.torch import load_file

    from hetero.interop.hf_export import hf_tensors
    from hetero.models import default_registry
    from hetero.models.gpt.hf import check_weights

    saved(tmp_path, GLM)
    layer = CASES[GLM][2]["num_hidden_layers"]
    state = load_file(tmp_path / "model.safetensors")
    ahead = {f"model.layers.{layer}.eh_proj.weight": torch.randn(32, 64), f"model.layers.{layer}.enorm.weight": torch.randn(32),
             f"model.layers.{layer}.self_attn.q_proj.weight": torch.randn(64, 32)}
    save_file(state | ahead, tmp_path / "model.safetensors")
    source = HFCheckpoint(tmp_path)
    assert source.config["num_nextn_predict_layers"] == 1
    config = gpt_config(source.config)
    check_weights(source, config)
    model = GPT(config)
    load_gpt(model, tmp_path)
    export = default_registry()["gpt"].hf_export(config, source)
    assert sorted(export.carried) == sorted(ahead)
    written = hf_tensors(export, source, model.state_dict().items())  # the writers add the carried tensors
    written |= {name: source.tensor(carried) for name, carried in export.carried.items()}
    assert sorted(written) == sorted(source.names())
    assert all(torch.equal(written[name], tensor) for name, tensor in ahead.items())
    source.config["num_nextn_predict_layers"] = 0
    with pytest.raises(ConfigError, match=rf"HF weight 'model\.layers\.{layer}\.eh_proj\.weight' has no place"):
        check_weights(source, config)


@pytest.mark.parametrize("family,fields", [
    ("Qwen3MoeForCausalLM", dict(qk_norm=True, normalize_gates=False)),
    ("Qwen3MoeForCausalLM", dict(qk_norm=True, dense_layers=[1])),
    ("MixtralForCausalLM", dict(qk_norm=False, normalize_gates=True)),
    ("Glm4MoeForCausalLM", dict(gate="sigmoid", normalize_gates=True, selection_bias=True, expert_groups=2,
                                routed_scale=2.5, shared_experts=1, dense_layers=[0], rotary_dim=4, qkv_bias=True,
                                qk_norm=True)),
    ("Glm4MoeForCausalLM", dict(gate="sigmoid")),  # no selection bias: a zero one is written
    ("OlmoeForCausalLM", dict(qk_norm=True, qk_norm_across_heads=True)),
    ("DeepseekV3ForCausalLM", dict(gate="sigmoid", normalize_gates=True, selection_bias=True, expert_groups=2,
                                   routed_scale=2.5, shared_experts=1, dense_layers=[0], num_kv_heads=None, head_dim=12,
                                   rotary_dim=4, kv_lora_rank=8, q_lora_rank=12, v_head_dim=6, rope_interleaved=True)),
], ids=["qwen3-moe", "qwen3-moe, a dense second layer", "mixtral", "glm-4-moe", "glm-4-moe, plain sigmoid", "olmoe",
        "deepseek-v3"])
def test_a_moe_trained_from_scratch_exports_as_the_family_of_its_routing(tmp_path, family, fields):
    """A hetero GPT with experts (random weights, a random selection bias) written as Qwen3-MoE, Mixtral,
    GLM-4-MoE, OLMoE or (with latent attention) DeepSeek-V3: transformers loads it and its logits equal hetero's."""
    from hetero.interop.hf_export import finish, hf_tensors, save_tensors
    from hetero.models import default_registry
    from hetero.models.gpt.config import GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=48, seq_len=40,
                       num_experts=4, top_k=2, expert_ffn_size=24, **({"num_kv_heads": 2} | fields))
    model = GPT(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
        for name, buffer in model.named_buffers():
            if name.endswith("selection_bias"):
                buffer.add_(torch.randn_like(buffer) * 0.3)
    export = default_registry()["gpt"].hf_export(config, None)
    save_tensors(hf_tensors(export, None, model.state_dict().items()), str(tmp_path / "model-00001-of-00001.safetensors"))
    finish(tmp_path, ["model-00001-of-00001.safetensors"], export.config, None)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs).__name__ == family
    tokens = torch.randint(0, 96, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = theirs(tokens).logits, model(tokens)
    error = ((got - expected).abs().max() / expected.abs().max()).item()
    print(f"\n{family}: exported logits relative error {error:.1e}")
    assert error < 1e-5


@pytest.mark.parametrize("fields,message", [
    (dict(gate="sigmoid", shared_experts=1, shared_expert_gate=True),
     r"model\.shared_expert_gate=True: a GPT with experts routed by sigmoid exports as GLM-4-MoE, and its shared "
     r"experts are not gated"),
    (dict(gate="sigmoid", dense_layers=[1]), r"its dense layers are the first ones"),
    (dict(shared_experts=1, qk_norm=True), r"model\.shared_experts=1: .* neither family has shared experts"),
    (dict(qk_norm=False, normalize_gates=False), r"exports as Mixtral, which renormalizes .*normalize_gates=False"),
    (dict(qk_norm=False, normalize_gates=True, dense_layers=[0]), r"has no dense layers \(model\.dense_layers=\[0\]\)"),
    (dict(kv_lora_rank=8, head_dim=12, rotary_dim=4), r"model\.gate='softmax': a GPT with multi-head latent attention "
     r"exports as DeepSeek-V3, and it routes by sigmoid"),
])
def test_a_moe_no_family_matches_is_refused_by_name(fields, message):
    from hetero.models import default_registry
    from hetero.models.gpt.config import GPTConfig

    config = GPTConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, seq_len=40, num_experts=4, **fields)
    with pytest.raises(ConfigError, match=message):
        default_registry()["gpt"].hf_export(config, None)


def test_latent_attention_fields_it_does_not_take_are_refused_by_name():
    from hetero.models.gpt.config import GPTConfig
    from hetero.parallel.layout import Layout

    latent = dict(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, head_dim=12, rotary_dim=4, kv_lora_rank=8,
                  seq_len=32)
    cases = [
        (latent | {"backend": "megatron"}, Layout(1, 1, 1, 1, (0,)), r"backend=megatron: multi-head latent attention"),
        (latent | {"rotary_dim": None}, Layout(1, 1, 1, 1, (0,)), r"set rotary_dim below head_dim=12"),
        (latent | {"num_kv_heads": 2}, Layout(1, 1, 1, 1, (0,)), r"num_kv_heads=2 does not apply to multi-head latent"),
        (latent | {"kv_lora_rank": 0, "q_lora_rank": 8}, Layout(1, 1, 1, 1, (0,)),
         r"q_lora_rank=8 belongs to multi-head latent attention, and llm\.model\.kv_lora_rank=0"),
    ]
    for fields, layout, message in cases:
        errors = GPTConfig(**fields).errors("llm", layout)
        assert any(re.search(message, error) for error in errors), (message, errors)
