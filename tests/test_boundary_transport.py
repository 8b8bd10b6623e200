"""A boundary as a pipeline link: modules on their own ranks and layouts, run as stages of one pipeline.

Stage 0 is a small module (Linear+Tanh) on the source layout; the destination layout holds the
remaining stages (a Linear+Tanh per extra PP stage, then a Linear), stage 0 feeding the next stage
through a boundary (``BoundarySender`` → ``BoundaryReceiver``) and the destination's own stages
linked by P2P. Every rank gives its stage the rows its DP coordinate takes (``tensor_split``, the
test's own slicing); TP ranks of the destination run the whole stage on the same rows (replicas).
The global microbatch losses (summed over the last stage's DP replicas) and every parameter's
gradient (summed over its stage's DP replicas) must equal one process running the composed model;
TP replicas must agree exactly. Each placement runs three steps on one boundary and one transport
per rank: GPipe, 1F1B, and 1F1B with two microbatches swapped at stage 0, which must not match.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hetero.errors import ConfigError
from hetero.parallel.boundary import Boundary, Sharding, Side, TensorSpec
from hetero.parallel.boundary_transport import BoundaryReceiver, BoundarySender, LinkedTransport
from hetero.parallel.layout import Coord, Layout
from hetero.parallel.pipeline import P2PTransport, PipelineStage, StageTransport, run_pipeline
from hetero.testing.multiprocess import run_ranks

FLOAT = torch.float32
IN, HIDDEN, OUT = 6, 8, 4
MICROBATCHES = 4
SPEC = TensorSpec(ndim=2, source=Sharding(seq_dim=None), destination=Sharding(seq_dim=None))
RUNS = {"gpipe": ("gpipe", False), "1f1b": ("1f1b", False), "1f1b_swapped": ("1f1b", True)}
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
RUN_TIMEOUT_S = 180


def layout(ranks, tp=1, dp=1, pp=1) -> Layout:
    return Layout(tp=tp, cp=1, dp=dp, pp=pp, ranks=tuple(ranks))


@dataclass(frozen=True)
class Case:
    name: str
    source: Layout  # stage 0
    destination: Layout  # stages 1 .. destination.pp
    rows: int  # rows of one global microbatch

    @property
    def world(self) -> int:
        return len(self.source.ranks) + len(self.destination.ranks)

    @property
    def num_stages(self) -> int:
        return 1 + self.destination.pp


CASES = {
    case.name: case
    for case in (
        Case("dp2_to_dp2", layout([0, 1], dp=2), layout([2, 3], dp=2), rows=4),
        Case("dp2_to_tp2_dp2", layout([0, 1], dp=2), layout(range(2, 6), tp=2, dp=2), rows=4),
        Case("dp3_to_dp2_uneven", layout([0, 1, 2], dp=3), layout([3, 4], dp=2), rows=5),
        Case("three_stages_dp2_to_dp2_pp2", layout([0, 1], dp=2), layout(range(2, 6), dp=2, pp=2), rows=4),
    )
}


# ----------------------------------------------------------------------------- model and data


def build_stages(num_stages: int) -> list[nn.Module]:
    """Stage 0: Linear+Tanh from IN; each middle stage Linear+Tanh; the last a Linear to OUT."""
    gen = torch.Generator().manual_seed(0)
    stages: list[nn.Module] = [nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh())]
    stages += [nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(num_stages - 2)]
    stages.append(nn.Linear(HIDDEN, OUT))
    with torch.no_grad():
        for p in nn.ModuleList(stages).parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return stages


def microbatches(rows: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(rows, IN, generator=gen) for _ in range(MICROBATCHES)]
    targets = [torch.randn(rows, OUT, generator=gen) for _ in range(MICROBATCHES)]
    return inputs, targets


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target, reduction="sum")


def dp_rows(rows: int, dp: int, index: int) -> torch.Tensor:
    return torch.arange(rows).tensor_split(dp)[index]


def reference(case: Case) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The composed model in one process: per-microbatch losses and accumulated gradients."""
    model = nn.Sequential(*build_stages(case.num_stages))
    losses = []
    for x, y in zip(*microbatches(case.rows)):
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), {name: p.grad for name, p in model.named_parameters()}


