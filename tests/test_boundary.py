"""Boundary communicators on real gloo ranks: exact shards forward, exact summed gradients backward.

Every case builds a global tensor from a seed, gives each source rank its shard with the test's own
slicing code (``reference_indices``: ``tensor_split`` for DP rows and contiguous CP/SP parts,
``zigzag_indices`` for zigzag CP; never the plan's arithmetic), sends it through the boundary and
checks each destination rank's shard against the same slicing of the global tensor. Backward: each
destination rank d weights its output with its own tensor W_d; the global gradient is the sum of
every W_d placed at d's global positions, and each source rank must get exactly its slice of it
(source replicas each get the full sum). Values are small integers, so every dtype is exact.

Cases run many per ``run_ranks`` call (starting ranks costs seconds): every rank loops over the same
cases and builds the same boundaries in the same order; problems are collected, not raised, so one
wrong case does not stall the others. Every other random case runs with ``async_sends``.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest
import torch

from boundary_oracle import (
    COUNTED,
    FLOAT,
    RANDOM_CASES,
    RUN_TIMEOUT_S,
    SEED,
    Case,
    ideal_bytes,
    layout,
    run_cases,
    spec,
)
from hetero.parallel.boundary import Sharding, Side, TensorSpec
from hetero.parallel.layout import Layout
from hetero.testing.multiprocess import run_ranks


NAMED_CASES: dict[int, list[Case]] = {
    4: [
        Case(
            "dp3_to_dp2",
            Side(layout([0, 1, 2], dp=3)),
            Side(layout([2, 3], dp=2)),
            {"tensor": spec()},
            ({"tensor": (6, 4, 3)},),
        ),
        Case(
            "five_rows_over_two",
            Side(layout([0])),
            Side(layout([1, 2], dp=2)),
            {"tensor": spec()},
            ({"tensor": (5, 2, 3)},),
        ),
        Case(
            "five_rows_two_to_three",
            Side(layout([0, 1], dp=2)),
            Side(layout([1, 2, 3], dp=3)),
            {"tensor": spec()},
            ({"tensor": (5, 2, 3)},),
            autograd=False,
        ),
        Case(
            "cp2_source",
            Side(layout(range(4), cp=2, dp=2)),
            Side(layout(range(4), tp=2, dp=2)),
            {"tensor": spec()},
            ({"tensor": (4, 8, 3)},),
        ),
        Case(
            "colocated_tp1dp4_to_tp2dp2",
            Side(layout(range(4), dp=4)),
            Side(layout(range(4), tp=2, dp=2)),
            {"tensor": spec()},
            ({"tensor": (8, 4, 6)},),
        ),
        Case(
            "int8_payload",
            Side(layout(range(4), dp=4)),
            Side(layout(range(4), tp=2, dp=2)),
            {"tensor": spec(dtype=torch.int8)},
            ({"tensor": (4, 4, 6)},),
        ),
        Case(
            "dict_of_tensors",
            Side(layout([0, 1], dp=2)),
            Side(layout([2, 3], tp=2)),
            {
                "hidden": spec(),
                "mask": spec(ndim=2, dtype=torch.uint8),
                "image": spec(
                    ndim=4,
                    dtype=torch.bfloat16,
                    source=Sharding(seq_dim=None),
                    destination=Sharding(seq_dim=None),
                ),
            },
            ({"hidden": (4, 4, 8), "mask": (4, 4), "image": (4, 2, 3, 3)},),
            single=False,
        ),
        Case(
            "token_ids_and_mask_beside_hidden_states",
            Side(layout([0, 1], dp=2)),
            Side(layout([1, 2, 3], cp=1, dp=3)),
            {"hidden": spec(), "tokens": spec(ndim=2, dtype=torch.int64), "mask": spec(ndim=2, dtype=torch.bool),
             "positions": spec(ndim=2, dtype=torch.int32)},
            ({"hidden": (6, 4, 3), "tokens": (6, 4), "mask": (6, 4), "positions": (6, 4)},),
            single=False,
        ),
        Case(
            "varying_shapes",
            Side(layout([0, 1], dp=2)),
            Side(layout([0, 1, 2, 3], tp=2, dp=2)),
            {"tensor": spec()},
            ({"tensor": (4, 4, 6)}, {"tensor": (3, 8, 6)}, {"tensor": (5, 2, 6)}, {"tensor": (4, 4, 6)}),
        ),
        Case(
            "exchange_shapes",
            Side(layout([0, 1], dp=2)),
            Side(layout([2, 3], tp=2)),
            {"tensor": spec()},
            ({"tensor": (4, 4, 6)}, {"tensor": (3, 6, 6)}),
            exchange_shapes=True,
        ),
        Case(
            "identity_tp2_sums_replica_gradients",
            Side(layout(range(4), tp=2, dp=2)),
            Side(layout(range(4), tp=2, dp=2)),
            {"tensor": spec()},
            ({"tensor": (4, 4, 6)},),
        ),
    ],
    6: [
        Case(
            "non_colocated_dp2_to_tp2dp2",
            Side(layout([0, 1], dp=2)),
            Side(layout([2, 3, 4, 5], tp=2, dp=2)),
            {"tensor": spec()},
            ({"tensor": (4, 4, 6)},),
        ),
        Case(
            "cp2_destination",
            Side(layout([0, 1], dp=2)),
            Side(layout([2, 3, 4, 5], cp=2, dp=2)),
            {"tensor": spec()},
            ({"tensor": (4, 8, 3)},),
        ),
        Case(
            "sequence_parallel_both_sides",
            Side(layout(range(4), tp=2, cp=2)),
            Side(layout(range(2, 6), tp=4)),
            {
                "tensor": spec(
                    source=Sharding(sequence_parallel=True), destination=Sharding(sequence_parallel=True)
                )
            },
            ({"tensor": (2, 8, 3)},),
        ),
        Case(
            # embeddings of 6 tokens at positions 5..10 of a 16-token sequence split zigzag over cp2 and
            # SP over tp2: CP rank 1 holds positions 4..11 (TP parts 4..7 and 8..11), CP rank 0 none
            "window_into_tp2_cp2_sequence_parallel",
            Side(layout([0, 1], dp=2)),
            Side(layout(range(2, 6), tp=2, cp=2)),
            {"tensor": spec(source=Sharding(seq_dim=None),
                            destination=Sharding(sequence_parallel=True, window=(5, 16)))},
            ({"tensor": (4, 6, 3)},),
        ),
        Case(
            "window_colocated_dp2_into_cp2_dp2_and_back_out_whole",
            Side(layout(range(4), dp=2, cp=2)),
            Side(layout(range(4), dp=4)),
            {"tensor": spec(source=Sharding(window=(2, 8)), destination=Sharding(seq_dim=None))},
            ({"tensor": (4, 4, 3)},),
        ),
        Case(
            "pp_stage_selection",
            Side(layout(range(4), dp=2, pp=2), stage=0),
            Side(layout(range(2, 6), tp=2, pp=2), stage=1),
            {"tensor": spec()},
            ({"tensor": (4, 2, 3)},),
        ),
    ],
}


def random_layout(rng: random.Random, ranks: list[int]) -> Layout:
    n = len(ranks)
    options = [f for f in itertools.product(range(1, n + 1), repeat=4) if math.prod(f) == n]
    tp, cp, dp, pp = rng.choice(options)
    return layout(ranks, tp=tp, cp=cp, dp=dp, pp=pp)


def random_placement(rng: random.Random, world: int) -> tuple[list[int], list[int], str]:
    ranks = list(range(world))
    kind = rng.choice(["colocated", "disjoint", "overlapping"] if world >= 3 else ["colocated", "disjoint"])
    if kind == "colocated":
        return ranks, rng.sample(ranks, world), kind  # the destination may order the ranks differently
    if kind == "disjoint":
        cut = rng.randint(1, world - 1)
        return ranks[:cut], ranks[cut:], kind
    end = rng.randint(2, world - 1)  # source ranks 0..end-1, destination start..world-1, overlapping
    start = rng.randint(1, end - 1)
    return ranks[:end], ranks[start:], kind


def random_sharding(rng: random.Random, ndim: int) -> Sharding:
    dims = list(range(ndim))
    batch = rng.choice(dims + [None]) if rng.random() < 0.3 else 0
    seq_options = [d for d in dims if d != batch]
    seq = rng.choice(seq_options) if seq_options and rng.random() < 0.85 else None
    return Sharding(
        batch_dim=batch,
        seq_dim=seq,
        zigzag=rng.random() < 0.6,
        sequence_parallel=seq is not None and rng.random() < 0.3,
    )


def random_spec(rng: random.Random) -> TensorSpec:
    ndim = rng.choice([1, 2, 3, 3, 3, 4])
    source = random_sharding(rng, ndim)
    destination = source if rng.random() < 0.7 else random_sharding(rng, ndim)
    destination = replace(
        destination,
        zigzag=rng.random() < 0.6,
        sequence_parallel=destination.seq_dim is not None and rng.random() < 0.3,
    )
    dtype = rng.choice([FLOAT] * 6 + [torch.bfloat16, torch.float16, torch.int8, torch.uint8])
    return TensorSpec(ndim=ndim, dtype=dtype, source=source, destination=destination)


def random_shape(
    rng: random.Random, tensor_spec: TensorSpec, source: Layout, destination: Layout
) -> tuple[int, ...]:
    shape = [rng.randint(1, 3) for _ in range(tensor_spec.ndim)]
    multiple = 1
    for sharding, lay in ((tensor_spec.source, source), (tensor_spec.destination, destination)):
        if sharding.batch_dim is not None:
            shape[sharding.batch_dim] = rng.randint(1, 7)
        if sharding.seq_dim is not None and sharding.zigzag and lay.cp > 1:
            multiple = math.lcm(multiple, 2 * lay.cp)
    for sharding in (tensor_spec.source, tensor_spec.destination):
        if sharding.seq_dim is not None:
            shape[sharding.seq_dim] = multiple * rng.randint(1, 2) if multiple > 1 else rng.randint(2, 9)
    # a dim that is the sequence on one side must suit zigzag on the other side too
    for sharding in (tensor_spec.source, tensor_spec.destination):
        if sharding.seq_dim is not None and shape[sharding.seq_dim] % multiple:
            shape[sharding.seq_dim] = multiple
    return tuple(shape)


def random_case(rng: random.Random, world: int, index: int) -> Case:
    src_ranks, dst_ranks, kind = random_placement(rng, world)
    src, dst = random_layout(rng, src_ranks), random_layout(rng, dst_ranks)
    source = Side(src, stage=rng.randrange(src.pp) if rng.random() < 0.3 else None)
    destination = Side(dst, stage=rng.randrange(dst.pp) if rng.random() < 0.3 else None)
    single = rng.random() < 0.75
    keys = ["tensor"] if single else ["hidden", "extra"]
    specs = {k: random_spec(rng) for k in keys}
    calls = tuple(
        {k: random_shape(rng, specs[k], src, dst) for k in keys}
        for _ in range(2 if rng.random() < 0.3 else 1)
    )
    return Case(
        name=f"random{world}_{index}_{kind}",
        source=source,
        destination=destination,
        specs=specs,
        calls=calls,
        single=single,
        autograd=rng.random() < 0.5,
        exchange_shapes=rng.random() < 0.2,
        async_sends=index % 2 == 1,  # not drawn from rng: the other draws stay as they were
    )


def random_cases() -> dict[int, list[Case]]:
    rng = random.Random(SEED)
    return {
        world: [random_case(rng, world, i) for i in range(count)] for world, count in RANDOM_CASES.items()
    }


def all_cases() -> dict[int, list[Case]]:
    cases = random_cases()
    for world, named in NAMED_CASES.items():
        cases[world] = named + cases[world]
    return cases


# -------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def outcomes() -> dict[str, dict]:
    """Every case's per-rank results, one run_ranks call per world size."""
    results: dict[str, dict] = {}
    first_id = 0
    for world, cases in all_cases().items():
        per_rank = run_ranks(run_cases, world, cases, first_id, timeout_s=RUN_TIMEOUT_S)
        first_id += len(cases)
        for case in cases:
            results[case.name] = {"case": case, "ranks": [r[case.name] for r in per_rank]}
    return results


