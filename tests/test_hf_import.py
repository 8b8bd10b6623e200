"""Hugging Face decoders imported into hetero's GPT (``hetero/models/gpt/hf.py``): tiny random Llama, Qwen2,
Qwen3 and Mistral models built offline with ``transformers``, every weight perturbed (norms off 1, biases
off 0), saved with ``save_pretrained`` (sharded with an index for one), imported, and run on the same
tokens: logits equal to transformers' within 1e-5 in fp32. Configs hetero does not model are refused by
name."""

import json

import pytest
import torch
import transformers

from hetero.errors import ConfigError
from hetero.interop.hf_checkpoint import HFCheckpoint
from hetero.models import default_registry
from hetero.models.gpt.hf import gpt_config, load_gpt
from hetero.models.gpt.model import GPT

SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64)
CASES = {
    "llama 3: GQA, theta 5e5, llama3 scaling, tied embeddings, eps 1e-6": (
        "LlamaConfig", "LlamaForCausalLM",
        dict(num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=True,
             rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen2: biases on q, k, v, yarn scaling, sharded files": (
        "Qwen2Config", "Qwen2ForCausalLM",
        dict(num_key_value_heads=2, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                     "original_max_position_embeddings": 16})),
    "qwen3: q/k norm, head_dim 16 (not hidden / heads)": (
        "Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=1, head_dim=16)),
    "qwen3 with two kv heads and tied embeddings": (
        "Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
    "qwen3 with two kv heads, untied": (
        "Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)),
    "mistral: a window the sequence does not reach": (
        "MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=64)),
}


def saved(tmp_path, config_class, model_class, fields, shard=False):
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**(SIZES | fields))
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    model.save_pretrained(tmp_path, max_shard_size="20KB" if shard else "1GB")
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_an_imported_decoder_gives_transformers_logits(tmp_path, case):
    config_class, model_class, fields = CASES[case]
    reference = saved(tmp_path, config_class, model_class, fields, shard="sharded" in case)
    assert ("sharded" in case) == (tmp_path / "model.safetensors.index.json").exists()
    model = imported(tmp_path)
    tokens = torch.randint(0, SIZES["vocab_size"], (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        got = model.eval()(tokens)
    error = ((got - expected).abs().max() / expected.abs().max()).item()
    print(f"\n{case}: logits relative error {error:.1e}")
    assert error < 1e-5


def imported(path) -> GPT:
    """A whole GPT from the HF checkpoint at ``path``, as ``llm.init.hf`` loads it in one process."""
    model = GPT(gpt_config(HFCheckpoint(path).config))
    load_gpt(model, path)
    return model


def hf_config(**changes):
    fields = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **SIZES, "num_key_value_heads": 2,
              "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default",
                                                                               "rope_theta": 1e4}}
    return fields | changes


@pytest.mark.parametrize("changes,message", [
    ({"architectures": ["GPT2LMHeadModel"]}, r"architectures=\['GPT2LMHeadModel'\] is not one hetero imports"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not modelled \(hetero's GPT uses SwiGLU with silu\)"),
    ({"attention_bias": True}, r"attention_bias=True is not modelled \(it adds a bias to the output projection"),
    ({"mlp_bias": True}, r"mlp_bias=True is not modelled"),
    ({"logit_softcapping": 30.0}, r"hetero does not model the field\(s\) logit_softcapping"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     r"rope_type='dynamic' is not modelled; hetero models default, llama3, yarn"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 16},
     r"sliding_window=16 is not modelled \(sliding-window attention; train at seq_len <= 16\)"),
])
def test_a_config_hetero_does_not_model_is_refused_by_name(changes, message):
    with pytest.raises(ConfigError, match=message):
        gpt_config(hf_config(**changes))
    json.dumps(hf_config(**changes))  # a plain config.json


def evaluated(rank, world_size, path, layout, batch, parallel=None):
    from hetero.testing.kinds import build_runtime
    from hetero.testing.experiments import experiment, module

    block = module("gpt", {"seq_len": batch["tokens"].shape[1]}, layout, parallel=parallel, init={"hf": str(path)})
    runtime = build_runtime(experiment(world_size, {"llm": block}, global_batch=len(batch["tokens"]),
                                       microbatches=2 if layout.get("pp", 1) > 1 else 1))
    loss = runtime.evaluate([batch])["llm.loss"]
    return loss, runtime.modules["llm"].pretrained_bytes, stage_logits(runtime.modules["llm"], batch["tokens"])


def stage_logits(module, tokens):
    """The logits on the last stage's ranks (None elsewhere), with the positions they are of: each stage's
    model applied in turn, hidden states handed to the next stage's rank of the same TP and CP
    coordinates; TP logits gathered; under CP a rank's zigzag chunks of the sequence."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from hetero.parallel.context import split_for_cp, zigzag_indices

    mesh = module.mesh
    cp, seq = mesh.layout.cp, tokens.shape[1]
    positions = torch.arange(seq)
    if cp > 1:
        tokens, positions = split_for_cp(tokens, 1, cp, mesh.coord.cp), zigzag_indices(seq, cp, mesh.coord.cp)
    with torch.no_grad():
        x = tokens
        if not mesh.is_first_stage:
            x = torch.empty(*tokens.shape, module.model.config.hidden_size)
            dist.recv(x, mesh.layout.rank_at(mesh.coord._replace(pp=mesh.coord.pp - 1)))
        out = module.model(x, positions)
        if not mesh.is_last_stage:
            dist.send(out.contiguous(), mesh.layout.rank_at(mesh.coord._replace(pp=mesh.coord.pp + 1)))
            return None
    return positions, out.full_tensor() if isinstance(out, DTensor) else out


QWEN2, QWEN3 = "qwen2: biases on q, k, v, yarn scaling, sharded files", "qwen3 with two kv heads and tied embeddings"
LLAMA = "llama 3: GQA, theta 5e5, llama3 scaling, tied embeddings, eps 1e-6"
QWEN3_UNTIED, MISTRAL = "qwen3 with two kv heads, untied", "mistral: a window the sequence does not reach"


@pytest.mark.parametrize("case,layout,share", [
    (QWEN2, {"tp": 2, "dp": 1}, (0.5, 0.55)), (QWEN2, {"pp": 2, "dp": 1}, (0.4, 0.6)),
    (QWEN2, {"cp": 2, "dp": 1}, (1.0, 1.0)), (QWEN3, {"tp": 2, "dp": 1}, (0.5, 0.55)),
    (QWEN2, {"tp": 2, "pp": 2, "dp": 1}, (0.2, 0.3)), (LLAMA, {"tp": 2, "dp": 1}, (0.5, 0.55)),
    (QWEN3, {"cp": 2, "dp": 1}, (1.0, 1.0)), (LLAMA, {"cp": 2, "dp": 1}, (1.0, 1.0)),
    (QWEN3_UNTIED, {"tp": 2, "pp": 2, "dp": 1}, (0.2, 0.3)), (MISTRAL, {"tp": 2, "pp": 2, "dp": 1}, (0.2, 0.3)),
], ids=["qwen2 tp2", "qwen2 pp2", "qwen2 cp2", "qwen3 tp2", "qwen2 tp2·pp2", "llama tp2", "qwen3 cp2", "llama cp2",
        "qwen3 tp2·pp2", "mistral tp2·pp2"])
def test_an_imported_decoder_under_a_layout_gives_transformers_loss(tmp_path, case, layout, share):
    """``llm.init.hf`` in an experiment: the loss of transformers on every rank and its logits on every
    last-stage rank (under CP, at the positions the rank holds); each rank reading only what it holds (``share``: the bounds of its part of the checkpoint's bytes; TP splits all but the
    norms and Qwen3's per-head norms, a stage holds half the layers and one end, CP holds everything)."""
    from hetero.testing.multiprocess import run_ranks

    config_class, model_class, fields = CASES[case]
    reference = saved(tmp_path, config_class, model_class, fields, shard=True)
    tokens = torch.randint(0, SIZES["vocab_size"], (4, 40), generator=torch.Generator().manual_seed(2))
    labels = torch.cat([tokens[:, 1:], torch.full((4, 1), -100)], dim=1)
    with torch.no_grad():
        logits = reference(tokens).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).item()
    world = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)
    results = run_ranks(evaluated, world, tmp_path, layout, {"tokens": tokens, "labels": labels})
    total = sum(t.numel() * t.element_size() for _, t in HFCheckpoint(tmp_path).tensors(HFCheckpoint(tmp_path).names()))
    errors = [((got - logits[:, where]).abs().max() / logits.abs().max()).item()
              for *_, held in results if held is not None for where, got in [held]]
    print(f"\n{case} {layout}: loss rel. errors " + ", ".join(f"{abs(r[0] - expected) / expected:.1e}" for r in results)
          + "; bytes read per rank / checkpoint " + ", ".join(f"{r[1] / total:.2f}" for r in results)
          + "; last stage's logits rel. errors " + ", ".join(f"{e:.1e}" for e in errors))
    assert len(errors) == layout.get("tp", 1) * layout.get("cp", 1)  # every last-stage rank
    assert all(error < 1e-5 for error in errors), errors
    for loss, read, _ in results:
        assert abs(loss - expected) / expected < 1e-5, (loss, expected)
        assert share[0] <= read / total <= share[1], read / total


def test_init_hf_takes_the_sizes_from_the_checkpoint_and_refuses_others_that_disagree(tmp_path):
    from hetero.testing.experiments import experiment, module

    saved(tmp_path, *CASES["qwen3: q/k norm, head_dim 16 (not hidden / heads)"])
    config = experiment(1, {"llm": module("gpt", {"seq_len": 24}, {"dp": 1}, init={"hf": str(tmp_path)})},
                        global_batch=2, microbatches=1).model_config("llm", default_registry())
    assert (config.seq_len, config.hidden_size, config.head_size, config.qk_norm) == (24, 32, 16, True)
    with pytest.raises(ConfigError, match=r"llm\.init\.hf gives llm's sizes, and llm\.model disagrees with its "
                                          r"config\.json on 1 field: llm\.model\.hidden_size=64 \(config\.json: 32\); "
                                          r"remove it or set it to config\.json's value"):
        experiment(1, {"llm": module("gpt", {"hidden_size": 64}, {"dp": 1}, init={"hf": str(tmp_path)})},
                   global_batch=2, microbatches=1).model_config("llm", default_registry())
    restated = {"seq_len": 24, "hidden_size": 32, "qk_norm": True, "num_kv_heads": 1}  # a shipped shape, checked
    assert experiment(1, {"llm": module("gpt", restated, {"dp": 1}, init={"hf": str(tmp_path)})},
                      global_batch=2, microbatches=1).model_config("llm", default_registry()) == config
    with pytest.raises(ConfigError, match=r"dna\.init\.hf: genezip modules import no Hugging Face checkpoints"):
        experiment(1, {"dna": module("genezip", {}, {"dp": 1}, init={"hf": str(tmp_path)})},
                   global_batch=2, microbatches=1).model_config("dna", default_registry())
    with pytest.raises(ConfigError, match=r"vision\.init\.hf config\.json: architectures=\['Qwen3ForCausalLM'\] is "
                                          r"not one hetero imports as a vision tower"):
        experiment(1, {"vision": module("vit", {}, {"dp": 1}, init={"hf": str(tmp_path)})},
                   global_batch=2, microbatches=1).model_config("vision", default_registry())


def test_a_weight_the_gpt_has_no_place_for_or_lacks_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from hetero.testing.experiments import experiment, module

    saved(tmp_path, *CASES["mistral: a window the sequence does not reach"])
    weights = load_file(tmp_path / "model.safetensors")

    def config_with(tensors):
        save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
        return experiment(1, {"llm": module("gpt", {}, {"dp": 1}, init={"hf": str(tmp_path)})},
                          global_batch=2, microbatches=1).model_config("llm", default_registry())

    with pytest.raises(ConfigError, match=r"weights layers\.0\.attention\.wo\.bias have no place in this GPT"):
        config_with(weights | {"model.layers.0.self_attn.o_proj.bias": torch.zeros(SIZES["hidden_size"])})
    with pytest.raises(ConfigError, match=r"lacks weights layers\.1\.ffn_norm\.weight"):
        config_with({k: v for k, v in weights.items() if k != "model.layers.1.post_attention_layernorm.weight"})
    assert config_with(weights).num_layers == 2
