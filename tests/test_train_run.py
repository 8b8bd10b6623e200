"""The training job end to end under torchrun: shards written on first use, progress lines, held-out
accuracy, a summary, and a wandb offline run directory with the logged metrics."""

import subprocess
import sys
from pathlib import Path


def test_hetero_train_runs_the_colocated_vlm(tmp_path):
    overrides = [
        "train.steps=4", "train.log_every=2", "train.eval_every=0",
        f"train.data_dir={tmp_path / 'digits'}", f"train.run_dir={tmp_path / 'runs'}",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "hetero.cli", "train", "colocated_vlm", *overrides],
        capture_output=True, text=True, timeout=400, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "--nproc_per_node=4" in out
    assert "step     2 | loss" in out and "step     4 | loss" in out
    assert "boundary.vision->llm.cross=" in out and "grad_sync.llm=" in out
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
