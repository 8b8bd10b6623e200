"""The training job end to end under torchrun for each kind of experiment: shards written on first use,
progress lines, held-out metrics and a summary. (The colocated VLM's run, with its wandb offline run, and
GeneZip's under tp2 are checked in test_checkpoint_resume.py, where they are also the runs that are resumed.)"""

import subprocess
import sys


def hetero_train(tmp_path, experiment, *overrides, data="digits"):
    """``hetero train experiment`` in ``tmp_path`` with data and runs under it; the finished process."""
    paths = [f"train.data_dir={tmp_path / data}", f"train.run_dir={tmp_path / 'runs'}", "train.eval_batches=1"]
    done = subprocess.run(
        [sys.executable, "-m", "hetero.cli", "train", experiment, *overrides, *paths],
        capture_output=True, text=True, timeout=400, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_hetero_train_refuses_a_bad_override_before_starting(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "hetero.cli", "train", "colocated_vlm", "llm.layout.tp=3"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert done.returncode == 2
    assert "llm.layout" in done.stderr


def test_hetero_train_runs_the_video_generator_with_a_learned_memory(tmp_path):
    """video: the generator under tp2 with the learned memory (router trained alongside); clip shards
    written on first use, progress lines, the held-out next-frame error on revisited and all frames."""
    done = hetero_train(tmp_path, "video", "train.steps=2", "train.log_every=1", "train.eval_every=0",
                        "train.wandb=disabled", f"train.clip_dir={tmp_path / 'clips'}")
    out = done.stdout
    assert "--nproc_per_node=2" in out
    assert "step     2 | loss" in out and "video loss" in out and "distill" in out
    (heldout,) = [line for line in out.splitlines() if line.startswith("step     2 | held-out")]
    assert "revisit mse" in heldout and "all mse" in heldout, heldout
    assert "summary: steps 2" in out
    assert len(list((tmp_path / "clips").glob("*/manifest.json"))) == 1  # one set, named by its options


def test_hetero_train_feeds_dna_and_images_into_the_llm(tmp_path):
    """dna_vlm: vision dp2 and GeneZip dp2 on disjoint ranks, the LLM tp2·dp2 over all four."""
    done = hetero_train(tmp_path, "dna_vlm", "train.steps=2", "train.log_every=1", "train.eval_every=0",
                        f"train.genome_dir={tmp_path / 'genome'}")
    out = done.stdout
    assert "--nproc_per_node=4" in out
    assert "step     2 | loss" in out and "dna loss" in out
    assert "boundary.dna->llm.forward=" in out and "boundary.vision->llm.forward=" in out
    assert "grad_sync.dna=" in out
    assert "digit accuracy" in out and "gc accuracy" in out


def test_hetero_train_runs_the_long_context_plan_shape(tmp_path):
    """long_context_vlm: the LLM tp2·cp2 over a 512-token fused sequence, vision dp4 on the same 4 ranks;
    training and the held-out digit accuracy run with the image embeddings delivered per CP rank."""
    done = hetero_train(tmp_path, "long_context_vlm", "train.steps=2", "train.log_every=1", "train.eval_every=2",
                        "train.wandb=disabled")
    out = done.stdout
    assert "--nproc_per_node=4" in out
    assert "step     2 | loss" in out and "boundary.vision->llm.forward=" in out
    (heldout,) = [line for line in out.splitlines() if line.startswith("step     2 | held-out")]
    assert "digit accuracy" in heldout, heldout
