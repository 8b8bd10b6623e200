"""Boundary plans found by interval search: the same pieces as pairing every group of both sides, for
every case the boundary tests run, and at 16k ranks a cover of each sampled rank that an independent
computation confirms."""

import random

from hetero.parallel.boundary_plan import Rows, plan_pieces

from boundary_oracle import brute_force_pieces
from test_boundary import all_cases, random_case


def resolved(case):
    return (case.source.resolve(case.source.layout.pp - 1, "source"),
            case.destination.resolve(0, "destination"))


def random_counts(rng: random.Random, rows: int, dp: int) -> tuple[int, ...]:
    """``rows`` split over ``dp`` replicas at random, empty replicas included."""
    cuts = sorted(rng.randint(0, rows) for _ in range(dp - 1))
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, rows]))


def test_interval_search_lists_the_pieces_that_pairing_every_group_lists():
    """Every case of test_boundary.py and 300 more random ones, every rank, every call and tensor, with
    even rows and with random per-replica row counts (empty replicas too): equal pieces (blocks, ranks,
    order), so every plan and message is what it was."""
    rng = random.Random(7)
    cases = [case for world in all_cases().values() for case in world]
    cases += [random_case(rng, rng.choice([2, 3, 4, 5, 6, 8]), i) for i in range(300)]
    compared = 0
    for case in cases:
        source, destination = resolved(case)
        world = max((*source.layout.ranks, *destination.layout.ranks)) + 1
        for shapes in case.calls:
            (key, spec), *_ = case.specs.items()
            counted = Rows(
                random_counts(rng, shapes[key][spec.source.batch_dim], source.layout.dp)
                if spec.source.batch_dim is not None else None,
                random_counts(rng, shapes[key][spec.destination.batch_dim], destination.layout.dp)
                if spec.destination.batch_dim is not None else None)
            for rows in (Rows(), counted):
                for rank in range(world):
                    first = 0
                    for key, spec in case.specs.items():
                        rows_here = rows if key == next(iter(case.specs)) else Rows()
                        got = plan_pieces(key, shapes[key], spec, source, destination, rank, first, rows_here)
                        want = brute_force_pieces(key, shapes[key], spec, source, destination, rank, first, rows_here)
                        assert got == want, f"{case.name} rank {rank} {key} {shapes[key]} {rows_here}"
                        first += len(got)
                        compared += 1
    assert compared > 4000, compared


def check_cover(rank, shape, spec, source, destination, rows):
    """Each element of ``rank``'s destination box arrives exactly once, from a sender that holds that very
    element (by the oracle's own slicing), and by local copy exactly where this process holds it."""
    import torch

    from hetero.parallel.boundary_plan import rank_plan

    from boundary_oracle import reference_indices

    want = reference_indices(shape, spec.destination, destination.layout, rank, rows.destination)
    count = torch.zeros([len(i) for i in want], dtype=torch.int32)
    plan = rank_plan(rank, {"x": shape}, {"x": spec}, source, destination, rows)
    for piece in plan.received + plan.local_copies:
        held = reference_indices(shape, spec.source, source.layout, piece.senders[0], rows.source)
        for block in piece.blocks:
            count[tuple(slice(o.dst, o.dst + o.length) for o in block)] += 1
            for d, o in enumerate(block):
                assert torch.equal(held[d][o.src: o.src + o.length], want[d][o.dst: o.dst + o.length])
    assert bool((count == 1).all()), f"rank {rank}: covered {count.min()}..{count.max()} times"
    if source.layout.coord(rank) is not None and source.layout.coord(rank).pp == source.stage:
        mine = reference_indices(shape, spec.source, source.layout, rank, rows.source)
        local = 1
        for d in range(len(shape)):
            local *= int(torch.isin(want[d], mine[d]).sum())
    else:
        local = 0
    assert sum(p.numel for p in plan.local_copies) == local, f"rank {rank}: copies other than what it holds"
    return count.numel()


def test_plans_at_16k_ranks_cover_each_sampled_rank_exactly_once():
    """hetero.bench.scale's experiments at 16,384 ranks (every edge; even and random per-replica rows): on
    sampled destination ranks every element arrives once from a rank that holds it, and crosses only
    where the process does not hold it already."""
    import math

    from hetero.bench.scale import full_graph, long_context_vlm, random_counts
    from hetero.testing.kinds import build_graph
    from hetero.parallel.boundary_plan import Side, TensorSpec

    rng = random.Random(3)
    checked = 0
    for experiment in (long_context_vlm(16384, True), long_context_vlm(16384, False), full_graph(16384)):
        graph = build_graph(experiment)
        for edge in graph.edges:
            src_layout, dst_layout = graph.nodes[edge.src].layout, graph.nodes[edge.dst].layout
            source = Side(src_layout).resolve(src_layout.pp - 1, "source")
            destination = Side(dst_layout).resolve(0, "destination")
            spec = TensorSpec(3, source=edge.source, destination=edge.destination)
            rows = math.lcm(src_layout.dp, dst_layout.dp)
            shape = (rows, edge.tokens, 2)  # the width is whole on every rank: 2 stands for any
            splits = (Rows(), Rows(random_counts(rows, src_layout.dp, rng), random_counts(rows, dst_layout.dp, rng)))
            active = destination.active_ranks()
            for rank in {active[0], active[-1], *rng.sample(active, 4)}:
                for split in splits:
                    check_cover(rank, shape, spec, source, destination, split)
                    checked += 1
    assert checked >= 3 * 12, checked
