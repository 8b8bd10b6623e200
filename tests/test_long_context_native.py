"""The shipped ``long_context_native_vlm`` job end to end under torchrun: photographs at native resolution
and text packed into rows of 4096 tokens, the encoder at dp4 and the LLM at tp2·cp2 on the same 4 ranks.
Two steps and a held-out evaluation; the progress line counts the routed edge's bytes both ways."""

import json
import subprocess
import sys


def test_the_long_context_native_resolution_job_trains(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "hetero.cli", "train", "long_context_native_vlm", "train.steps=2", "train.log_every=1",
         "train.eval_batches=1", "train.wandb=disabled", f"train.run_dir={tmp_path}"],
        capture_output=True, text=True, timeout=500, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("step     2 | loss")]
    assert "boundary.vision->llm.forward=" in line and "boundary.vision->llm.backward=" in line, line
    rows = [row for x in (tmp_path / "long_context_native_vlm" / "metrics.jsonl").read_text().splitlines()
            if "loss" in (row := json.loads(x))]  # the steps' records
    assert [r["step"] for r in rows] == [1, 2] and all(0 < r["loss"] < 10 for r in rows)
    assert "held-out loss" in done.stdout
