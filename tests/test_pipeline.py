"""Pipeline schedules: the action order, and losses and gradients equal to the unsplit model's.

The model is a stack of Linear+Tanh blocks built from a fixed seed, identically on every rank; stage s
keeps its contiguous slice of blocks. The reference runs the whole stack in one process over the same
microbatches, accumulating gradients, and the pipelined run must agree with it.
"""

import functools
import queue
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetero.parallel.pipeline import (
    SCHEDULES,
    P2PTransport,
    PipelineForward,
    PipelineStage,
    pipeline_backward,
    pipeline_forward,
    run_pipeline,
    schedule_actions,
)
from hetero.testing.multiprocess import run_ranks

HIDDEN = 16
NUM_BLOCKS = 8
ROWS = 4  # rows per microbatch
TOLERANCE = {"rtol": 1e-6, "atol": 1e-7}


def build_blocks() -> list[nn.Module]:
    # a private generator, not torch.manual_seed: stages also run in threads of one process
    gen = torch.Generator().manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(NUM_BLOCKS)]
    with torch.no_grad():
        for p in nn.ModuleList(blocks).parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * HIDDEN**-0.5)
    return blocks


def make_microbatches(num_microbatches: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(ROWS, HIDDEN, generator=gen) for _ in range(num_microbatches)]
    targets = [torch.randn(ROWS, HIDDEN, generator=gen) for _ in range(num_microbatches)]
    return inputs, targets


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target, reduction="sum")


def stage_blocks(stage: int, num_stages: int) -> range:
    per_stage = NUM_BLOCKS // num_stages
    return range(stage * per_stage, (stage + 1) * per_stage)


def named_grads(blocks: list[nn.Module], indices: range) -> dict[str, torch.Tensor]:
    """Gradients keyed like the full nn.Sequential of all blocks names its parameters."""
    return {f"{i}.{name}": p.grad.clone() for i in indices for name, p in blocks[i].named_parameters()}


def reference(num_microbatches: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    blocks = build_blocks()
    model = nn.Sequential(*blocks)
    losses = []
    for x, y in zip(*make_microbatches(num_microbatches)):
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.detach())
    return losses, named_grads(blocks, range(NUM_BLOCKS))


def run_stage(stage_index, num_stages, schedule, num_microbatches, transport):
    """Build this stage's slice, run the schedule; return its losses and gradients."""
    blocks = build_blocks()
    indices = stage_blocks(stage_index, num_stages)
    stage = PipelineStage(nn.Sequential(*(blocks[i] for i in indices)), stage_index, num_stages, transport)
    inputs, targets = make_microbatches(num_microbatches)
    losses = run_pipeline(
        stage,
        schedule,
        num_microbatches,
        inputs if stage.is_first else None,
        targets if stage.is_last else None,
        loss_fn,
    )
    return {"losses": losses, "grads": named_grads(blocks, indices)}


CASES = [
    (pp, schedule, m)
    for pp in (2, 4)
    for schedule in SCHEDULES
    for m in ((4, 8) if pp == 2 else (1, 2, 4, 8))
]


def pipeline_rank(rank, world_size, cases):
    """Run every (schedule, microbatches) case for this pipeline depth, each with a fresh model."""
    results = {}
    for schedule, num_microbatches in cases:
        transport = P2PTransport(
            prev_rank=rank - 1 if rank > 0 else None,
            next_rank=rank + 1 if rank < world_size - 1 else None,
            shape=(ROWS, HIDDEN),
            dtype=torch.float32,
        )
        result = run_stage(rank, world_size, schedule, num_microbatches, transport)
        results[schedule, num_microbatches] = result
    return results


@functools.cache
def pipeline_results(pp: int) -> list[dict]:
    """All cases of one pipeline depth in one multi-rank run: starting ranks costs more than the work."""
    cases = [(schedule, m) for depth, schedule, m in CASES if depth == pp]
    return run_ranks(pipeline_rank, pp, cases, timeout_s=120)


def assert_matches_reference(results: list[dict], num_microbatches: int) -> None:
    """``results``: each stage's losses and gradients, in stage order."""
    ref_losses, ref_grads = reference(num_microbatches)
    assert all(r["losses"] == [] for r in results[:-1])
    torch.testing.assert_close(results[-1]["losses"], ref_losses, **TOLERANCE)
    grads = {name: grad for r in results for name, grad in r["grads"].items()}
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **TOLERANCE, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("pp,schedule,num_microbatches", CASES)
def test_pipeline_matches_single_process(pp, schedule, num_microbatches):
    results = [by_case[schedule, num_microbatches] for by_case in pipeline_results(pp)]
    assert_matches_reference(results, num_microbatches)


