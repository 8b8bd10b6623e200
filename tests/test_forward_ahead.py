"""A frozen encoder on ranks of its own computes ahead (``parallel.forward_ahead``): at the end of a step
it runs and sends the next step's first microbatches while the modules it feeds finish, and the next
step starts on them. The images-as-items VLM (tower dp2 on ranks 0-1, projector dp2 and LLM tp2 on 2-3)
trains with parity against one process (``check_parity``, 4 steps, 1e-5), LLaVA's stage 1 and stage 2,
one and two microbatches ahead; the tower ranks post the sends of the next step's microbatches before the
step ends. What cannot compute ahead is refused before any process starts, by name. ``hetero train``
with it logs the losses the job without it logs, evaluations between steps included."""

import json
import subprocess
import sys

import pytest

from hetero.errors import ConfigError
from hetero.testing.kinds import build_graph
from hetero.testing.kinds import build_runtime
from hetero.testing.multiprocess import run_ranks
from hetero.testing.parity import check_parity, record_run
from test_frozen_parity import FROZEN, NOT_COLOCATED, is_frozen
from test_item_images_parity import VISION, batches, items_experiment, reference


def train(rank, world_size, layouts, settings):
    runtime = build_runtime(items_experiment(world_size, layouts, settings=settings))
    record = record_run(runtime, batches(), ahead=True)
    sent = runtime.sent_ahead  # after the last step: none (no upcoming batch)
    runtime.train_step(batches()[0], batches()[1])
    ahead = runtime.sent_ahead
    runtime.train_step(batches()[1])  # receives what the step before sent ahead
    return record, sent, ahead


@pytest.mark.parametrize("recipe,ahead", [("stage 1", 2), ("stage 2", 1)])
def test_a_frozen_encoder_computing_ahead_trains_with_parity(recipe, ahead):
    frozen = FROZEN[recipe]
    settings = frozen | {"vision": frozen["vision"] | {"parallel": {"forward_ahead": ahead}}}
    expected = reference(VISION, lambda module, parameter: is_frozen(frozen, module, parameter))
    results = run_ranks(train, *NOT_COLOCATED, settings, timeout_s=300)
    print("\n" + check_parity([r for r, _, _ in results], expected, f"forward ahead {ahead}, {recipe}"))
    assert [(sent, after) for _, sent, after in results] == [(0, ahead)] * 2 + [(0, 0)] * 2


def graph_error(**settings) -> str:
    world, layouts = NOT_COLOCATED
    changed = {name: dict(layout) for name, layout in layouts.items()}
    modules = {"vision": {"trainable": False, "parallel": {"forward_ahead": 2}}}
    for name, change in settings.items():
        if "layout" in change:
            changed[name] |= change.pop("layout")
        modules[name] = modules.get(name, {}) | change
    with pytest.raises(ConfigError) as err:
        build_graph(items_experiment(world, changed, settings=modules))
    return str(err.value)


def test_what_cannot_compute_ahead_is_refused_by_name():
    field = "vision.parallel.forward_ahead=2"
    assert graph_error(vision={"trainable": True}) == (
        f"{field}: only a module that runs forward only computes ahead (frozen, like everything it reads "
        "from), but vision trains")
    assert graph_error(projector={"layout": {"offset": 0}}) == (
        f"{field}: vision shares ranks with projector; give it ranks of its own (vision.layout.offset)")
    assert graph_error(vision={"parallel": {"forward_ahead": 3}}) == (
        "vision.parallel.forward_ahead=3: a step has 2 microbatches; use at most 2")
    assert graph_error(vision={"layout": {"dp": 1, "pp": 2}}) == (
        f"{field}: vision.layout.pp=2; a module that computes ahead runs one stage")


def run(tmp_path, data, *overrides):
    done = subprocess.run([sys.executable, "-m", "hetero.cli", "train", "own_data_vlm", f"train.data.path={data}",
                           "train.steps=6", "train.log_every=1", "train.eval_every=3", "train.eval_batches=1",
                           "train.wandb=disabled", "train.checkpoint.every=0", "vision.trainable=false",
                           "projector.layout.offset=2", f"train.run_dir={tmp_path / 'runs'}", *overrides],
                          capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = tmp_path / "runs" / "own_data_vlm" / "metrics.jsonl"
    lines = [row for row in map(json.loads, metrics.open()) if "loss" in row]  # the steps' records
    metrics.unlink()
    heldout = [line for line in done.stdout.splitlines() if "held-out loss" in line]
    return [(line["step"], line["loss"], line["grad_norm"]) for line in lines], [h.rsplit("|", 1)[0] for h in heldout]


def test_hetero_train_computing_ahead_logs_the_same_losses(tmp_path):
    from hetero.data.example import write_llava

    data = write_llava(tmp_path / "llava", 200, seed=0)
    plain, ahead = run(tmp_path, data), run(tmp_path, data, "vision.parallel.forward_ahead=2")
    print(f"\n{ahead}")
    assert ahead == plain and len(plain[0]) == 6 and len(plain[1]) == 2