# ------------------------------------------------------------------------------------ ranks


def stage_of(rank: int, case: Case) -> tuple[int, Coord]:
    if rank in case.source.ranks:
        return 0, case.source.coord(rank)
    coord = case.destination.coord(rank)
    return 1 + coord.pp, coord


def transport_for(rank: int, case: Case, boundary: Boundary) -> StageTransport:
    """Stage 0 sends into the boundary; stage 1 receives from it; destination stages link by P2P."""
    stage, coord = stage_of(rank, case)
    shape = (case.rows, HIDDEN)
    if stage == 0:
        return LinkedTransport(None, BoundarySender(boundary, shape))
    dst = case.destination
    local = (len(dp_rows(case.rows, dst.dp, coord.dp)), HIDDEN)

    def neighbour(step: int) -> int:
        return dst.rank_at(coord._replace(pp=coord.pp + step))

    if stage == 1:
        prev = BoundaryReceiver(boundary, shape)
    else:
        prev = P2PTransport(neighbour(-1), None, local, FLOAT)
    last = stage == case.num_stages - 1
    return LinkedTransport(prev, None if last else P2PTransport(None, neighbour(1), local, FLOAT))


def run_case(rank: int, world_size: int, case: Case) -> dict[str, dict]:
    """Every run of ``RUNS`` as one training step on this rank, reusing one boundary and transport."""
    boundary = Boundary(
        case.name, Side(case.source), Side(case.destination), SPEC, async_sends=True, timeout_s=60
    )
    transport = transport_for(rank, case, boundary)
    return {run: run_step(rank, case, transport, *how) for run, how in RUNS.items()}


def run_step(rank: int, case: Case, transport: StageTransport, schedule: str, swap: bool) -> dict:
    stage, coord = stage_of(rank, case)
    module = build_stages(case.num_stages)[stage]
    layout_ = case.source if stage == 0 else case.destination
    rows = dp_rows(case.rows, layout_.dp, coord.dp)
    inputs, targets = microbatches(case.rows)
    if swap:
        inputs[0], inputs[1] = inputs[1], inputs[0]
    last = stage == case.num_stages - 1
    losses = run_pipeline(
        PipelineStage(module, stage, case.num_stages, transport),
        schedule,
        MICROBATCHES,
        [x[rows] for x in inputs] if stage == 0 else None,
        [y[rows] for y in targets] if last else None,
        loss_fn,
    )
    return {
        "stage": stage,
        "dp": coord.dp,
        "tp": coord.tp,
        "losses": losses,
        "grads": {f"{stage}.{name}": p.grad for name, p in module.named_parameters()},
    }


@functools.cache
def case_results(name: str) -> list[dict[str, dict]]:
    case = CASES[name]
    return run_ranks(run_case, case.world, case, timeout_s=RUN_TIMEOUT_S)


# ----------------------------------------------------------------------------------- checks


