"""The torchrun path: groups built from the launcher's environment, and a wrong launch size refused."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun(nproc, *args):
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
         "--standalone", str(ROOT / "launch" / "check_groups.py"), *args],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
    )


def test_torchrun_builds_and_verifies_every_group():
    done = torchrun(4, "experiment=colocated_vlm")
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(4):
        assert f"rank {rank}: vision, llm: ok" in done.stdout


def test_torchrun_with_the_wrong_world_size_fails_before_any_group():
    done = torchrun(2, "experiment=colocated_vlm")
    assert done.returncode != 0
    assert "needs world_size=4 ranks but the launcher started 2" in done.stderr
