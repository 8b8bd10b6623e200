"""Boundary calls with explicit DP rows per replica (``Rows``): each side's replicas hold the counts a call
gives them (zero included), as multimodal batches give modules unequal shares of the rows that carry a
modality. Every destination shard equals the test's own slicing of the global tensor by those counts, and
every source shard's gradient the sum of the destination ranks' weights at its rows; a call whose two sides
disagree on the rows is named."""

import pytest
import torch

from hetero.parallel.boundary import Boundary, Rows, Sharding, Side, TensorSpec
from hetero.parallel.layout import Layout
from hetero.testing.multiprocess import RankFailure, run_ranks

SPEC = TensorSpec(3, source=Sharding(0, None), destination=Sharding(0, None))


def layout(ranks, tp=1, dp=1) -> Layout:
    return Layout(tp=tp, cp=1, dp=dp, pp=1, ranks=tuple(ranks))


def rows_of(layout: Layout, rank: int, counts: tuple[int, ...]) -> slice:
    start = sum(counts[: layout.coord(rank).dp])
    return slice(start, start + counts[layout.coord(rank).dp])


CASES = {
    "dp2 (0-1) -> dp3 (2-4), a replica without rows": (layout([0, 1], dp=2), layout([2, 3, 4], dp=3), (3, 1), (0, 2, 2), 5),
    "dp2 -> tp2 on the same ranks, all rows on one source replica": (
        layout([0, 1], dp=2), layout([0, 1], tp=2), (0, 3), (3,), 2),
    "dp4 -> tp2·dp2 on the same ranks, uneven both sides": (
        layout([0, 1, 2, 3], dp=4), layout([0, 1, 2, 3], tp=2, dp=2), (1, 0, 2, 1), (3, 1), 4),
}


def exchange(rank, world_size, source, destination, src_rows, dst_rows, async_sends):
    boundary = Boundary("rows", Side(source), Side(destination), SPEC, timeout_s=60, async_sends=async_sends)
    total = sum(src_rows)
    shape = (total, 3, 4)
    x = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    rows = Rows(src_rows, dst_rows)
    mine = x[rows_of(source, rank, src_rows)] if boundary.is_source else None
    transfer = boundary.forward(mine, shape, rows)
    ok = True
    weight = None
    if boundary.is_destination:
        here = rows_of(destination, rank, dst_rows)
        ok = torch.equal(transfer.output, x[here])
        weight = torch.full_like(transfer.output, float(rank + 1))
    grad = boundary.backward(transfer, weight)
    boundary.wait_sends()
    if boundary.is_source:
        expected = torch.zeros(shape)
        for other in destination.ranks:
            expected[rows_of(destination, other, dst_rows)] += other + 1
        ok = ok and torch.equal(grad, expected[rows_of(source, rank, src_rows)])
    return ok


# Asynchronous sends are for disjoint sides (the graph pipeline's), so only the first case runs both ways.
@pytest.mark.parametrize("case,async_sends", [(name, False) for name in CASES] + [(next(iter(CASES)), True)])
def test_explicit_rows_move_the_right_rows_both_ways(case, async_sends):
    source, destination, src_rows, dst_rows, world_size = CASES[case]
    assert all(run_ranks(exchange, world_size, source, destination, src_rows, dst_rows, async_sends, timeout_s=120))


def disagree(rank, world_size):
    boundary = Boundary("rows", Side(layout([0])), Side(layout([1, 2], dp=2)), SPEC, timeout_s=10)
    x = torch.zeros(3, 3, 4) if rank == 0 else None
    boundary.forward(x, (3, 3, 4), Rows((3,), (1, 2) if rank == 1 else (2, 1)))


def test_sides_that_disagree_on_the_rows_are_named():
    with pytest.raises(RankFailure, match=r"DP rows \[3, 2, 1\].*DP rows \[3, 1, 2\]|DP rows \[3, 1, 2\].*DP rows \[3, 2, 1\]"):
        run_ranks(disagree, 3, timeout_s=60)


def test_rows_that_do_not_cover_the_batch_are_refused():
    from hetero.parallel.boundary_plan import check_global_shape

    with pytest.raises(ValueError, match=r"the destination's DP rows \[1, 1\] do not split dim 0 \(length 3\)"):
        check_global_shape((3, 3, 4), SPEC, Side(layout([0])), Side(layout([1, 2], dp=2)), "rows", Rows((3,), (1, 1)))
