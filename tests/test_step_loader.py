"""The training loop's batches from ``train.data.workers`` processes: the same batches, in step order, as
the loop builds itself; a worker's error, or its death, raises in the loop instead of hanging it."""

import os
import signal
import time

import pytest
import torch

from hetero.config import load_experiment
from hetero.data.example import write_llava
from hetero.data.loader import StepLoader
from hetero.data.sample_batches import DataError
from hetero.testing.kinds import build_graph
from hetero.testing.bad_samples import write_cases
from hetero.data.splits import load

CPU = torch.device("cpu")


def llava_batches(path, *overrides):
    experiment = load_experiment("own_data_vlm", [f"train.data.path={path}", *overrides])
    return load(experiment, build_graph(experiment), "train")


def test_workers_give_the_batches_the_loop_builds_in_step_order(tmp_path):
    path = write_llava(tmp_path / "llava", 200, seed=0)
    for reuse in (1, 2):
        alone = list(StepLoader(llava_batches(path), 3, 8, reuse, 0, CPU, 60))
        ahead = list(StepLoader(llava_batches(path), 3, 8, reuse, 2, CPU, 60))
        assert [s for s, _, _ in alone] == [s for s, _, _ in ahead] == list(range(3, 9))
        for (_, mine, _), (_, theirs, _) in zip(alone, ahead):
            assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_a_workers_bad_sample_raises_in_the_loop_and_skips_are_counted(tmp_path):
    case = next(c for c in write_cases(tmp_path / "bad") if c.name == "missing image file")
    with pytest.raises(DataError, match=r"image images/not_there\.png not found"):
        for _ in StepLoader(llava_batches(case.path), 1, 12, 1, 2, CPU, 60):
            pass
    skipping = llava_batches(case.path, "train.data.on_error=skip", "train.data.max_skip_fraction=0.05")
    steps = 3 * len(skipping) // skipping.global_batch_size  # three epochs: the bad sample met in each
    reports = []
    for _, _, skipped in StepLoader(skipping, 1, steps, 1, 2, CPU, 60):
        reports.append(len(skipped))
        skipping.skip(skipped)
    print(f"\nthe bad sample reported by the workers {sum(reports)} times in {steps} steps")
    assert sum(reports) >= 2 and skipping.skipped == 1  # once per worker that met it; counted once


class Dies:
    """Batches whose worker is killed when it builds step 3's."""

    global_batch_size = 1

    def batch(self, step, reads=None):
        if step == 2 and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return {"tokens": torch.full((1, 4), step)}


def test_a_worker_killed_midway_stops_the_loop_at_once():
    started = time.perf_counter()
    seen, steps = [], iter(StepLoader(Dies(), 1, 20, 1, 1, CPU, 60))
    try:
        with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid.*(killed by signal|exited unexpectedly)"):
            for step, batch, _ in steps:
                seen.append(step)
    finally:
        steps.close()  # torch raises this from its SIGCHLD handler, wherever the test is, until the workers stop
    assert seen in ([1], [1, 2]) and time.perf_counter() - started < 30  # step 3 never comes


class Counts:
    global_batch_size = 1

    def batch(self, step, reads=None):
        return {"tokens": torch.full((1, 4), step)}


def test_a_worker_that_dies_before_torch_watches_it_stops_the_loop_at_once(monkeypatch):
    """A worker killed between its fork and the DataLoader registering its pid for the SIGCHLD handler (a
    busy machine can hold the loop there for a while): the signal is lost, and a DataLoader with a
    timeout waits the whole timeout on its queue without looking at its workers."""
    signal_handling = torch.utils.data._utils.signal_handling
    register = signal_handling._set_worker_pids

    def killed_first(loader_id, pids):
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
            while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
                time.sleep(0.01)
        register(loader_id, pids)

    monkeypatch.setattr(signal_handling, "_set_worker_pids", killed_first)
    started = time.perf_counter()
    steps = iter(StepLoader(Counts(), 1, 20, 1, 1, CPU, 60))
    try:
        with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid \d+\) exited unexpectedly"):
            next(steps)
    finally:
        steps.close()
    assert time.perf_counter() - started < 30
