"""Hetero modules written back as Hugging Face checkpoints from any layout (``hetero/interop/hf_export.py``):
an import at tp2·pp2 exported untrained gives the source's tensors bit for bit and its config; trained
10 steps there and exported, it loads in ``transformers``, whose loss on held-out tokens equals the
job's own evaluation (and whose logits equal hetero's import of the export); a GPT trained from scratch
at tp2 exports as a Llama that ``transformers`` loads, with the same loss. ``hetero convert`` of a
checkpoint writes what the job exports, an import with its source's config and side files unchanged."""

import json

import torch
import transformers
from test_hf_import import CASES, SIZES, imported, saved
from tokenizers import Tokenizer, models
from torch.distributed.tensor import DTensor

from hetero.interop.hf_checkpoint import HFCheckpoint
from hetero.interop.hf_export import export_hf
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.hf import gpt_config
from hetero.models.gpt.hf_export_config import rope_context
from hetero.testing.kinds import build_runtime
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks

SEQ = 40


def batch(seed: int, rows: int = 4) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, SIZES["vocab_size"], (rows, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"tokens": tokens, "labels": torch.cat([tokens[:, 1:], torch.full((rows, 1), -100)], dim=1)}


def transformers_loss(path, data) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(data["tokens"]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), data["labels"].flatten(), ignore_index=-100).item()


def job(rank, world_size, model, layout, init, steps, out):
    block = module("gpt", model, layout, {"lr": 1e-2}, **({"init": {"hf": str(init)}} if init else {}))
    runtime = build_runtime(experiment(world_size, {"llm": block}, global_batch=4,
                                       microbatches=2 if layout.get("pp", 1) > 1 else 1))
    for step in range(steps):
        runtime.train_step(batch(100 + step))
    export_hf(runtime, "llm", out)
    return runtime.evaluate([batch(7)])["llm.loss"]


