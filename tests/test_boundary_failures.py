"""Boundary failures and call orders on real gloo ranks: a mismatched call (another shape, another
boundary, a skipped call) is named by both ranks at once; a dead peer or a missing call fails within the
boundary's timeout; with ``async_sends`` the two sides may call in a pipeline's different orders (1F1B),
and waited sends in those orders deadlock (gloo's sends wait for the receive)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from hetero.parallel.boundary import Boundary, BoundaryError, Side, TensorSpec
from hetero.parallel.pipeline import schedule_actions
from hetero.testing.multiprocess import RankFailure, run_ranks
from boundary_oracle import FAIL_TIMEOUT_S, FLOAT, RUN_TIMEOUT_S, global_tensor, layout, rank0_to_rank1, weight

# ------------------------------------------------------------------------------ failure tests


def pair() -> Boundary:
    return Boundary("v2l", Side(layout([0])), Side(layout([1])), TensorSpec(ndim=3), timeout_s=FAIL_TIMEOUT_S)


MISMATCH_TIMEOUT_S = 60.0  # the boundary's timeout here: both ends must fail long before it


def shape_mismatch(rank, world_size, async_sends=False):
    """Rank 1 expects another shape than rank 0 sends; each rank returns the error it raised and when."""
    boundary = rank0_to_rank1("v2l", 3, async_sends=async_sends, timeout_s=MISMATCH_TIMEOUT_S)
    x = torch.zeros(4, 6, 8) if rank == 0 else None
    start = time.monotonic()
    try:
        boundary.forward(x, (4, 6, 8) if rank == 0 else (4, 8, 8))
        boundary.wait_sends()  # an async sender checks the headers that came back here
    except BoundaryError as error:
        return str(error), time.monotonic() - start
    return None, time.monotonic() - start


@pytest.mark.parametrize("async_sends", [False, True])
def test_mismatched_shape_is_named_by_both_sides_at_once(async_sends):
    # An async sender posts its payload with its headers, and the destination, having refused the call,
    # never takes it: traffic NCCL would refuse, so with async sends its rules are not checked.
    (source, source_s), (destination, destination_s) = run_ranks(shape_mismatch, 2, async_sends, timeout_s=120,
                                                                 comm_rules=not async_sends)
    assert destination == (
        "boundary 'v2l': forward call #1: rank 1 (destination) and rank 0 (source) disagree: "
        "rank 0 sent 'tensor' of shape (4, 6, 8) float32 but this rank expected 'tensor' of shape (4, 8, 8) float32"
    )
    assert source == (
        "boundary 'v2l': forward call #1: rank 0 (source) and rank 1 (destination) disagree: "
        "rank 1 sent 'tensor' of shape (4, 8, 8) float32 but this rank expected 'tensor' of shape (4, 6, 8) float32"
    )
    print(f"\nasync_sends={async_sends}: source raised after {source_s:.2f} s, destination after {destination_s:.2f} s")
    assert max(source_s, destination_s) < 10 < MISMATCH_TIMEOUT_S


def other_boundary(rank, world_size, shared):
    group = dist.new_group([0, 1]) if shared else None
    a = rank0_to_rank1("vision->llm", 2, group=group)
    b = rank0_to_rank1("audio->llm", 2, group=group)
    try:
        if rank == 0:
            a.forward(torch.zeros(2, 2), (2, 2))
        else:
            b.forward(None, (2, 2))
    except BoundaryError as error:
        if shared:
            return str(error)
        raise
    return None


def test_call_to_another_boundary_is_named_on_a_shared_group():
    source, destination = run_ranks(other_boundary, 2, True, timeout_s=60)
    assert source == ("boundary 'vision->llm': forward call #1: rank 0 (source) and rank 1 (destination) disagree: "
                      "rank 1 called boundary 'audio->llm' while this rank called 'vision->llm'")
    assert destination == ("boundary 'audio->llm': forward call #1: rank 1 (destination) and rank 0 (source) "
                           "disagree: rank 0 called boundary 'vision->llm' while this rank called 'audio->llm'")


def test_call_to_another_boundary_times_out_on_separate_groups():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(other_boundary, 2, False, timeout_s=60)
    elapsed = time.monotonic() - start
    assert "Timed out" in info.value.detail and "another boundary" in info.value.detail
    assert "boundary 'vision->llm'" in info.value.detail or "boundary 'audio->llm'" in info.value.detail
    assert FAIL_TIMEOUT_S <= elapsed < FAIL_TIMEOUT_S + 20


def skipped_call(rank, world_size):
    boundary = Boundary(
        "v2l", Side(layout([0])), Side(layout([1, 2], dp=2)), TensorSpec(ndim=2), timeout_s=FAIL_TIMEOUT_S
    )
    x = torch.zeros(1, 2) if rank == 0 else None
    try:
        if rank != 2:  # one row only reaches rank 1: rank 2 skipping these calls goes unnoticed until call 3
            boundary.forward(x, (1, 2))
            boundary.forward(x, (1, 2))
        boundary.forward(torch.zeros(2, 2) if rank == 0 else None, (2, 2))
    except BoundaryError as error:
        return str(error)
    return None


def test_skipped_call_is_named_by_call_counter_on_both_sides():
    # rank 2 leaves out calls on purpose: traffic NCCL would refuse, so its rules are not checked
    source, _, skipper = run_ranks(skipped_call, 3, timeout_s=60, comm_rules=False)
    assert skipper == ("boundary 'v2l': forward call #1: rank 2 (destination) and rank 0 (source) disagree: "
                       "rank 0 is at forward call #3, this rank at #1: one side skipped or repeated a call")
    assert source == ("boundary 'v2l': forward call #3: rank 0 (source) and rank 2 (destination) disagree: "
                      "rank 2 is at forward call #1, this rank at #3: one side skipped or repeated a call")


def killed_source(rank, world_size):
    boundary = pair()
    dist.barrier(group=boundary.wire.groups["forward"])  # both ends connected: the death meets the call, not the setup
    if rank == 0:
        os._exit(0)  # exit code 0: the harness waits for the survivor's report instead of failing at once
    boundary.forward(None, (2, 2, 2))


def test_killed_peer_fails_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(killed_source, 2, timeout_s=60)
    assert info.value.rank == 1
    assert (
        "boundary 'v2l': forward call #1: rank 1 (destination) failed receiving from rank 0 (source)"
        in info.value.detail
    )
    assert time.monotonic() - start < FAIL_TIMEOUT_S + 20


def missing_call(rank, world_size):
    boundary = pair()
    if rank == 0:
        boundary.forward(torch.zeros(2, 2, 2), (2, 2, 2))
    else:
        time.sleep(60)  # alive, but never makes the call


def test_missing_call_times_out_on_the_sender():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(missing_call, 2, timeout_s=60)
    elapsed = time.monotonic() - start
    assert info.value.rank == 0
    assert (  # the sender waits for the destination's headers before it sends a payload
        "boundary 'v2l': forward call #1: rank 0 (source) failed receiving from rank 1 (destination)"
        in info.value.detail
    )
    assert "Timed out" in info.value.detail
    assert FAIL_TIMEOUT_S <= elapsed < FAIL_TIMEOUT_S + 20


# ------------------------------------------------------------------------- call orders, async sends

ORDER_MICROBATCHES = 4
ORDER_SHAPE = (2, 3)


def calls_in_order(rank, world_size, runs):
    """Each run: (async_sends, schedule, timeout_s). Ranks 0-1 (tp2) are stage 0 of a 2-stage schedule,
    ranks 2-3 (tp2) stage 1; each side calls the boundary in its stage's order of actions. Both sides
    are replica pairs, so every round runs: crossing, completion all-gather, reduce-scatter, all-gather.
    """
    results = []
    for async_sends, schedule, timeout_s in runs:
        boundary = Boundary(
            "orders",
            Side(layout([0, 1], tp=2)),
            Side(layout([2, 3], tp=2)),
            TensorSpec(ndim=2),
            timeout_s=timeout_s,
            async_sends=async_sends,
        )
        stage = 0 if boundary.is_source else 1
        transfers, problems = {}, []
        for kind, mb in schedule_actions(schedule, stage, 2, ORDER_MICROBATCHES):
            if kind == "F":
                sent = global_tensor(0, mb, 0, ORDER_SHAPE, FLOAT)
                transfers[mb] = boundary.forward(sent if boundary.is_source else None, ORDER_SHAPE)
                if boundary.is_destination and not torch.equal(transfers[mb].output, sent):
                    problems.append(f"rank {rank} microbatch {mb}: wrong output")
                continue
            grad = weight(0, mb, 0, rank, ORDER_SHAPE, FLOAT) if boundary.is_destination else None
            got = boundary.backward(transfers.pop(mb), grad)
            expected = sum(weight(0, mb, 0, r, ORDER_SHAPE, FLOAT) for r in (2, 3))
            if boundary.is_source and not torch.equal(got, expected):
                problems.append(f"rank {rank} microbatch {mb}: wrong gradient")
        boundary.wait_sends()
        results.append({"problems": problems, "counters": boundary.counters()})
    return results


def test_async_sends_pair_calls_made_in_1f1b_orders():
    runs = [(False, "gpipe", 60), (True, "gpipe", 60), (True, "1f1b", 60)]
    per_rank = run_ranks(calls_in_order, 4, runs, timeout_s=RUN_TIMEOUT_S)
    assert [p for r in per_rank for run in r for p in run["problems"]] == []
    for rank, by_run in enumerate(per_rank):
        waited, *asynchronous = [run["counters"] for run in by_run]
        assert all(counters == waited for counters in asynchronous), rank
        assert waited["forward.calls"] == waited["backward.calls"] == ORDER_MICROBATCHES


def test_waited_sends_deadlock_in_1f1b_orders():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(calls_in_order, 4, [(False, "1f1b", FAIL_TIMEOUT_S)], timeout_s=60)
    assert "BoundaryError: boundary 'orders'" in info.value.detail and "Timed out" in info.value.detail
    assert time.monotonic() - start < FAIL_TIMEOUT_S + 30


def missing_call_async(rank, world_size):
    boundary = rank0_to_rank1("v2l", 3, async_sends=True)
    if rank == 1:
        time.sleep(FAIL_TIMEOUT_S + 3)  # alive, but never makes the call
        return None
    start = time.monotonic()
    boundary.forward(torch.zeros(2, 2, 2), (2, 2, 2))
    posted_s = time.monotonic() - start
    try:
        boundary.wait_sends()
    except BoundaryError as error:
        return posted_s, str(error)
    return posted_s, "no error"


def test_async_send_to_a_missing_call_fails_at_wait_sends():
    # the destination leaves out a call on purpose: traffic NCCL would refuse, so its rules are not checked
    posted_s, error = run_ranks(missing_call_async, 2, timeout_s=60, comm_rules=False)[0]
    assert posted_s < FAIL_TIMEOUT_S
    assert (
        "boundary 'v2l': forward call #1: rank 0 (source) failed receiving from rank 1 (destination)" in error
    )
    assert "Timed out" in error