class ForbiddenTransport:
    """A transport with nothing to finish whose sends and receives must never be used."""

    def finish(self):
        pass

    def __getattr__(self, name):
        raise AssertionError(f"transport.{name} used by a single-stage pipeline")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_single_stage_needs_no_transport(schedule):
    result = run_stage(0, 1, schedule, 3, ForbiddenTransport())
    assert_matches_reference([result], 3)


class QueueTransport:
    """In-process links between stages running in threads; records every call it serves."""

    def __init__(self, links: dict, stage_index: int):
        self.links = links  # (kind "F"/"B", src stage, dst stage) -> queue of (microbatch, tensor)
        self.stage = stage_index
        self.calls: list[tuple[str, int]] = []
        self.finished = False

    def _get(self, kind, src, microbatch):
        got_mb, tensor = self.links[kind, src, self.stage].get(timeout=30)
        assert got_mb == microbatch
        return tensor.clone()

    def recv_forward(self, microbatch):
        self.calls.append(("recv_forward", microbatch))
        return self._get("F", self.stage - 1, microbatch)

    def send_forward(self, microbatch, tensor):
        self.calls.append(("send_forward", microbatch))
        self.links["F", self.stage, self.stage + 1].put((microbatch, tensor.clone()))

    def recv_backward(self, microbatch):
        self.calls.append(("recv_backward", microbatch))
        return self._get("B", self.stage + 1, microbatch)

    def send_backward(self, microbatch, tensor):
        self.calls.append(("send_backward", microbatch))
        self.links["B", self.stage, self.stage - 1].put((microbatch, tensor.clone()))

    def finish(self):
        self.finished = True


def queue_transports(num_stages: int) -> list[QueueTransport]:
    links = {("F", s, s + 1): queue.Queue() for s in range(num_stages - 1)}
    links.update({("B", s + 1, s): queue.Queue() for s in range(num_stages - 1)})
    return [QueueTransport(links, s) for s in range(num_stages)]


def run_in_threads(num_stages: int, work) -> list:
    """``work(stage)`` for every stage, each in its own thread; the results in stage order. A stage's
    exception is raised here, in the test's thread."""
    results: list = [None] * num_stages

    def guarded(s):
        try:
            results[s] = work(s)
        except BaseException as exc:
            results[s] = exc

    threads = [threading.Thread(target=guarded, args=(s,), daemon=True) for s in range(num_stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    assert not any(t.is_alive() for t in threads)
    return results


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_custom_transport_carries_all_traffic(schedule):
    """Four stages in threads of one process, linked only through QueueTransport."""
    num_stages, num_microbatches = 4, 5
    transports = queue_transports(num_stages)
    results = run_in_threads(num_stages, lambda s: run_stage(s, num_stages, schedule, num_microbatches, transports[s]))
    assert_matches_reference(results, num_microbatches)

    for s, t in enumerate(transports):
        assert t.finished
        expected = []
        for kind, mb in schedule_actions(schedule, s, num_stages, num_microbatches):
            if kind == "F":
                expected += [("recv_forward", mb)] * (s > 0) + [("send_forward", mb)] * (s < num_stages - 1)
            else:
                expected += [("recv_backward", mb)] * (s < num_stages - 1) + [("send_backward", mb)] * (s > 0)
        assert t.calls == expected


def downstream_gradients(num_microbatches: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randn(ROWS, HIDDEN, generator=gen) for _ in range(num_microbatches)]


def test_split_step_lets_a_downstream_module_run_between_forward_and_backward():
    """pipeline_forward on every stage, then a "downstream module" that returns gradients for the last
    stage's outputs, then pipeline_backward with their inner products added: the gradients of
    sum(loss + <output, g>) over microbatches, as in one process."""
    num_stages, num_microbatches = 4, 3
    transports = queue_transports(num_stages)
    downstream = downstream_gradients(num_microbatches)

    def work(s):
        blocks = build_blocks()
        indices = stage_blocks(s, num_stages)
        stage = PipelineStage(nn.Sequential(*(blocks[i] for i in indices)), s, num_stages, transports[s])
        inputs, targets = make_microbatches(num_microbatches)
        outputs = []

        def keep_output(out, target):
            outputs.append(out)
            return loss_fn(out, target)

        forward = pipeline_forward(stage, num_microbatches, inputs if stage.is_first else None,
                                   targets if stage.is_last else None, keep_output)
        forwards_only = [c for mb in range(num_microbatches)
                         for c in [("recv_forward", mb)] * (s > 0) + [("send_forward", mb)] * (s < num_stages - 1)]
        assert transports[s].calls == forwards_only
        extra = [(out * g).sum() for out, g in zip(outputs, downstream)] if stage.is_last else None
        pipeline_backward(forward, extra)
        return {"losses": forward.losses, "grads": named_grads(blocks, indices)}

    results = run_in_threads(num_stages, work)
    blocks = build_blocks()
    model = nn.Sequential(*blocks)
    losses = []
    for (x, y), g in zip(zip(*make_microbatches(num_microbatches)), downstream):
        out = model(x)
        loss = loss_fn(out, y)
        (loss + (out * g).sum()).backward()
        losses.append(loss.detach())
    torch.testing.assert_close(results[-1]["losses"], losses, **TOLERANCE)
    grads = {name: grad for r in results for name, grad in r["grads"].items()}
    reference_grads = named_grads(blocks, range(NUM_BLOCKS))
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], **TOLERANCE, msg=lambda m: f"{name}: {m}")
    assert all(t.finished for t in transports)
    first_of_two = PipelineStage(nn.Identity(), 0, 2, ForbiddenTransport())
    with pytest.raises(ValueError, match="extra objectives belong to the last stage"):
        pipeline_backward(PipelineForward(first_of_two, [(None, torch.zeros(()))], []), [torch.zeros(())])


