"""``hetero eval``: a checkpoint's held-out figures under any layouts, as the training run measured them;
what ``metrics.jsonl`` keeps of a run (every evaluation, the summary, at full precision); a resume with no
step left reporting its last real loss; a job in which nothing trains refused before launch.

One short training run of a 2-rank colocated VLM (vision dp2, LLM tp2) serves every test that launches."""

import json
import shutil
import subprocess
import sys

import pytest

from hetero.cli import main as cli
from hetero.config import load_experiment
from hetero.errors import ConfigError
from hetero.graph import build_graph
from hetero.models import default_registry
from hetero.testing.experiments import MAIN_JOB_SMALL_BATCH
from hetero.train.job import check_trains, train

# 4 steps, evaluations at steps 2 and 4 (on the first 2 held-out batches), the checkpoint at step 4
TINY = [*MAIN_JOB_SMALL_BATCH, "world_size=2", "vision.layout.dp=2", "llm.layout.dp=1", "train.steps=4",
        "train.log_every=1", "train.eval_every=2", "train.eval_batches=2", "train.checkpoint.every=4", "train.wandb=disabled"]
OTHER_LAYOUTS = ["llm.layout.tp=1", "llm.layout.dp=2", "llm.micro_batch_size=4"]


def hetero(tmp, command, *overrides, run="runs"):
    done = subprocess.run(
        [sys.executable, "-m", "hetero.cli", command, "colocated_vlm", *TINY, *overrides,
         f"train.data_dir={tmp / 'digits'}", f"train.run_dir={tmp / run}"],
        capture_output=True, text=True, timeout=300, cwd=tmp,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def records(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    out = hetero(tmp, "train")
    return tmp, out, tmp / "runs" / "colocated_vlm"


def full_precision(value):
    return float(f"{value:.6g}") != value  # not the printed figure, rounded


def test_metrics_jsonl_holds_every_evaluation_and_the_summary(trained):
    _, out, run = trained
    rows = records(run)
    steps = [row for row in rows if "loss" in row]
    evaluations = [row for row in rows if "heldout" in row]
    assert [row["step"] for row in steps] == [1, 2, 3, 4]
    assert [row["step"] for row in evaluations] == [2, 4]
    assert list(rows[-1]) == ["summary"]
    summary = rows[-1]["summary"]
    assert summary["final_loss"] == steps[-1]["loss"] and summary["final_llm.loss"] == steps[-1]["llm.loss"]
    assert {f"heldout_{k}": v for k, v in evaluations[-1]["heldout"].items()} == {
        k: v for k, v in summary.items() if k.startswith("heldout_")}
    for row in evaluations:
        assert set(row["heldout"]) == {"loss", "llm.loss", "llm.digit_accuracy"}
        assert full_precision(row["heldout"]["loss"]), row
        assert f"step {row['step']:5d} | held-out loss {row['heldout']['loss']:.4f}" in out
    assert full_precision(summary["final_loss"]) and "summary: steps 4, final_loss" in out


def test_eval_equals_the_runs_last_evaluation_under_any_layout(trained):
    tmp, _, run = trained
    last = [row for row in records(run) if "heldout" in row][-1]["heldout"]
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    out = hetero(tmp, "eval")
    assert f"evaluating step 4: vision, llm from {run / 'checkpoints' / 'step_000004'}" in out
    assert f"step     4 | held-out loss {last['loss']:.4f}" in out and "summary: step 4, heldout_loss" in out
    out = hetero(tmp, "eval", *OTHER_LAYOUTS)
    assert "--nproc_per_node=2" in out
    same, other = [row for row in records(run / "eval") if "heldout" in row]
    assert same["step"] == other["step"] == 4
    assert same["heldout"] == last  # bit for bit at the training layouts
    errors = {k: abs(other["heldout"][k] - v) / max(abs(v), 1e-12) for k, v in last.items() if v}
    print("relative differences at LLM tp1·dp2:", errors)
    assert max(errors.values()) < 1e-6 and other["heldout"]["llm.digit_accuracy"] == last["llm.digit_accuracy"]
    assert [list(row) for row in records(run / "eval") if "summary" in row] == [["summary"]] * 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == checkpoints  # nothing saved


def test_a_resume_with_no_step_left_reports_the_last_real_loss(trained, tmp_path):
    """The run's checkpoint moved elsewhere, without the run's metrics.jsonl: its manifest keeps the step's
    losses. Resumed on one rank (every module resharded), nothing left to train."""
    tmp, _, run = trained
    last = [row for row in records(run) if "loss" in row][-1]
    moved = shutil.copytree(run / "checkpoints" / "step_000004", tmp_path / "step_000004")
    out = hetero(tmp, "train", "world_size=1", "vision.layout.dp=1", "llm.layout.tp=1", "llm.micro_batch_size=4",
                 f"train.checkpoint.resume={moved}", run=tmp_path / "moved")
    assert f"resumed from {moved} at step 4" in out
    summary = records(tmp_path / "moved" / "colocated_vlm")[-1]["summary"]
    assert summary["final_loss"] == last["loss"] and summary["final_llm.loss"] == last["llm.loss"]
    assert f"final_loss {last['loss']:.4g}" in out and "final_loss nan" not in out


ALL_FROZEN = [["vision.trainable=false", "llm.trainable=false"],
              ["vision.trainable=false", "llm.frozen=['*']"]]


@pytest.mark.parametrize("frozen", ALL_FROZEN)
def test_a_job_with_nothing_to_train_is_refused_before_launch(frozen, tmp_path, capsys):
    experiment = load_experiment("colocated_vlm", [*frozen, f"train.run_dir={tmp_path}"])
    with pytest.raises(ConfigError) as refused:
        check_trains(experiment, build_graph(experiment, default_registry()))
    message = str(refused.value)
    assert message.startswith("every module is frozen (vision.trainable=false, llm.")
    assert "there is nothing to train" in message and "hetero eval colocated_vlm" in message
    with pytest.raises(ConfigError, match="every module is frozen"):
        train(experiment, default_registry())  # the rank entry, before any process group
    assert cli(["train", "colocated_vlm", *frozen, f"train.run_dir={tmp_path}"]) == 2
    assert "every module is frozen" in capsys.readouterr().err
    assert not (tmp_path / "colocated_vlm").exists()


def test_eval_without_a_checkpoint_is_refused_naming_where_one_comes_from(tmp_path, capsys):
    assert cli(["eval", "colocated_vlm", f"train.run_dir={tmp_path}", f"train.data_dir={tmp_path / 'digits'}"]) == 2
    err = capsys.readouterr().err
    assert "nothing to evaluate" in err and "vision.init.checkpoint" in err and "train.checkpoint.every" in err
    assert not (tmp_path / "digits").exists()  # refused before writing the data
