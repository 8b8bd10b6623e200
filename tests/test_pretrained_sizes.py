"""A pretrained model's sizes win over the experiment's defaults: with ``init.hf`` (a tiny random Qwen2 and
SigLIP tower saved offline with ``transformers``) or ``init.checkpoint`` (a ``step_*`` directory of an earlier
run) a module's sizes come from the checkpoint, the sizes the experiment YAML states give way to them, and
only ``model:`` fields set on the command line must agree: every one that disagrees is named in one error,
with the checkpoint's value and the fix."""

import json
import subprocess
import sys
from dataclasses import asdict

import pytest
from test_hf_import import saved

from hetero.config import load_experiment
from hetero.errors import ConfigError
from hetero.testing.kinds import build_graph
from hetero.models import default_registry
from hetero.models.genezip.config import GeneZipConfig
from hetero.train.checkpoint_files import FORMAT, MANIFEST

# text_lm's YAML says vocab 256, hidden 192, 4 layers, 6 heads, seq_len 128: none of these
QWEN2 = dict(num_key_value_heads=2, vocab_size=320)
SIZES = (320, 32, 2, 4, 2, 48, True)


def sizes(config):
    return (config.vocab_size, config.hidden_size, config.num_layers, config.num_heads, config.kv_heads,
            config.ffn_hidden_size, config.qkv_bias)


@pytest.fixture
def qwen2(tmp_path):
    saved(tmp_path / "qwen2", "Qwen2Config", "Qwen2ForCausalLM", QWEN2)
    return tmp_path / "qwen2"


def test_init_hf_sizes_the_model_over_the_yamls_and_refuses_disagreeing_overrides_together(qwen2):
    registry = default_registry()
    experiment = load_experiment("text_lm", [f"llm.init.hf={qwen2}"])
    config = build_graph(experiment, registry).nodes["llm"].config
    assert sizes(config) + (config.seq_len,) == SIZES + (128,)  # seq_len: the YAML's (the checkpoint leaves it open)
    # the command line may restate a size, and set what the checkpoint leaves open
    restated = load_experiment("text_lm", [f"llm.init.hf={qwen2}", "llm.model.hidden_size=32",
                                           "llm.model.seq_len=48"]).model_config("llm", registry)
    assert sizes(restated) + (restated.seq_len,) == SIZES + (48,)
    disagreeing = load_experiment("text_lm", [f"llm.init.hf={qwen2}", "llm.model.num_layers=3",
                                              "llm.model.hidden_size=128", "llm.model.seq_len=64"])
    with pytest.raises(ConfigError) as refused:
        disagreeing.model_config("llm", registry)
    print(f"\n{refused.value}")
    assert str(refused.value) == (
        "llm.init.hf gives llm's sizes, and the command line disagrees with its config.json on 2 fields: "
        "llm.model.hidden_size=128 (config.json: 32), llm.model.num_layers=3 (config.json: 2); "
        "drop these overrides or set each to config.json's value")
    with pytest.raises(ConfigError, match=r"on 1 field: llm\.model\.vocab_size=256 \(config\.json: 320\); drop this "
                                          r"override or set it to config\.json's value"):
        build_graph(load_experiment("text_lm", [f"llm.init.hf={qwen2}", "llm.model.vocab_size=256"]), registry)
    with pytest.raises(ConfigError, match=r"llm\.model\.hiden_size is not a field of GPTConfig"):
        load_experiment("text_lm", [f"llm.init.hf={qwen2}", "+llm.model.hiden_size=32"]).model_config("llm", registry)


def test_a_yaml_file_with_overrides_and_every_shipped_shape_take_the_checkpoints_sizes(tmp_path, qwen2):
    """An experiment file of one's own, ``init.hf`` in it, behaves as a shipped one; so does vlm_qwen_0_5b,
    whose YAML states Qwen2.5-0.5B's and SigLIP-base's shapes, for a tower and an LLM of other sizes
    (``llm.model={...}`` and ``vision={model: {...}}`` set their fields too)."""
    from test_hf_vision import saved as saved_tower

    registry = default_registry()
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        "name: mine\nworld_size: 1\nbatch: {global_batch_size: 4, micro_batch_size: 4}\n"
        "llm:\n  kind: gpt\n"
        "  model: {vocab_size: 256, hidden_size: 192, num_layers: 4, num_heads: 6, num_kv_heads: 6, seq_len: 64}\n"
        f"  init: {{hf: {qwen2}}}\n  layout: {{dp: 1}}\n"
        "train: {data: {format: stdlib_text}}\n")
    config = build_graph(load_experiment(str(mine)), registry).nodes["llm"].config
    assert sizes(config) + (config.seq_len,) == SIZES + (64,)
    for overrides in (["llm.model.num_heads=6", "llm.model.num_kv_heads=6"],
                      ["llm.model={num_heads: 6, num_kv_heads: 6}"]):
        with pytest.raises(ConfigError, match=r"the command line disagrees with its config\.json on 2 fields: "
                                              r"llm\.model\.num_heads=6 \(config\.json: 4\), "
                                              r"llm\.model\.num_kv_heads=6 \(config\.json: 2\); drop these overrides"):
            load_experiment(str(mine), overrides).model_config("llm", registry)
    saved_tower(tmp_path / "siglip", "siglip vision, layer -2 (LLaVA-style)")
    shipped = load_experiment("vlm_qwen_0_5b", [f"llm.init.hf={qwen2}", f"vision.init.hf={tmp_path / 'siglip'}"])
    assert sizes(shipped.model_config("llm", registry)) == SIZES
    tower = shipped.model_config("vision", registry)  # the YAML: 224 px, 3 channels, 768 wide, 12 layers
    assert (tower.image_size, tower.channels, tower.hidden_size, tower.num_layers, tower.out_size) == (32, 1, 32, 3, 32)
    with pytest.raises(ConfigError, match=r"vision\.model\.hidden_size=768 \(config\.json: 32\)"):
        load_experiment("vlm_qwen_0_5b", [f"vision.init.hf={tmp_path / 'siglip'}", "vision={model: {hidden_size: 768}}"]
                        ).model_config("vision", registry)


