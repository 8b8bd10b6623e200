"""hetero bench throughput: one 2-rank run of a tiny colocated VLM (figures consistent with each other,
model FLOPs against closed forms written here, boundary bytes against the activation size, JSON and the
wandb offline run), the scaled overrides of weak/strong sweeps, and the refusals."""

import json
import statistics
import time

import pytest

from hetero.bench.throughput import scaled_overrides
from hetero.cli import main
from hetero.config import load_experiment
from hetero.testing.kinds import build_graph
from hetero.errors import ConfigError

# colocated_vlm on 2 ranks: vision dp2, the LLM tp2 on both ranks; one microbatch of 8 per step.
TWO_RANKS = ["world_size=2", "vision.layout.dp=2", "llm.layout.tp=2", "llm.layout.dp=1", "batch.global_batch_size=8",
             "batch.micro_batch_size=8", "vision.micro_batch_size=4"]


def gpt_training_flops(batch, seq, layers, hidden, vocab):
    """Megatron's closed form for a GPT with full multi-head attention and a SwiGLU MLP of width 4h:
    per layer and token 8h² (QKV, out) + 24h² (gate, up, down) + 4sh (scores, values), logits 2hV;
    training is 3x forward: 96·B·s·L·h²·(1 + s/(8h) + V/(16·L·h))."""
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (8 * hidden) + vocab / (16 * layers * hidden))


def vit_training_flops(batch, patches, patch_dim, blocks, hidden, out, handed_on):
    """Patch embedding, ``blocks`` pre-norm blocks over patches + class token (24h² per token for QKV, out
    and a 4h GELU MLP, 4·S·h for attention), the two-layer projector over the ``handed_on`` tokens; 3x
    forward."""
    tokens = patches + 1
    forward = (2 * patches * patch_dim * hidden + blocks * (24 * tokens * hidden**2 + 4 * tokens**2 * hidden)
               + 2 * handed_on * (hidden * out + out * out))
    return 3 * batch * forward


