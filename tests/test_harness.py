"""The multi-rank harness: results come back, failures carry the failing rank's traceback, nothing hangs."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from hetero.testing.multiprocess import RankFailure, RankTimeout, run_ranks


def gather_ranks(rank, world_size, scale):
    out = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(out, torch.tensor([float(rank * scale)]))
    return [t.item() for t in out]


def raise_on_rank_two(rank, world_size):
    if rank == 2:
        raise ValueError("rank two refuses")
    dist.barrier()  # the others wait here until killed


def sleep_forever(rank, world_size):
    time.sleep(3600)


def kill_rank_one(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3600)


def skip_a_collective(rank, world_size):
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins: gloo's own timeout must fire
    else:
        time.sleep(3600)


def test_results_come_back_in_rank_order():
    assert run_ranks(gather_ranks, 3, 10.0) == [[0.0, 10.0, 20.0]] * 3


def test_failing_rank_traceback_is_propagated():
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 2 failed:(.|\n)*ValueError: rank two refuses") as info:
        run_ranks(raise_on_rank_two, 4, timeout_s=60)
    assert info.value.rank == 2
    assert "raise_on_rank_two" in info.value.detail  # the traceback, not only the message
    assert time.monotonic() - start < 30


def test_hang_is_killed_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[0, 1\] did not finish within 4 s"):
        run_ranks(sleep_forever, 2, timeout_s=4)
    assert time.monotonic() - start < 15


def test_killed_rank_is_reported():
    with pytest.raises(RankFailure, match=r"rank 1 failed:\nprocess exited with code -9"):
        run_ranks(kill_rank_one, 2, timeout_s=60)


def test_collective_without_a_peer_times_out_instead_of_hanging():
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 0 failed:(.|\n)*(Timed out|timeout|timed out)"):
        run_ranks(skip_a_collective, 2, timeout_s=60, collective_timeout_s=3)
    assert time.monotonic() - start < 30
