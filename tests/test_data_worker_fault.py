"""A data worker (``train.data.workers``) killed mid-run: every rank exits within 60 s and the reports
name the dead worker. An image that only its own rank decodes (its header reads, its pixels do not):
every rank stops before the step, naming the image."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from hetero.data.example import write_llava


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    return found


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def blocked_sigchld() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})


def test_a_killed_data_worker_ends_every_rank_naming_it(tmp_path):
    """The job starts with SIGCHLD blocked, as the CI runner starts it: the mask outlives exec, and a rank
    that kept it would never run torch's handler for its dead worker."""
    data = write_llava(tmp_path / "llava", 300, seed=0)
    job = subprocess.Popen([sys.executable, "-m", "hetero.cli", "train", "own_data_vlm", f"train.data.path={data}",
                            "train.steps=1000", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1",
                            "train.wandb=disabled", "train.data.workers=1", f"train.run_dir={tmp_path / 'runs'}"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                           preexec_fn=blocked_sigchld)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # a rank's data worker: a child of a rank, under torchrun's agent
        agents = [p for p in children(job.pid) if "torch.distributed.run" in command(p)]
        ranks = [r for agent in agents for r in children(agent) if "hetero.train.run" in command(r)]
        workers = [w for rank in ranks for w in children(rank)]
        if len(ranks) == 4 and workers and (tmp_path / "runs" / "own_data_vlm" / "metrics.jsonl").exists():
            break
        time.sleep(0.5)
    victim = workers[0]
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    out, _ = job.communicate(timeout=120)
    print(f"\nthe job ended {time.monotonic() - killed:.1f} s after its data worker {victim} was killed")
    print("\n".join(line for line in out.splitlines() if line.startswith("hetero: ")))
    assert job.returncode != 0 and time.monotonic() - killed < 60
    reports = re.findall(r"^hetero: rank (\d) .*$\n?(?:hetero: the failure started at .*)?", out, flags=re.M)
    assert sorted(set(reports)) == ["0", "1", "2", "3"], out[-4000:]
    for rank in range(4):
        block = re.search(rf"^hetero: rank {rank} .*(?:\nhetero: the failure started at .*)?", out, flags=re.M).group(0)
        assert re.search(rf"DataLoader worker \(pid(\(s\))? {victim}\)", block), block


def test_an_image_only_its_rank_decodes_stops_every_rank_before_the_step(tmp_path):
    data = write_llava(tmp_path / "llava", 200, seed=0)
    image = tmp_path / "llava" / json.loads(data.read_text())[5]["image"]
    header = image.read_bytes()
    image.write_bytes(header[:60] + bytes(len(header) - 60))  # the size still reads; the pixels do not
    done = subprocess.run([sys.executable, "-m", "hetero.cli", "train", "own_data_vlm", f"train.data.path={data}",
                           "train.steps=20", "train.log_every=1", "train.wandb=disabled",
                           f"train.run_dir={tmp_path / 'runs'}"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    reports = [line for line in done.stdout.splitlines() + done.stderr.splitlines() if line.startswith("hetero: rank")]
    print("\n" + "\n".join(reports))
    assert done.returncode != 0 and len(reports) == 4, done.stdout[-3000:] + done.stderr[-3000:]
    for line in reports:  # "failed:", not "failed in step 1:": no rank started the step
        assert re.match(r"hetero: rank \d \(.*\) failed: DataError: ", line), line
        assert f"sample 5 (id 000005) image {image.relative_to(tmp_path / 'llava')}: not a readable image" in line, line
    assert sum("so no rank starts it" in line for line in reports) == 3
    assert (tmp_path / "runs" / "own_data_vlm" / "metrics.jsonl").read_text() == ""  # no step trained
