"""Failures end the job cleanly and lose no more than the work since the last checkpoint.

- A rank killed with SIGKILL mid-step: every rank exits non-zero within 60 s, the report names the dead
  rank and its modules, and under ``--max-restarts`` torchrun restarts the ranks, which verify and load
  the newest checkpoint and continue from it on their own.
- A checkpoint save killed midway leaves the previous checkpoint intact; the next run resumes from it
  (here the lone GeneZip job on one process, so its own training loop's resume is covered too).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from hetero.config import load_experiment
from hetero.testing.experiments import MAIN_JOB_SMALL_BATCH
from hetero.testing.kinds import build_graph
from hetero.train.checkpoint import check_resumable
from hetero.train.checkpoint_files import complete_checkpoints
from hetero.train.job import run_identity

STEPS = [*MAIN_JOB_SMALL_BATCH, "train.steps=12", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "train.wandb=disabled",
         "train.checkpoint.every=3", "train.checkpoint.keep=3"]


def start(tmp_path, max_restarts):
    overrides = [*STEPS, f"train.data_dir={tmp_path / 'digits'}", f"train.run_dir={tmp_path / 'runs'}"]
    return subprocess.Popen(
        [sys.executable, "-m", "hetero.cli", "train", f"--max-restarts={max_restarts}", "colocated_vlm", *overrides],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )


def metrics(tmp_path) -> list[dict]:
    path = tmp_path / "runs" / "colocated_vlm" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [row for row in rows if "loss" in row]  # the steps' records


def wait_for_rows(tmp_path, count, process, timeout_s=300):
    deadline = time.monotonic() + timeout_s
    while len(metrics(tmp_path)) < count:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"no {count} logged steps within {timeout_s} s"
        time.sleep(0.1)


def workers(tmp_path) -> dict[int, int]:
    """Global rank -> pid of this test's training processes, read from /proc."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            if b"hetero.train.run" in cmdline and any(str(tmp_path).encode() in arg for arg in cmdline):
                env = dict(item.split(b"=", 1) for item in (proc / "environ").read_bytes().split(b"\0") if b"=" in item)
                found[int(env[b"RANK"])] = int(proc.name)
        except (OSError, KeyError, ValueError):
            continue
    return found


def test_a_killed_rank_ends_every_rank_and_the_restart_resumes(tmp_path):
    """torchrun --max-restarts=1: SIGKILL one rank mid-step; every rank of that attempt reports and exits
    (non-zero) within 60 s; torchrun restarts them, and they resume from the newest checkpoint on their own."""
    job = start(tmp_path, max_restarts=1)
    wait_for_rows(tmp_path, 5, job)  # step 3's checkpoint is written
    first = workers(tmp_path)
    assert sorted(first) == [0, 1, 2, 3]
    newest = complete_checkpoints(tmp_path / "runs" / "colocated_vlm" / "checkpoints")[-1]
    os.kill(first[2], signal.SIGKILL)
    killed = time.monotonic()
    while any(Path(f"/proc/{pid}").exists() for pid in first.values()):
        assert time.monotonic() - killed < 60, "ranks of the failed attempt still run 60 s after the SIGKILL"
        time.sleep(0.1)
    print(f"every rank of the attempt gone {time.monotonic() - killed:.1f} s after the SIGKILL")
    out, err = job.communicate(timeout=300)
    assert job.returncode == 0, err[-3000:]

    # Each survivor ran FaultGuard's exit (a report, then exit code 1) naming the dead rank and its modules.
    for rank in (0, 1, 3):
        assert f"hetero: rank {rank} (" in err and "failed" in err
    assert err.count("hetero: rank 2 (vision dp2; llm tp0 dp1) stopped responding (its process died or hangs)") >= 1
    # The restart verified the newest checkpoint (a newer one may have been committed before the kill
    # landed), resumed from it, and trained to the end, saving and pruning as it went.
    (resumed,) = [line for line in out.splitlines() if line.startswith("resumed from")]
    step = int(resumed.split("step_")[1][:6])
    assert step >= int(newest.name[5:]) and resumed.endswith(f"at step {step}")
    assert "summary: steps 12" in out
    experiment = load_experiment("colocated_vlm", STEPS)
    final = complete_checkpoints(tmp_path / "runs" / "colocated_vlm" / "checkpoints")
    assert [p.name for p in final] == ["step_000006", "step_000009", "step_000012"]
    check_resumable(final[-1], run_identity(experiment, build_graph(experiment)))
    # Steps that ran twice (before the kill, again after the resume) logged identical losses.
    seen: dict[int, float] = {}
    for row in metrics(tmp_path):
        assert seen.setdefault(row["step"], row["loss"]) == row["loss"], row["step"]
    assert sorted(seen) == list(range(1, 13))


# The lone GeneZip job on one process (its own loop, the same checkpoints): small windows, few steps.
ONE_RANK = ["world_size=1", "dna.layout.tp=1", "dna.model.seq_len=256", "batch.global_batch_size=4",
            "batch.micro_batch_size=4", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1",
            "train.wandb=disabled",
            "train.checkpoint.every=2"]

KILL_IN_SECOND_SAVE = """
import os, signal, sys
from torch.distributed.checkpoint import FileSystemWriter
from hetero.train.run import main

write_metadata = FileSystemWriter.finish
def killed_midway(self, *args, **kwargs):  # the step-4 save: its data files are written, nothing else
    if ".step_000004" in str(self.path):
        os.kill(os.getpid(), signal.SIGKILL)
    return write_metadata(self, *args, **kwargs)
FileSystemWriter.finish = killed_midway
main(sys.argv[1:])
"""


def one_rank(tmp_path, code, *overrides):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)}
    paths = [f"train.genome_dir={tmp_path / 'genome'}", f"train.run_dir={tmp_path / 'runs'}"]
    return subprocess.run([sys.executable, "-c", code, "experiment=genezip", *ONE_RANK, *overrides, *paths],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)


def test_a_save_killed_midway_keeps_the_previous_checkpoint(tmp_path):
    root = tmp_path / "runs" / "genezip" / "checkpoints"
    done = one_rank(tmp_path, KILL_IN_SECOND_SAVE, "train.steps=6")
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert [p.name for p in complete_checkpoints(root)] == ["step_000002"]
    partial = root / ".step_000004.partial"
    assert (partial / "__0_0.distcp").is_file() and not (partial / ".metadata").exists()

    done = one_rank(tmp_path, "from hetero.train.run import main; import sys; main(sys.argv[1:])", "train.steps=6")
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resumed from {root / 'step_000002'} at step 2" in done.stdout
    assert "summary: steps 6" in done.stdout
    assert sorted(p.name for p in root.iterdir()) == ["step_000004", "step_000006"]  # the partial is gone