def combine(case: Case, per_rank: list[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Losses summed over the last stage's DP replicas, gradients over each stage's DP replicas.

    TP replicas must hold exactly what their TP-0 peer holds; only TP 0 is counted.
    """
    counted = {(r["stage"], r["dp"]): r for r in per_rank if r["tp"] == 0}
    for r in per_rank:
        peer = counted[r["stage"], r["dp"]]
        torch.testing.assert_close(r["losses"], peer["losses"], rtol=0, atol=0)
        for name, grad in r["grads"].items():
            assert torch.equal(grad, peer["grads"][name]), f"TP replicas disagree on {name}"
    losses = torch.zeros(MICROBATCHES)
    grads: dict[str, torch.Tensor] = {}
    for (stage, _), r in counted.items():
        if stage == case.num_stages - 1:
            losses += torch.stack(r["losses"])
        for name, grad in r["grads"].items():
            grads[name] = grads[name] + grad if name in grads else grad.clone()
    return losses, grads


def assert_matches_reference(case: Case, per_rank: list[dict]) -> None:
    losses, grads = combine(case, per_rank)
    ref_losses, ref_grads = reference(case)
    torch.testing.assert_close(losses, ref_losses, **TOLERANCE)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **TOLERANCE, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("run", ["gpipe", "1f1b"])
@pytest.mark.parametrize("name", list(CASES))
def test_boundary_linked_pipeline_matches_single_process(name, run):
    case = CASES[name]
    assert_matches_reference(case, [by_run[run] for by_run in case_results(name)])


@pytest.mark.parametrize("name", list(CASES))
def test_swapped_microbatches_do_not_match(name):
    case = CASES[name]
    with pytest.raises(AssertionError):
        assert_matches_reference(case, [by_run["1f1b_swapped"] for by_run in case_results(name)])


# ----------------------------------------------------------------------------------- refusals


def refusals(rank: int, world_size: int) -> list[str]:
    """Each way to misuse the adapters, on ranks 0 (source) and 1 (destination); the errors raised."""
    src, dst, shape = layout([0]), layout([1]), (2, HIDDEN)
    own, other = (BoundarySender, BoundaryReceiver) if rank == 0 else (BoundaryReceiver, BoundarySender)
    # Boundaries build their groups on every rank, so all of them are built first, in one order.
    colocated = Boundary("colocated", layout([0, 1], dp=2), layout([0, 1], tp=2), SPEC, async_sends=True)
    waited = Boundary("waited", src, dst, SPEC)
    pair = Boundary("pair", src, dst, {"a": SPEC}, async_sends=True)
    ints = Boundary("ints", src, dst, TensorSpec(2, torch.uint8), async_sends=True)
    linked = Boundary("linked", src, dst, SPEC, async_sends=True)
    attempts = [
        lambda: BoundarySender(colocated, shape),
        lambda: BoundarySender(waited, shape),
        lambda: BoundarySender(pair, shape),
        lambda: BoundarySender(ints, shape),
        lambda: other(linked, shape),
        lambda: own(linked, (2, HIDDEN, 1)),
    ]
    errors = []
    for attempt in attempts:
        try:
            attempt()
            errors.append("")
        except (ConfigError, ValueError) as error:
            errors.append(str(error))
    link = own(linked, shape)
    try:  # refused before any message is posted, so the peer is not left waiting
        if rank == 0:
            link.send_forward(1, torch.zeros(shape))
        else:
            link.recv_forward(1)
    except RuntimeError as error:
        errors.append(str(error))
    return errors


def test_adapters_refuse_what_cannot_be_a_pipeline_link():
    per_rank = run_ranks(refusals, 2, timeout_s=60)
    for rank, errors in enumerate(per_rank):
        colocated, waited, pair, ints, wrong_side, bad_shape, out_of_order = errors
        assert f"rank {rank} is in both its source stage and its destination stage" in colocated
        if rank == 0:
            assert "build it with async_sends=True" in waited
            assert "carries one floating-point tensor" in pair and "carries one floating-point tensor" in ints
        assert f"rank {rank} is not in its {('destination', 'source')[rank]} stage" in wrong_side
        assert "global shape (2, 8, 1) does not fit a tensor of ndim=2" in bad_shape
        assert "microbatch 1 crosses forward where microbatch 0 is due" in out_of_order


def test_linked_transport_without_a_link_says_which():
    transport = LinkedTransport(None, None)
    with pytest.raises(RuntimeError, match="no previous link"):
        transport.recv_forward(0)
    with pytest.raises(RuntimeError, match="no next link"):
        transport.recv_backward(0)
    transport.finish()
