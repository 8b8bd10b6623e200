"""The training job end to end under torchrun: shards written on first use, progress lines, held-out
accuracy, a summary, and a wandb offline run directory with the logged metrics."""

import subprocess
import sys


def hetero_train(tmp_path, experiment, *overrides, data="digits"):
    """``hetero train experiment`` in ``tmp_path`` with data and runs under it; the finished process."""
    paths = [f"train.data_dir={tmp_path / data}", f"train.run_dir={tmp_path / 'runs'}"]
    done = subprocess.run(
        [sys.executable, "-m", "hetero.cli", "train", experiment, *overrides, *paths],
        capture_output=True, text=True, timeout=400, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_hetero_train_runs_the_colocated_vlm(tmp_path):
    done = hetero_train(tmp_path, "colocated_vlm", "train.steps=4", "train.log_every=2", "train.eval_every=0")
    out = done.stdout
    assert "--nproc_per_node=4" in out
    assert "step     2 | loss" in out and "step     4 | loss" in out
    assert "boundary.vision->llm.forward=" in out and "grad_sync.llm=" in out
    assert "held-out digit accuracy" in out
    assert "summary: steps 4" in out
    runs = list((tmp_path / "runs" / "colocated_vlm" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb"))  # the offline run's log file
    assert (tmp_path / "digits" / "manifest.json").is_file()


def test_hetero_train_refuses_a_bad_override_before_starting(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "hetero.cli", "train", "colocated_vlm", "llm.layout.tp=3"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert done.returncode == 2
    assert "llm.layout" in done.stderr


def test_hetero_train_runs_a_compression_policy_per_module(tmp_path):
    """compressed_vlm: int8 + error feedback for the encoder, DiLoCo with int4 pseudo-gradients for the LLM
    (here H=2, so rounds happen within the 4 steps, on the LLM's tp2·dp2 DTensor shards)."""
    done = hetero_train(tmp_path, "compressed_vlm", "train.steps=4", "train.log_every=2", "train.eval_every=0",
                        "train.wandb=disabled", "llm.compression.diloco.inner_steps=2")
    lines = [line for line in done.stdout.splitlines() if line.startswith("step     4 | loss")]
    assert len(lines) == 1
    assert "ef_residual.vision=" in lines[0]  # int8 with error feedback keeps a residual
    assert "grad_sync.vision=" in lines[0] and "grad_sync.llm=" in lines[0]


def test_hetero_train_compresses_boundary_and_pipeline_traffic(tmp_path):
    """compressed_edges_vlm: 2-bit activations forward, 4-bit gradients back on the vision->llm boundary and
    the LLM's stage edge, with lazy sampling; the progress line shows each edge's bytes per direction and
    the error-compensation memory."""
    done = hetero_train(tmp_path, "compressed_edges_vlm", "train.steps=4", "train.log_every=4",
                        "train.eval_every=0", "train.wandb=disabled")
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("step     4 | loss")]
    for name in ("boundary.vision->llm.forward", "boundary.vision->llm.backward", "pipeline.llm.forward",
                 "pipeline.llm.backward", "ec_memory"):
        assert f"{name}=" in line, line


def test_hetero_train_runs_the_video_generator_with_a_learned_memory(tmp_path):
    """video: the generator under tp2 with the learned memory (router trained alongside); clip shards
    written on first use, progress lines, the held-out next-frame error on revisited and all frames."""
    done = hetero_train(tmp_path, "video", "train.steps=2", "train.log_every=1", "train.eval_every=0",
                        "train.wandb=disabled", data="clips")
    out = done.stdout
    assert "--nproc_per_node=2" in out
    assert "step     2 | loss" in out
    assert "held-out next-frame MSE: revisited" in out
    assert "summary: steps 2" in out
    assert (tmp_path / "clips" / "manifest.json").is_file()


def test_hetero_train_runs_genezip_under_tp2(tmp_path):
    """genezip: the DNA compressor alone under tp2, genome shards written on first use (per window)."""
    done = hetero_train(tmp_path, "genezip", "train.steps=3", "train.log_every=1", "train.eval_every=0",
                        f"train.genome_dir={tmp_path / 'genome'}", "dna.model.seq_len=256")
    out = done.stdout
    assert "--nproc_per_node=2" in out
    assert "step     3 | loss" in out and "ratio loss" in out
    assert "held-out" in out and "bits/base | bases per token: intergenic" in out
    assert (tmp_path / "genome" / "window256" / "manifest.json").is_file()


def test_hetero_train_feeds_dna_and_images_into_the_llm(tmp_path):
    """dna_vlm: vision dp2 and GeneZip dp2 on disjoint ranks, the LLM tp2·dp2 over all four."""
    done = hetero_train(tmp_path, "dna_vlm", "train.steps=2", "train.log_every=1", "train.eval_every=0",
                        f"train.genome_dir={tmp_path / 'genome'}")
    out = done.stdout
    assert "--nproc_per_node=4" in out
    assert "step     2 | loss" in out and "dna loss" in out
    assert "boundary.dna->llm.forward=" in out and "boundary.vision->llm.forward=" in out
    assert "grad_sync.dna=" in out
    assert "held-out digit accuracy" in out and "GC-bin accuracy" in out