def hetero_train(cwd, *overrides):
    done = subprocess.run([sys.executable, "-m", "hetero.cli", "train", "text_lm", "train.log_every=1",
                           "train.eval_every=0", "train.eval_batches=1", "train.wandb=disabled", *overrides],
                          capture_output=True, text=True, timeout=400, cwd=cwd)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_hetero_train_starts_from_a_pretrained_model_or_an_earlier_runs_checkpoint_without_restating_sizes(
        tmp_path, qwen2):
    """``hetero train text_lm llm.init.hf=DIR`` trains (2 steps, one rank) without restating a size; its
    checkpoint then sizes ``llm.init.checkpoint`` alone (no ``init.hf``): every field the run recorded,
    the YAML's seq_len too, with command-line disagreements refused together, and a next run starts from it."""
    registry = default_registry()
    first = hetero_train(tmp_path, f"llm.init.hf={qwen2}", "llm.model.seq_len=32", "train.steps=2",
                         "train.checkpoint.every=2", f"train.run_dir={tmp_path / 'runs'}")
    assert "step     2 | loss" in first and "summary: steps 2" in first
    checkpoint = tmp_path / "runs" / "text_lm" / "checkpoints" / "step_000002"
    config = load_experiment("text_lm", [f"llm.init.checkpoint={checkpoint}"]).model_config("llm", registry)
    assert sizes(config) + (config.seq_len,) == SIZES + (32,)
    with pytest.raises(ConfigError) as refused:
        load_experiment("text_lm", [f"llm.init.checkpoint={checkpoint}", "llm.model.hidden_size=192",
                                    "llm.model.seq_len=128", "llm.model.num_layers=2"]).model_config("llm", registry)
    print(f"\n{refused.value}")
    assert str(refused.value) == (
        f"llm.init.checkpoint gives llm's sizes, and the command line disagrees with the model saved in {checkpoint} "
        "on 2 fields: llm.model.hidden_size=192 (the checkpoint: 32), llm.model.seq_len=128 (the checkpoint: 32); "
        "drop these overrides or set each to the checkpoint's value")
    second = hetero_train(tmp_path, f"llm.init.checkpoint={checkpoint}", "train.steps=1",
                          f"train.run_dir={tmp_path / 'next'}")
    assert "step     1 | loss" in second and "summary: steps 1" in second


def test_init_checkpoint_sizes_a_kind_without_a_hugging_face_mapping(tmp_path):
    """GeneZip has no Hugging Face form: a checkpoint's recorded model sizes it (only the manifest is read
    to build the graph); what the checkpoint does not hold, or holds of another kind, is refused by name."""
    registry = default_registry()
    recorded = GeneZipConfig(seq_len=256, hidden_size=32, num_heads=2, main_layers=1, encoder_layers=1,
                             decoder_layers=1, local_window=32, routing_window=32)
    checkpoint = tmp_path / "step_000007"
    checkpoint.mkdir()
    (checkpoint / MANIFEST).write_text(json.dumps({"format": FORMAT, "step": 7, "files": {}, "identity": {
        "models": {"dna": {"kind": "genezip", "model": asdict(recorded)}}}}))
    experiment = load_experiment("genezip", [f"dna.init.checkpoint={checkpoint}"])
    config = build_graph(experiment, registry).nodes["dna"].config
    assert config == recorded
    with pytest.raises(ConfigError, match=r"the command line disagrees with the model saved in .*step_000007 on 2 "
                                          r"fields: dna\.model\.hidden_size=64 \(the checkpoint: 32\), "
                                          r"dna\.model\.main_layers=2 \(the checkpoint: 1\); drop these overrides"):
        load_experiment("genezip", [f"dna.init.checkpoint={checkpoint}", "dna.model.hidden_size=64",
                                    "dna.model.main_layers=2"]).model_config("dna", registry)
    with pytest.raises(ConfigError, match=r"llm\.init\.checkpoint=.*step_000007: the checkpoint holds modules "
                                          r"\['dna'\], not llm"):
        load_experiment("text_lm", [f"llm.init.checkpoint={checkpoint}"]).model_config("llm", registry)
    with pytest.raises(ConfigError, match=r"dna\.init\.checkpoint=.*nothing: checkpoint .*nothing does not exist"):
        load_experiment("genezip", [f"dna.init.checkpoint={tmp_path / 'nothing'}"]).model_config("dna", registry)