def test_1f1b_actions_four_stages_eight_microbatches():
    def actions(text):
        return [(a[0], int(a[1:])) for a in text.split()]

    assert schedule_actions("1f1b", 0, 4, 8) == actions("F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7")
    assert schedule_actions("1f1b", 1, 4, 8) == actions("F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7")
    assert schedule_actions("1f1b", 3, 4, 8) == actions("F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7")
    assert schedule_actions("gpipe", 2, 4, 3) == actions("F0 F1 F2 B0 B1 B2")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("num_stages,num_microbatches", [(1, 1), (4, 1), (4, 2), (4, 8), (8, 3)])
def test_actions_cover_every_microbatch_and_bound_memory(schedule, num_stages, num_microbatches):
    for s in range(num_stages):
        actions = schedule_actions(schedule, s, num_stages, num_microbatches)
        assert sorted(actions) == [(k, mb) for k in "BF" for mb in range(num_microbatches)]
        assert all(actions.index(("F", mb)) < actions.index(("B", mb)) for mb in range(num_microbatches))
        in_flight = [sum(1 if k == "F" else -1 for k, _ in actions[: i + 1]) for i in range(len(actions))]
        bound = num_microbatches if schedule == "gpipe" else min(num_stages - s, num_microbatches)
        assert max(in_flight) == bound


def test_unknown_schedule_lists_the_valid_ones():
    with pytest.raises(ValueError, match="'interleaved'.*gpipe, 1f1b"):
        schedule_actions("interleaved", 0, 2, 4)
    stage = PipelineStage(nn.Linear(2, 2), 0, 1, ForbiddenTransport())
    with pytest.raises(ValueError, match="gpipe, 1f1b"):
        run_pipeline(stage, "GPipe", 1, [torch.zeros(2)], [torch.zeros(2)], loss_fn)


@pytest.mark.parametrize("num_microbatches", [0, -1])
def test_too_few_microbatches(num_microbatches):
    with pytest.raises(ValueError, match=f"num_microbatches={num_microbatches} must be >= 1"):
        schedule_actions("1f1b", 0, 2, num_microbatches)


def test_bad_stage_and_missing_data():
    with pytest.raises(ValueError, match="stage_index=2 is outside 0..1"):
        PipelineStage(nn.Linear(2, 2), 2, 2, ForbiddenTransport())
    with pytest.raises(ValueError, match="num_stages=0"):
        schedule_actions("gpipe", 0, 0, 1)
    stage = PipelineStage(nn.Linear(2, 2), 0, 1, ForbiddenTransport())
    with pytest.raises(ValueError, match="first stage needs 2 inputs.*got 1 inputs"):
        run_pipeline(stage, "gpipe", 2, [torch.zeros(2)], [torch.zeros(2)] * 2, loss_fn)
    with pytest.raises(ValueError, match="last stage needs 2 targets.*got None"):
        run_pipeline(stage, "gpipe", 2, [torch.zeros(2)] * 2, None, loss_fn)


def test_p2p_transport_refuses_a_tensor_of_the_wrong_shape():
    transport = P2PTransport(None, 1, (4, 16), torch.float32)
    with pytest.raises(ValueError, match=r"\(4, 8\) torch.float32 .* built for \(4, 16\)"):
        transport.send_forward(0, torch.zeros(4, 8))
    with pytest.raises(RuntimeError, match="no previous rank"):
        transport.recv_forward(0)
