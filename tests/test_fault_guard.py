"""FaultGuard under torchrun: a rank that raises is named by every rank with its error, and a step that
hangs ends the job after the timeout; either way every rank exits non-zero within seconds."""

import subprocess
import sys
import time

SCRIPT = """
import os, sys, time
from datetime import timedelta
import torch.distributed as dist
from hetero.parallel.layout import LayoutSpec
from hetero.parallel.placement import place
from hetero.train.faults import FaultGuard

fault = sys.argv[1]
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
guard = FaultGuard(place({"llm": LayoutSpec(tp=2)}, 2), timeout_s=3)
with guard.running():
    dist.barrier()
    with guard.step("step 3"):
        if dist.get_rank() == 1:
            if fault == "raise":
                raise ValueError("batch 17 has no labels")
            time.sleep(600)  # hangs without dying
        dist.barrier()
"""


def launch(tmp_path, fault):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), fault],
        capture_output=True, text=True, timeout=120,
    )
    return done, time.monotonic() - started


def test_a_raising_rank_is_named_with_its_error_by_every_rank(tmp_path):
    done, seconds = launch(tmp_path, "raise")
    assert done.returncode != 0 and seconds < 60
    assert "hetero: rank 1 (llm tp1) failed in step 3: ValueError: batch 17 has no labels" in done.stderr
    assert "hetero: the failure started at rank 1 (llm tp1): ValueError: batch 17 has no labels" in done.stderr


def test_a_hanging_step_ends_the_job_after_the_timeout(tmp_path):
    done, seconds = launch(tmp_path, "hang")
    assert done.returncode != 0 and seconds < 60
    assert "failed in step 3: step 3 did not finish within timeout_s=3 s" in done.stderr