def test_an_untrained_import_exports_bit_for_bit(tmp_path):
    source = tmp_path / "source"
    saved(source, *CASES["qwen2: biases on q, k, v, yarn scaling, sharded files"], shard=True)
    run_ranks(job, 4, {"seq_len": SEQ}, {"tp": 2, "pp": 2, "dp": 1}, source, 0, tmp_path / "out")
    original, exported = HFCheckpoint(source), HFCheckpoint(tmp_path / "out")
    assert exported.config == json.loads((source / "config.json").read_text())
    assert sorted(exported.names()) == sorted(original.names())
    assert len(set(exported.files.values())) == 2  # one file per pipeline stage
    for name in original.names():
        a, b = original.tensor(name), exported.tensor(name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_a_model_trained_at_tp2_pp2_loads_in_transformers(tmp_path):
    source = tmp_path / "source"
    saved(source, *CASES["qwen2: biases on q, k, v, yarn scaling, sharded files"], shard=True)
    losses = run_ranks(job, 4, {"seq_len": SEQ}, {"tp": 2, "pp": 2, "dp": 1}, source, 10, tmp_path / "out")
    expected = transformers_loss(tmp_path / "out", batch(7))
    original, exported = HFCheckpoint(source), HFCheckpoint(tmp_path / "out")
    assert all(not torch.equal(original.tensor(n), exported.tensor(n)) for n in original.names())  # all trained
    for loss in losses:
        assert abs(loss - expected) / expected < 1e-5, (loss, expected)
    ours = imported(tmp_path / "out")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs, mine = reference(batch(8)["tokens"]).logits, ours.eval()(batch(8)["tokens"])
    assert ((mine - theirs).abs().max() / theirs.abs().max()).item() < 1e-5


def test_a_gpt_trained_from_scratch_exports_as_a_llama(tmp_path):
    model = {"vocab_size": SIZES["vocab_size"], "hidden_size": 32, "num_layers": 2, "num_heads": 4,
             "num_kv_heads": 2, "ffn_hidden_size": 48, "seq_len": SEQ, "tie_embeddings": True}
    losses = run_ranks(job, 2, model, {"tp": 2, "dp": 1}, None, 3, tmp_path / "out")
    assert HFCheckpoint(tmp_path / "out").config["architectures"] == ["LlamaForCausalLM"]
    expected = transformers_loss(tmp_path / "out", batch(7))
    for loss in losses:
        assert abs(loss - expected) / expected < 1e-5, (loss, expected)


def checkpointed(rank, world_size, model, init, checkpoints, out):
    """A tp2 job (from ``init.hf`` when ``init`` is given) trained 3 steps and checkpointed as ``hetero train``
    does, then exported live to ``out``; its logits on batch 8."""
    from hetero.config import CheckpointConfig
    from hetero.interop.hf_source import imported_sources
    from hetero.train.checkpoint import Checkpointer
    from hetero.train.job import run_identity

    block = module("gpt", model, {"tp": 2, "dp": 1}, {"lr": 1e-2}, **({"init": {"hf": str(init)}} if init else {}))
    config = experiment(world_size, {"llm": block}, global_batch=4, microbatches=1)
    runtime = build_runtime(config)
    for step in range(3):
        runtime.train_step(batch(100 + step))
    saver = Checkpointer(CheckpointConfig(every=1), checkpoints, run_identity(config, runtime.graph),
                         imported_sources(runtime.graph))
    saver.save(runtime, 3)
    saver.close()
    export_hf(runtime, "llm", out)
    with torch.no_grad():
        logits = runtime.modules["llm"].model.eval()(batch(8)["tokens"])
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def converted_as_live(tmp_path, module: str = "llm") -> HFCheckpoint:
    """``hetero convert`` of the checkpoint ``checkpointed`` wrote, checked to hold the tensors the job
    itself exported, bit for bit, and the same config."""
    from hetero.cli import main

    main(["convert", str(tmp_path / "checkpoints" / "step_000003"), str(tmp_path / "converted"),
          "--module", module])
    live, converted = HFCheckpoint(tmp_path / "live"), HFCheckpoint(tmp_path / "converted")
    assert converted.config == live.config
    assert sorted(converted.names()) == sorted(live.names())
    for name in live.names():
        a, b = live.tensor(name), converted.tensor(name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    return converted


def test_hetero_convert_writes_what_the_job_exports(tmp_path, capsys):
    """A tp2 job's checkpoint converted offline (``hetero convert``, one process) holds the tensors the
    job itself exports, bit for bit, and the same config; trained from scratch at seq_len 40 with yarn
    scaling of 16 positions by 4, it advertises the 64 positions of its RoPE settings (8192 unscaled, the
    default original context) and states the trained length apart, which ``transformers`` loads and hetero
    imports at."""
    from hetero.cli import main

    model = {"vocab_size": SIZES["vocab_size"], "hidden_size": 32, "num_layers": 2, "num_heads": 4,
             "num_kv_heads": 2, "ffn_hidden_size": 48, "seq_len": SEQ, "qkv_bias": True,
             "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position": 16}}
    run_ranks(checkpointed, 2, model, None, tmp_path / "checkpoints", tmp_path / "live")
    converted = converted_as_live(tmp_path)
    assert converted.config["architectures"] == ["Qwen2ForCausalLM"]
    assert (converted.config["max_position_embeddings"], converted.config["hetero_seq_len"]) == (64, SEQ)
    assert rope_context(GPTConfig(seq_len=SEQ)) == 8192 and gpt_config(converted.config).seq_len == SEQ
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "converted", dtype=torch.float32)
    assert loaded.config.max_position_embeddings == 64 and loaded.config.hetero_seq_len == SEQ
    assert main(["convert", str(tmp_path / "live"), str(tmp_path / "back")]) == 2
    assert "is a Hugging Face checkpoint, which needs no conversion: hetero reads it directly under any layout " \
           f"with llm.init.hf={tmp_path / 'live'}" in capsys.readouterr().err