def check_case(outcome: dict) -> None:
    case: Case = outcome["case"]
    problems = [p for r in outcome["ranks"] for p in r["problems"]]
    assert not problems, "\n".join(problems[:10])
    for call in range(len(case.calls)):
        counters = [r["counters"][call] for r in outcome["ranks"]]
        total = {k: sum(c[f"forward.{k}"] for c in counters) for k in COUNTED}
        ideal = ideal_bytes(case, call)
        assert total["cross_sent_bytes"] == total["cross_recv_bytes"] == ideal["cross"], (
            case.name,
            call,
            total,
            ideal,
        )
        assert total["cross_recv_bytes"] + total["intra_recv_bytes"] == ideal["total"], (
            case.name,
            call,
            total,
            ideal,
        )
        assert total["intra_sent_bytes"] == total["intra_recv_bytes"]
        assert total["local_copy_bytes"] == ideal["local"], (case.name, call, total, ideal)


@pytest.mark.parametrize("name", [c.name for cases in random_cases().values() for c in cases])
def test_random_case(outcomes, name):
    check_case(outcomes[name])


def test_random_cases_cover_every_feature():
    cases = [c for cs in random_cases().values() for c in cs]
    assert len(cases) >= 50
    specs = [s for c in cases for s in c.specs.values()]
    features = {
        "colocated": any("colocated" in c.name for c in cases),
        "disjoint": any("disjoint" in c.name for c in cases),
        "overlapping": any("overlapping" in c.name for c in cases),
        "non-dividing dp": any(
            max(c.source.layout.dp, c.destination.layout.dp)
            % min(c.source.layout.dp, c.destination.layout.dp)
            for c in cases
        ),
        "uneven batch": any(
            call[k][s.source.batch_dim] % c.source.layout.dp
            for c in cases
            for call in c.calls
            for k, s in c.specs.items()
            if s.source.batch_dim is not None
        ),
        "source cp zigzag": any(
            c.source.layout.cp > 1 and s.source.zigzag and s.source.seq_dim is not None
            for c in cases
            for s in c.specs.values()
        ),
        "destination cp zigzag": any(
            c.destination.layout.cp > 1 and s.destination.zigzag and s.destination.seq_dim is not None
            for c in cases
            for s in c.specs.values()
        ),
        "contiguous cp": any(
            c.source.layout.cp > 1 and not s.source.zigzag and s.source.seq_dim is not None
            for c in cases
            for s in c.specs.values()
        ),
        "sequence parallel": any(
            s.source.sequence_parallel or s.destination.sequence_parallel for s in specs
        ),
        "pp stage": any(c.source.layout.pp > 1 or c.destination.layout.pp > 1 for c in cases),
        "explicit stage": any(c.source.stage is not None or c.destination.stage is not None for c in cases),
        "no batch dim": any(s.source.batch_dim is None or s.destination.batch_dim is None for s in specs),
        "no seq dim": any(s.source.seq_dim is None for s in specs),
        "dict": any(not c.single for c in cases),
        "varying shapes": any(len(c.calls) > 1 for c in cases),
        "exchange shapes": any(c.exchange_shapes for c in cases),
        "async sends": any(c.async_sends for c in cases),
        "waited sends": any(not c.async_sends for c in cases),
        "autograd": any(c.autograd for c in cases),
        "explicit calls": any(not c.autograd for c in cases),
        **{
            str(d): any(s.dtype == d for s in specs)
            for d in (torch.bfloat16, torch.float16, torch.int8, torch.uint8)
        },
        **{f"ndim {n}": any(s.ndim == n for s in specs) for n in (1, 2, 3, 4)},
    }
    assert all(features.values()), [k for k, v in features.items() if not v]


@pytest.mark.parametrize("name", [c.name for cases in NAMED_CASES.values() for c in cases])
def test_named_case(outcomes, name):
    check_case(outcomes[name])


def test_five_rows_over_two_replicas_arrive_as_three_and_two(outcomes):
    ranks = outcomes["five_rows_over_two"]["ranks"]
    assert [ranks[r]["out_shapes"][0]["tensor"] for r in (1, 2)] == [(3, 2, 3), (2, 2, 3)]
    ranks = outcomes["five_rows_two_to_three"]["ranks"]
    assert [ranks[r]["out_shapes"][0]["tensor"] for r in (1, 2, 3)] == [(2, 2, 3), (2, 2, 3), (1, 2, 3)]


def test_a_window_arrives_where_its_positions_are(outcomes):
    ranks = outcomes["window_into_tp2_cp2_sequence_parallel"]["ranks"]
    assert [ranks[r]["out_shapes"][0]["tensor"] for r in (2, 3, 4, 5)] == [(4, 0, 3), (4, 0, 3), (4, 3, 3), (4, 3, 3)]
