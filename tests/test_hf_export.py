"""Hetero modules written back as Hugging Face checkpoints from any layout (``hetero/interop/hf_export.py``):
an import at tp2·pp2 exported untrained gives the source's tensors bit for bit and its config; trained
10 steps there and exported, it loads in ``transformers``, whose loss on held-out tokens equals the
job's own evaluation (and whose logits equal hetero's import of the export); a GPT trained from scratch
at tp2 exports as a Llama that ``transformers`` loads, with the same loss."""

import json

import torch
import transformers
from test_hf_import import CASES, SIZES, imported, saved

from hetero.interop.hf_checkpoint import HFCheckpoint
from hetero.interop.hf_export import export_hf
from hetero.runtime import build_runtime
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


def checkpointed(rank, world_size, model, out, checkpoints):
    from hetero.config import CheckpointConfig
    from hetero.train.checkpoint import Checkpointer
    from hetero.train.job import run_identity

    config = experiment(world_size, {"llm": module("gpt", model, {"tp": 2, "dp": 1}, {"lr": 1e-2})},
                        global_batch=4, microbatches=1)
    runtime = build_runtime(config)
    for step in range(3):
        runtime.train_step(batch(100 + step))
    saver = Checkpointer(CheckpointConfig(every=1), checkpoints, run_identity(config, runtime.graph))
    saver.save(runtime, 3)
    saver.close()
    export_hf(runtime, "llm", out)


def test_hetero_convert_writes_what_the_job_exports(tmp_path, capsys):
    """A tp2 job's checkpoint converted offline (``hetero convert``, one process) holds the tensors the
    job itself exports, bit for bit, and the same config."""
    from hetero.cli import main

    model = {"vocab_size": SIZES["vocab_size"], "hidden_size": 32, "num_layers": 2, "num_heads": 4,
             "num_kv_heads": 2, "ffn_hidden_size": 48, "seq_len": SEQ, "qkv_bias": True}
    run_ranks(checkpointed, 2, model, tmp_path / "live", tmp_path / "checkpoints")
    main(["convert", str(tmp_path / "checkpoints" / "step_000003"), str(tmp_path / "converted")])
    live, converted = HFCheckpoint(tmp_path / "live"), HFCheckpoint(tmp_path / "converted")
    assert converted.config == live.config and converted.config["architectures"] == ["Qwen2ForCausalLM"]
    assert sorted(converted.names()) == sorted(live.names())
    for name in live.names():
        assert torch.equal(live.tensor(name), converted.tensor(name)), name
    assert main(["convert", str(tmp_path / "live"), str(tmp_path / "back")]) == 2
    assert "is a Hugging Face checkpoint, which needs no conversion: hetero reads it directly under any layout " \
           f"with llm.init.hf={tmp_path / 'live'}" in capsys.readouterr().err
