"""A job on users' conversations saved under vision dp4 + LLM dp2 (6 ranks, each decoding its own images)
and resumed under vision dp2 + LLM dp1 (3 ranks), whose checkpoint is resumed under the first layouts
again: every resumed step trains on the uninterrupted run's samples (``train.sample_log``), none missing or
repeated, to the same losses."""

import json
import subprocess
import sys

from hetero.data.example import write_llava

BEFORE = ["world_size=6", "vision.layout.dp=4", "projector.layout.dp=4", "llm.layout.tp=1", "llm.layout.dp=2",
          "llm.layout.offset=4", "batch.micro_batch_size=2", "llm.micro_batch_size=4"]
AFTER = ["world_size=3", "vision.layout.dp=2", "projector.layout.dp=2", "llm.layout.tp=1", "llm.layout.dp=1",
         "llm.layout.offset=2", "batch.micro_batch_size=4", "llm.micro_batch_size=8"]


def train(tmp_path, run, *overrides):
    done = subprocess.run([sys.executable, "-m", "hetero.cli", "train", "own_data_vlm",
                           f"train.data.path={tmp_path / 'llava' / 'conversations.json'}", "train.steps=6",
                           "train.log_every=1", "train.eval_every=0", "train.eval_batches=1", "train.wandb=disabled",
                           "train.checkpoint.every=2", "train.checkpoint.keep=0", "train.sample_log=true",
                           f"train.run_dir={tmp_path / run}", *overrides],
                          capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    folder = tmp_path / run / "own_data_vlm"
    ids = {row["step"]: row["ids"] for row in map(json.loads, (folder / "samples.jsonl").open())}
    losses = {row["step"]: row["loss"] for row in map(json.loads, (folder / "metrics.jsonl").open()) if "loss" in row}
    return ids, losses, folder / "checkpoints"


def test_users_data_resumes_under_other_layouts_with_the_same_samples(tmp_path):
    write_llava(tmp_path / "llava", 300, seed=0)
    ids, losses, checkpoints = train(tmp_path, "straight", *BEFORE)
    consumed = [i for step in range(1, 7) for i in ids[step]]
    assert sorted(ids) == list(range(1, 7)) and len(consumed) == len(set(consumed)) == 6 * 16
    resharded, resharded_losses, saved = train(tmp_path, "resharded", *AFTER,
                                               f"train.checkpoint.resume={checkpoints / 'step_000002'}")
    back, back_losses, _ = train(tmp_path, "back", *BEFORE, f"train.checkpoint.resume={saved / 'step_000004'}")
    assert sorted(resharded) == [3, 4, 5, 6] and sorted(back) == [5, 6]
    assert all(resharded[s] == ids[s] for s in resharded) and all(back[s] == ids[s] for s in back)
    errors = [abs(run[s] - losses[s]) / losses[s] for run in (resharded_losses, back_losses) for s in run]
    print(f"\nrelative loss errors after resharding (steps 3-6, then 5-6): {[f'{e:.1e}' for e in errors]}")
    assert max(errors) < 1e-5