def test_hetero_convert_writes_the_imported_config(tmp_path):
    """A Qwen2 of 256 positions with sliding-window fields (a window its 40-token rows do not reach),
    imported at seq_len 40, trained 3 steps at tp2 and checkpointed: ``hetero convert`` writes its source's
    config.json, generation config and tokenizer byte for byte (not 40 positions, no field dropped), and
    ``transformers``' logits on the converted checkpoint equal the trained job's."""
    source = tmp_path / "source"
    saved(source, "Qwen2Config", "Qwen2ForCausalLM",
          dict(num_key_value_heads=2, max_position_embeddings=256, use_sliding_window=True, sliding_window=64,
               max_window_layers=2, mlp_bias=False, pretraining_tp=1))
    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]")).save(str(source / "tokenizer.json"))
    original = json.loads((source / "config.json").read_text())
    assert original["layer_types"] == ["full_attention"] * 2 and original["sliding_window"] == 64
    logits = run_ranks(checkpointed, 2, {"seq_len": SEQ}, source, tmp_path / "checkpoints", tmp_path / "live")
    converted = converted_as_live(tmp_path)
    assert converted.config == original
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (tmp_path / "converted" / name).read_bytes() == (source / name).read_bytes(), name
    trained = HFCheckpoint(source)
    assert all(not torch.equal(trained.tensor(n), converted.tensor(n)) for n in trained.names())
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "converted", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reference(batch(8)["tokens"]).logits
    error = max((mine - theirs).abs().max().item() for mine in logits)
    print(f"\nconverted import: transformers vs the trained job, max |logit difference| {error:.1e} "
          f"(largest logit {theirs.abs().max().item():.2f})")
    assert torch.equal(logits[0], logits[1]) and error / theirs.abs().max().item() < 1e-5


def tower_checkpointed(rank, world_size, source, checkpoints, out):
    """A CLIP tower imported with features from layer -2 beside a small LLM, one step on one rank,
    checkpointed and exported live to ``out``."""
    from hetero.config import CheckpointConfig
    from hetero.interop.hf_source import imported_sources
    from hetero.train.checkpoint import Checkpointer
    from hetero.train.job import run_identity
    from test_hf_vision import images

    llm = {"vocab_size": SIZES["vocab_size"], "hidden_size": 32, "num_layers": 1, "num_heads": 4, "seq_len": 24}
    config = experiment(world_size, {"vision": module("vit", {"feature_layer": -2}, {"dp": 1}, {"lr": 1e-2},
                                                      init={"hf": str(source)}),
                                     "llm": module("gpt", llm, {"dp": 1}, {"lr": 1e-2})},
                        edges=[("vision", "llm")], global_batch=2, microbatches=1)
    runtime = build_runtime(config)
    tokens = torch.randint(0, SIZES["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    runtime.train_step({"images": images(2), "tokens": tokens, "labels": tokens})
    saver = Checkpointer(CheckpointConfig(every=1), checkpoints, run_identity(config, runtime.graph),
                         imported_sources(runtime.graph))
    saver.save(runtime, 3)
    saver.close()
    export_hf(runtime, "vision", out)


def test_hetero_convert_of_an_imported_tower_copies_what_it_passes_over(tmp_path):
    """A CLIP tower imported for its layer -2 features, trained and checkpointed: ``hetero convert`` writes
    the job's export, its last block and post_layernorm (passed over, kept with the checkpoint) the
    source's, bit for bit."""
    from test_hf_vision import saved as saved_tower

    saved_tower(tmp_path / "source", "clip vision, layer -2 (LLaVA-style)")
    run_ranks(tower_checkpointed, 1, tmp_path / "source", tmp_path / "checkpoints", tmp_path / "live")
    converted, source = converted_as_live(tmp_path, "vision"), HFCheckpoint(tmp_path / "source")
    kept = [n for n in source.names() if n.startswith(("encoder.layers.2.", "post_layernorm."))]
    assert len(kept) == 18 and all(torch.equal(source.tensor(n), converted.tensor(n)) for n in kept)
    trained = "encoder.layers.0.mlp.fc1.weight"
    assert not torch.equal(source.tensor(trained), converted.tensor(trained))