def test_a_two_rank_run_reports_consistent_figures(tmp_path, capsys):
    out_json = tmp_path / "throughput.json"
    status = main([
        "bench", "throughput", "colocated_vlm", *TWO_RANKS,
        f"train.data_dir={tmp_path / 'digits'}", f"train.run_dir={tmp_path / 'runs'}",
        "--steps", "2", "--warmup", "1", "--peak-tflops", "0.5", "--json", str(out_json), "--wandb",
    ])
    printed = capsys.readouterr().out
    assert status == 0, printed
    [run] = json.loads(out_json.read_text())
    assert run["config"] == "colocated_vlm" and run["overrides"][:len(TWO_RANKS)] == TWO_RANKS
    assert run["world_size"] == 2
    assert run["layouts"]["llm"] == {"tp": 2, "cp": 1, "dp": 1, "pp": 1, "ranks": [0, 1]}
    assert run["layouts"]["vision"] == {"tp": 1, "cp": 1, "dp": 2, "pp": 1, "ranks": [0, 1]}

    batch, seq = 8, 40
    step_s = run["step_s"]
    assert len(run["step_s_per_step"]) == 2 and step_s == pytest.approx(statistics.median(run["step_s_per_step"]))
    assert run["tokens_per_step"] == batch * seq
    assert run["tokens_per_s"] == pytest.approx(batch * seq / step_s, rel=1e-9)
    assert run["samples_per_s"] == pytest.approx(batch / step_s, rel=1e-9)

    flops = run["model_flops_per_step"]
    # llm: vocab 256, h 64, 2 layers, 4 heads, seq 40; vision: 32x32 images of 16x16 patches (4), 1 channel,
    # h 64, 2 layers (features of the last), out 64; the class token's features cross too (class_feature).
    assert flops["llm"] == pytest.approx(gpt_training_flops(batch, seq, layers=2, hidden=64, vocab=256), rel=1e-12)
    assert flops["vision"] == pytest.approx(
        vit_training_flops(batch, patches=4, patch_dim=256, blocks=2, hidden=64, out=64, handed_on=5), rel=1e-12
    )
    assert flops["total"] == pytest.approx(flops["llm"] + flops["vision"], rel=1e-12)
    tflops = flops["total"] / step_s / 2 / 1e12
    assert run["tflops_per_s_per_rank"] == pytest.approx(tflops, rel=1e-9)
    assert run["peak_tflops_per_rank"] == 0.5
    assert run["mfu"] == pytest.approx(tflops / 0.5, rel=1e-9)

    comm = run["bytes_per_step"]
    # Each LLM rank (tp2) needs all 8 rows; it holds its own 4 from the colocated vision replica (a local
    # copy) and receives the other 4: 2 ranks x 4 rows x 5 tokens (4 patches, the class token) x 64 floats x
    # 4 bytes = 8 x 5 x 64 x 4.
    activation_bytes = batch * 5 * 64 * 4
    assert comm["boundary.vision->llm.forward"] == activation_bytes
    assert comm["boundary.vision->llm.backward"] == activation_bytes  # the gradient of the same rows goes back
    assert "pipeline.llm.forward" not in comm and "pipeline.llm.backward" not in comm  # pp1: no stage links
    assert comm["grad_sync.vision"] > 0 and comm["grad_sync.llm"] == 0  # dp2 / dp1
    # The LLM's tensor parallelism: DTensor's all-reduces, on its tp group only.
    assert list(run["dtensor_collectives_per_step"]) == ["dtensor.llm.tp"]
    reduces = run["dtensor_collectives_per_step"]["dtensor.llm.tp"]["all_reduce"]
    assert comm["dtensor.llm.tp"] == reduces["bytes"]
    # At least the row-parallel outputs (attention out, MLP down) in forward and the column-parallel input
    # gradients in backward, per layer, each a microbatch's activations (8 x 40 x 64 floats) all-reduced
    # over tp2, i.e. 2·(2-1)/2 x its size on the wire from each of the 2 ranks.
    activation = batch * seq * 64 * 4
    assert reduces["calls"] >= 2 * 2 * 2 * 2 and reduces["bytes"] >= 2 * 2 * 2 * 2 * activation

    assert "tokens/s" in printed and "MFU" in printed and "boundary.vision->llm.forward" in printed
    runs = list((tmp_path / "runs" / "colocated_vlm" / "bench-throughput" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and runs[0].is_dir()
    [records] = runs[0].glob("run-*.wandb")  # offline: history and summary as records in this file
    # wandb's service process may still be writing the file when finish() returns (seen once, under load)
    deadline = time.monotonic() + 30
    while b"model_flops_per_step/llm" not in records.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert b"tokens_per_s" in records.read_bytes() and b"model_flops_per_step/llm" in records.read_bytes()


def test_scaled_overrides_for_weak_and_strong_scaling():
    experiment = load_experiment("colocated_vlm")  # world 4: vision dp4, llm tp2·dp2, batch 44
    assert scaled_overrides(experiment, 2, "strong") == [
        "++world_size=8", "++vision.layout.dp=8", "++llm.layout.dp=4",
    ]
    assert scaled_overrides(experiment, 2, "weak") == [
        "++world_size=8", "++vision.layout.dp=8", "++llm.layout.dp=4", "++batch.global_batch_size=88",
    ]
    dna = load_experiment("dna_vlm")  # vision dp2 on 0-1, dna dp2 at offset 2, llm tp2·dp2 on 0-3
    overrides = scaled_overrides(dna, 2, "weak")
    assert "++dna.layout.offset=4" in overrides and "++dna.layout.dp=4" in overrides
    placement = build_graph(load_experiment("dna_vlm", overrides)).placement
    assert placement.world_size == 8
    assert placement.layouts["vision"].ranks == (0, 1, 2, 3)
    assert placement.layouts["dna"].ranks == (4, 5, 6, 7)
    assert placement.layouts["llm"].dp == 4 and placement.layouts["llm"].tp == 2


def test_an_explicit_rank_list_cannot_be_scaled(capsys):
    experiment = load_experiment("colocated_vlm", ["vision.layout.ranks=[0,1,2,3]"])
    with pytest.raises(ConfigError, match="vision.layout.ranks.*offset"):
        scaled_overrides(experiment, 2, "weak")
    status = main(["bench", "throughput", "colocated_vlm", "vision.layout.ranks=[0,1,2,3]", "--scaling", "strong"])
    assert status == 2 and "layout.offset" in capsys.readouterr().err


def test_only_vision_language_experiments_are_supported(capsys):
    assert main(["bench", "throughput", "genezip"]) == 2
    err = capsys.readouterr().err
    assert "vision-language experiments only" in err and "dna (genezip)" in err


def test_under_torchrun_every_process_is_a_rank_and_the_experiment_scales_to_the_world(tmp_path):
    """launch/bench.py as slurm/bench.sbatch starts it: a one-rank base scaled (weak) to torchrun's 2 ranks."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out_json = tmp_path / "bench.json"
    one_rank = ["world_size=1", "vision.layout.dp=1", "llm.layout.tp=1", "llm.layout.dp=1",
                "batch.global_batch_size=8", "batch.micro_batch_size=8", "vision.micro_batch_size=8"]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(root / "launch" / "bench.py"), "colocated_vlm", *one_rank,
        f"train.data_dir={tmp_path / 'digits'}", f"train.run_dir={tmp_path / 'runs'}",
        "--scaling", "weak", "--steps", "1", "--warmup", "0", "--json", str(out_json),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    [run] = json.loads(out_json.read_text())  # written once, by rank 0
    assert run["world_size"] == 2 and run["scale"] == 2 and run["global_batch_size"] == 16
    assert run["layouts"]["llm"]["dp"] == 2 and run["bytes_per_step"]["grad_sync.llm"] > 0
    assert done.stdout.count("tokens/s") == 1



def test_under_torchrun_a_world_that_does_not_match_is_refused_before_joining(monkeypatch, capsys):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "2")
    one_rank = ["world_size=1", "vision.layout.dp=1", "llm.layout.tp=1", "llm.layout.dp=1",
                "batch.global_batch_size=8", "batch.micro_batch_size=8", "vision.micro_batch_size=8"]
    assert main(["bench", "throughput", "colocated_vlm", *one_rank, "--steps", "1"]) == 2
    assert "torchrun started 2 ranks but colocated_vlm runs on world_size=1; pass --scaling" in capsys.readouterr().err


def test_gpu_peaks_are_looked_up_by_the_name_cuda_reports():
    from hetero.bench.device_peaks import dense_bf16_peak_tflops

    names = {"NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA A100 80GB PCIe": 312.0, "NVIDIA H100 80GB HBM3": 989.0,
             "NVIDIA H100 PCIe": 756.0, "NVIDIA H100 NVL": 835.0, "NVIDIA H200": 989.0, "NVIDIA H200 NVL": 835.0,
             "NVIDIA B200": 2250.0, "Tesla T4": None}
    assert {name: dense_bf16_peak_tflops(name) for name in names} == names
    from hetero.bench.device_peaks import hbm_bandwidth_gbs

    bandwidths = {"NVIDIA A100-SXM4-80GB": 2039.0, "NVIDIA A100 80GB PCIe": 1935.0, "NVIDIA A100-SXM4-40GB": 1555.0,
                  "NVIDIA H100 80GB HBM3": 3350.0, "NVIDIA H100 PCIe": 2000.0, "NVIDIA H100 NVL": 3900.0,
                  "NVIDIA H200": 4800.0, "NVIDIA B200": 8000.0, "Tesla T4": None}
    assert {name: hbm_bandwidth_gbs(name) for name in bandwidths} == bandwidths
