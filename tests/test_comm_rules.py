"""The harness's NCCL-rules check: traffic gloo runs but NCCL would not is refused, naming the problem.

Each case posts real gloo traffic on 2 or 3 ranks; the run completes on gloo, and ``run_ranks`` then
raises ``CommRuleViolation`` for a reordered send and for a batch the group's other member does not join,
while correct traffic passes; collectives that differ across a group are refused on records."""

import pytest
import torch
import torch.distributed as dist

from hetero.testing.comm_rules import CommRuleViolation, Op, check
from hetero.testing.multiprocess import run_ranks


def two_messages(rank, world_size, reorder):
    """Rank 0 sends a 4-element then a 6-element tensor; rank 1 receives them with tags, in either order."""
    small, large = torch.zeros(4), torch.zeros(6)
    if rank == 0:
        first, second = (large, small) if reorder else (small, large)
        works = [dist.isend(first, dst=1, tag=len(first)), dist.isend(second, dst=1, tag=len(second))]
    else:
        works = [dist.irecv(small, src=0, tag=4), dist.irecv(large, src=0, tag=6)]
    for work in works:
        work.wait()


def test_sends_posted_in_the_receivers_order_pass():
    run_ranks(two_messages, 2, False)


def test_a_reordered_send_is_refused():
    with pytest.raises(CommRuleViolation, match=r"send #0 from rank 0 to rank 1 is 6 × torch.float32, but rank 1's "
                                                r"receive #0 from rank 0 is 4 × torch.float32"):
        run_ranks(two_messages, 2, True)


def half_joined_batch(rank, world_size):
    """A fresh group of ranks 0-2 opened by a batched P2P between ranks 0 and 1 only."""
    group = dist.new_group([0, 1, 2])
    if rank < 2:
        buffer = torch.zeros(3)
        ops = [dist.P2POp(dist.isend, torch.ones(3), group=group, group_peer=1 - rank),
               dist.P2POp(dist.irecv, buffer, group=group, group_peer=1 - rank)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    dist.barrier(group)


def test_a_batch_the_other_members_do_not_join_is_refused():
    with pytest.raises(CommRuleViolation, match=r"ranks \[0, 1\] open it with a batched P2P, but the first operation "
                                                r"of the others is \{2: 'barrier'\}"):
        run_ranks(half_joined_batch, 3)


def test_collectives_that_differ_across_ranks_are_refused():
    """On records (gloo itself rejects most such calls): rank 1 all-reduces 5 elements where rank 0 has 4."""
    def record(numel):
        return [Op("0", "all_reduce", None, "torch.float32", numel)], {"0": (0, 1)}

    check([record(4), record(4)])
    with pytest.raises(CommRuleViolation, match=r"collective #0 is \('all_reduce', 'torch.float32', 4\) on rank 0 but "
                                                r"\('all_reduce', 'torch.float32', 5\) on rank 1"):
        check([record(4), record(5)])


def crossed_collectives(rank, world_size, crossed):
    """Two groups of the same two ranks, one all-reduce on each; rank 1 issues them in the other order
    when ``crossed`` (gloo runs each group's asynchronous work on its own, so this finishes there)."""
    first, second = dist.new_group([0, 1]), dist.new_group([0, 1])
    order = (second, first) if crossed and rank == 1 else (first, second)
    works = [dist.all_reduce(torch.ones(2), group=group, async_op=True) for group in order]
    for work in works:
        work.wait()


def test_collectives_of_two_groups_in_opposite_orders_are_refused():
    run_ranks(crossed_collectives, 2, False)
    with pytest.raises(CommRuleViolation, match=r"ranks order collectives of different groups in a cycle: "
                                                r"collective #0 of group \d+ before #0 of group \d+ on rank \d"):
        run_ranks(crossed_collectives, 2, True)
