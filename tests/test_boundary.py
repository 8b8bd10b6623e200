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

Call orders: with ``async_sends`` the two sides may call in a pipeline's different orders (1F1B), and
must get the same values and byte counts as waited sends in one order; waited sends in those orders
deadlock (gloo's sends wait for the receive).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import random
import time
from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist

from hetero.parallel.boundary import Boundary, BoundaryError, Sharding, Side, TensorSpec
from hetero.parallel.context import zigzag_indices
from hetero.parallel.layout import Layout
from hetero.parallel.pipeline import schedule_actions
from hetero.testing.multiprocess import RankFailure, run_ranks

FLOAT = torch.float32
SEED = 20240604
RANDOM_CASES = {2: 6, 3: 8, 4: 22, 6: 14, 8: 10}  # world size -> how many random cases run there
RUN_TIMEOUT_S = 180
FAIL_TIMEOUT_S = 3.0  # the boundary's own timeout in the failure tests
COUNTED = ("cross_sent_bytes", "cross_recv_bytes", "intra_sent_bytes", "intra_recv_bytes", "local_copy_bytes")


@dataclass(frozen=True)
class Case:
    name: str
    source: Side
    destination: Side
    specs: dict[str, TensorSpec]
    calls: tuple[dict[str, tuple[int, ...]], ...]  # the global shapes of each call, in order
    single: bool = True  # one tensor (the spec under key "tensor") rather than a dict
    autograd: bool = True  # through boundary(...) and loss.backward(), else forward()/backward()
    exchange_shapes: bool = False
    async_sends: bool = False  # sends of send-only crossings waited by wait_sends() after each call

    @property
    def differentiable(self) -> list[str]:
        return [key for key, spec in self.specs.items() if spec.dtype.is_floating_point]


# ----------------------------------------------------------------------------------- reference


def reference_indices(
    shape: tuple[int, ...], sharding: Sharding, layout: Layout, rank: int
) -> list[torch.Tensor]:
    """Per dim, the global indices ``rank`` holds, in its local order."""
    coord = layout.coord(rank)
    index = [torch.arange(n) for n in shape]
    if sharding.batch_dim is not None:
        index[sharding.batch_dim] = torch.arange(shape[sharding.batch_dim]).tensor_split(layout.dp)[coord.dp]
    if sharding.seq_dim is not None:
        length = shape[sharding.seq_dim]
        if sharding.zigzag and layout.cp > 1:
            seq = zigzag_indices(length, layout.cp, coord.cp)
        else:
            seq = torch.arange(length).tensor_split(layout.cp)[coord.cp]
        if sharding.sequence_parallel:
            seq = seq.tensor_split(layout.tp)[coord.tp]
        index[sharding.seq_dim] = seq
    return index


def take(tensor: torch.Tensor, index: list[torch.Tensor]) -> torch.Tensor:
    return tensor[torch.meshgrid(*index, indexing="ij")]


def source_ranks(case: Case) -> list[int]:
    stage = case.source.layout.pp - 1 if case.source.stage is None else case.source.stage
    return [r for r, c in case.source.layout.coords() if c.pp == stage]


def destination_ranks(case: Case) -> list[int]:
    stage = 0 if case.destination.stage is None else case.destination.stage
    return [r for r, c in case.destination.layout.coords() if c.pp == stage]


def seeded(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(functools.reduce(lambda a, b: a * 1009 + b, parts, 17))


def global_tensor(
    case_id: int, call: int, key_id: int, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    low = 0 if dtype == torch.uint8 else -8
    return torch.randint(low, 9, shape, generator=seeded(case_id, call, key_id)).to(dtype)


def weight(
    case_id: int, call: int, key_id: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    return torch.randint(-3, 4, shape, generator=seeded(case_id, call, key_id, rank + 100)).to(dtype)


def global_gradient(case: Case, case_id: int, call: int, key: str) -> torch.Tensor:
    """Sum over every destination rank of its weight, placed at the global positions it holds."""
    shape, spec = case.calls[call][key], case.specs[key]
    key_id = list(case.specs).index(key)
    total = torch.zeros(shape, dtype=torch.float64)
    for rank in destination_ranks(case):
        index = reference_indices(shape, spec.destination, case.destination.layout, rank)
        local = tuple(len(i) for i in index)
        w = weight(case_id, call, key_id, rank, local, spec.dtype).to(torch.float64)
        total.index_put_(torch.meshgrid(*index, indexing="ij"), w, accumulate=True)
    return total.to(spec.dtype)


def ideal_bytes(case: Case, call: int) -> dict[str, int]:
    """Minimum traffic, from masks: which destination ranks lack which elements in their own process."""
    cross = total = local = 0
    for key, spec in case.specs.items():
        shape = case.calls[call][key]
        held = {}
        for rank in source_ranks(case):
            mask = torch.zeros(shape, dtype=torch.bool)
            mask[
                torch.meshgrid(
                    *reference_indices(shape, spec.source, case.source.layout, rank), indexing="ij"
                )
            ] = True
            held[rank] = mask
        lacking_anywhere = torch.zeros(shape, dtype=torch.bool)
        for rank in destination_ranks(case):
            need = torch.zeros(shape, dtype=torch.bool)
            index = reference_indices(shape, spec.destination, case.destination.layout, rank)
            need[torch.meshgrid(*index, indexing="ij")] = True
            has = held.get(rank, torch.zeros(shape, dtype=torch.bool))
            lacking = need & ~has
            lacking_anywhere |= lacking
            total += int(lacking.sum()) * spec.dtype.itemsize
            local += int((need & has).sum()) * spec.dtype.itemsize
        cross += int(lacking_anywhere.sum()) * spec.dtype.itemsize
    return {"cross": cross, "total": total, "local": local}


# --------------------------------------------------------------------------------- rank side


def run_cases(rank: int, world_size: int, cases: list[Case], first_id: int) -> dict[str, dict]:
    results = {}
    for offset, case in enumerate(cases):
        results[case.name] = run_case(rank, case, first_id + offset)
    return results


def run_case(rank: int, case: Case, case_id: int) -> dict:
    tensors = case.specs["tensor"] if case.single else case.specs
    boundary = Boundary(
        case.name,
        case.source,
        case.destination,
        tensors,
        timeout_s=60,
        exchange_shapes=case.exchange_shapes,
        async_sends=case.async_sends,
    )
    problems, counters, out_shapes = [], [], []
    for call, shapes in enumerate(case.calls):
        boundary.reset_counters()
        found, received = run_call(rank, boundary, case, case_id, call, shapes)
        boundary.wait_sends()
        problems += found
        out_shapes.append(received)
        counters.append(boundary.counters())
    return {"problems": problems, "counters": counters, "out_shapes": out_shapes}


def run_call(
    rank: int, boundary: Boundary, case: Case, case_id: int, call: int, shapes: dict
) -> tuple[list[str], dict[str, tuple[int, ...]]]:
    """One call forward and backward; returns the problems found and the shapes this rank received."""
    keys = list(case.specs)
    globals_ = {
        k: global_tensor(case_id, call, i, shapes[k], case.specs[k].dtype) for i, k in enumerate(keys)
    }
    xs = None
    if boundary.is_source:
        xs = {
            k: take(globals_[k], reference_indices(shapes[k], case.specs[k].source, case.source.layout, rank))
            .clone()
            .requires_grad_(case.specs[k].dtype.is_floating_point)
            for k in keys
        }
    learns = case.exchange_shapes and not boundary.is_source
    shape_arg = None if learns else (shapes["tensor"] if case.single else shapes)
    x_arg = None if xs is None else (xs["tensor"] if case.single else xs)
    weights = {}
    if boundary.is_destination:
        for i, k in enumerate(keys):
            index = reference_indices(shapes[k], case.specs[k].destination, case.destination.layout, rank)
            weights[k] = weight(case_id, call, i, rank, tuple(len(j) for j in index), case.specs[k].dtype)
    out, grads = exchange(boundary, case, x_arg, shape_arg, weights, xs)

    problems, received = [], {}
    where = f"{case.name} call {call} rank {rank}"
    if boundary.is_destination:
        out = {"tensor": out} if case.single else out
        received = {k: tuple(t.shape) for k, t in out.items()}
        for k in keys:
            index = reference_indices(shapes[k], case.specs[k].destination, case.destination.layout, rank)
            expected = take(globals_[k], index)
            if not torch.equal(out[k].detach(), expected):
                problems.append(
                    f"{where}: output {k!r} {tuple(out[k].shape)} != expected {tuple(expected.shape)}"
                )
    if boundary.is_source:
        for k in case.differentiable:
            expected = take(
                global_gradient(case, case_id, call, k),
                reference_indices(shapes[k], case.specs[k].source, case.source.layout, rank),
            )
            got = grads.get(k)
            if got is None or not torch.equal(got, expected):
                problems.append(f"{where}: gradient {k!r} wrong: got {got}, expected {expected}")
    return problems, received


def exchange(boundary, case, x_arg, shape_arg, weights, xs):
    """Forward and backward through the boundary, by autograd or by the explicit calls."""
    has_grad = bool(case.differentiable)
    if case.autograd:
        out = boundary(x_arg, shape_arg)
        if has_grad:
            if boundary.is_destination:
                outs = {"tensor": out} if case.single else out
                loss = sum((outs[k] * weights[k]).sum() for k in case.differentiable)
                loss.backward()
            elif boundary.is_source:
                out.backward()  # the source-only token joins the backward exchange
        grads = {k: xs[k].grad for k in case.differentiable} if xs is not None else {}
        return out, grads
    transfer = boundary.forward(x_arg, shape_arg)
    grads = {}
    if has_grad:
        grad_arg = None
        if boundary.is_destination:
            grad_arg = weights["tensor"] if case.single else {k: weights[k] for k in case.differentiable}
        result = boundary.backward(transfer, grad_arg)
        if boundary.is_source:
            grads = {"tensor": result} if case.single else result
    return transfer.output, grads


# -------------------------------------------------------------------------------------- cases


def layout(ranks, tp=1, cp=1, dp=1, pp=1) -> Layout:
    return Layout(tp=tp, cp=cp, dp=dp, pp=pp, ranks=tuple(ranks))


def rank0_to_rank1(name: str, ndim: int, **options) -> Boundary:
    """A boundary from rank 0 to rank 1 with the failure tests' short timeout."""
    return Boundary(name, Side(layout([0])), Side(layout([1])), TensorSpec(ndim=ndim), timeout_s=FAIL_TIMEOUT_S,
                    **options)


def spec(ndim=3, dtype=FLOAT, **sides) -> TensorSpec:
    return TensorSpec(ndim=ndim, dtype=dtype, **sides)


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


# ------------------------------------------------------------------------------ failure tests


def pair() -> Boundary:
    return Boundary("v2l", Side(layout([0])), Side(layout([1])), TensorSpec(ndim=3), timeout_s=FAIL_TIMEOUT_S)


def shape_mismatch(rank, world_size, async_sends=False):
    boundary = rank0_to_rank1("v2l", 3, async_sends=async_sends)
    x = torch.zeros(4, 6, 8) if rank == 0 else None
    boundary.forward(x, (4, 6, 8) if rank == 0 else (4, 8, 8))
    boundary.wait_sends()  # with async_sends the headers go out only while the boundary lives


@pytest.mark.parametrize("async_sends", [False, True])
def test_mismatched_shape_names_boundary_ranks_and_shapes(async_sends):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(shape_mismatch, 2, async_sends, timeout_s=60)
    assert info.value.rank == 1
    assert (
        "BoundaryError: boundary 'v2l': forward call #1: rank 1 (destination) and rank 0 (source) disagree: "
        "rank 0 sent 'tensor' of shape (4, 6, 8) float32 but this rank expected 'tensor' of shape (4, 8, 8) "
        "float32" in info.value.detail
    )
    assert time.monotonic() - start < 30


def other_boundary(rank, world_size, shared):
    group = dist.new_group([0, 1]) if shared else None
    a = rank0_to_rank1("vision->llm", 2, group=group)
    b = rank0_to_rank1("audio->llm", 2, group=group)
    if rank == 0:
        a.forward(torch.zeros(2, 2), (2, 2))
    else:
        b.forward(None, (2, 2))


def test_call_to_another_boundary_is_named_on_a_shared_group():
    with pytest.raises(RankFailure) as info:
        run_ranks(other_boundary, 2, True, timeout_s=60)
    assert info.value.rank == 1
    assert (
        "boundary 'audio->llm': forward call #1: rank 1 (destination) and rank 0 (source) disagree: "
        "rank 0 called boundary 'vision->llm' while this rank called 'audio->llm'" in info.value.detail
    )


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
    if rank != 2:  # one row only reaches rank 1: rank 2 skipping these calls goes unnoticed until call 3
        boundary.forward(x, (1, 2))
        boundary.forward(x, (1, 2))
    boundary.forward(torch.zeros(2, 2) if rank == 0 else None, (2, 2))


def test_skipped_call_is_named_by_call_counter():
    with pytest.raises(RankFailure) as info:
        run_ranks(skipped_call, 3, timeout_s=60)
    assert info.value.rank == 2
    assert (
        "rank 0 is at forward call #3, this rank at #1: one side skipped or repeated a call"
        in info.value.detail
    )


def killed_source(rank, world_size):
    boundary = pair()
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
    assert (
        "boundary 'v2l': forward call #1: rank 0 (source) failed sending to rank 1 (destination)"
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
    posted_s, error = run_ranks(missing_call_async, 2, timeout_s=60)[0]
    assert posted_s < FAIL_TIMEOUT_S
    assert (
        "boundary 'v2l': forward call #1: rank 0 (source) failed sending to rank 1 (destination)" in error
    )
    assert "Timed out" in error
