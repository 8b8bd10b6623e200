"""Checkpoints of frozen modules hold their weights and no optimizer state, and a resume may change what
is frozen: LLaVA's stage 1 (tower and LLM frozen) saved, resumed as stage 2 (the LLM trains: its AdamW
starts afresh, and the job says so), then resumed as stage 1 again. A next stage starts each module from
an earlier run's checkpoint (``init.checkpoint``)."""

import json
import subprocess
import sys

import pytest

from hetero.data.example import write_llava
from hetero.errors import ConfigError
from hetero.train.checkpoint import check_module_sources
from hetero.train.checkpoint_files import read_manifest

STAGE_1 = ["vision.trainable=false", "llm.trainable=false"]
STAGE_2 = ["vision.trainable=false"]


def run(tmp_path, data, steps, *overrides):
    done = subprocess.run([sys.executable, "-m", "hetero.cli", "train", "own_data_vlm", f"train.data.path={data}",
                           f"train.steps={steps}", "train.log_every=1", "train.eval_every=0", "train.eval_batches=1",
                           "train.checkpoint.every=2", "train.wandb=disabled", f"train.run_dir={tmp_path / 'runs'}",
                           *overrides], capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_a_resume_may_freeze_or_unfreeze_modules(tmp_path):
    data = write_llava(tmp_path / "llava", 200, seed=0)
    first = run(tmp_path, data, 2, *STAGE_1)
    assert "resumed" not in first
    second = run(tmp_path, data, 4, *STAGE_2)
    print("\n" + "\n".join(line for line in second.splitlines() if "resumed" in line or "afresh" in line))
    assert "resumed from" in second and "at step 2" in second
    assert ("llm: the checkpoint holds no optimizer state for (some of) its trained parameters, frozen when it was "
            "saved; AdamW starts afresh there") in second
    third = run(tmp_path, data, 6, *STAGE_1)
    assert "at step 4" in third and "afresh" not in third
    steps = [row["step"] for row in map(json.loads, (tmp_path / "runs" / "own_data_vlm" / "metrics.jsonl").open())
             if "loss" in row]  # the steps' records (not the evaluations' and summaries')
    assert steps == [1, 2, 3, 4, 5, 6]


def test_a_next_stage_starts_each_module_from_an_earlier_runs_checkpoint(tmp_path):
    """``init.checkpoint``: the weights of the same module from another run's checkpoint, under another
    layout (the LLM at dp2 instead of tp2). With every learning rate 0 the held-out loss after a step is
    the first run's final one. A checkpoint of another model, without the module, or missing is refused
    before launch."""
    data = write_llava(tmp_path / "llava", 200, seed=0)
    first = run(tmp_path, data, 2)
    checkpoint = tmp_path / "runs" / "own_data_vlm" / "checkpoints" / "step_000002"
    saved = read_manifest(checkpoint)["identity"]["models"]
    wider = {"llm": {"kind": "gpt", "model": saved["llm"]["model"] | {"hidden_size": 128}}}
    with pytest.raises(ConfigError, match=r"llm.init.checkpoint=.*: saved for another llm \(model.hidden_size: "
                                          r"saved 96, now 128\)"):
        check_module_sources(wider, {"llm": checkpoint})
    with pytest.raises(ConfigError, match=r"dna.init.checkpoint=.*: the checkpoint holds modules \['llm', "
                                          r"'projector', 'vision'\], not dna"):
        check_module_sources({"dna": saved["llm"]}, {"dna": checkpoint})
    with pytest.raises(ConfigError, match=r"llm.init.checkpoint=.*nothing: checkpoint .* does not exist"):
        check_module_sources(saved, {"llm": tmp_path / "nothing"})
    starts = [f"{name}.init.checkpoint={checkpoint}" for name in ("vision", "projector", "llm")]
    frozen_weights = [f"{name}.optim.lr=0" for name in ("vision", "projector", "llm")]
    (tmp_path / "next").mkdir()
    second = run(tmp_path / "next", data, 1, *starts, *frozen_weights, "llm.layout.tp=1", "llm.layout.dp=2",
                 "llm.micro_batch_size=2")
    losses = [float(line.split("held-out loss ")[1].split()[0]) for text in (first, second)
              for line in text.splitlines() if "held-out loss" in line]
    print(f"\nheld-out loss: first run at its end {losses[0]}, the next one from its checkpoint {losses[1]}")
    assert len(losses) == 2 and abs(losses[0] - losses[1]) <= 1e-4 * losses[0]
