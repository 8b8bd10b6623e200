"""What the boundary tests compare against: each rank's shard of a global tensor by the tests' own slicing
(``tensor_split`` for DP rows and contiguous CP/SP parts, ``zigzag_indices`` for zigzag CP; never the
plan's arithmetic), the summed gradient every source rank must get, the ideal traffic, and the rank-side
loop that runs a list of cases through real boundaries and collects every problem."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from hetero.parallel.boundary import Boundary, Rows, Sharding, Side, TensorSpec
from hetero.parallel.context import zigzag_indices
from hetero.parallel.layout import Layout

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
    shape: tuple[int, ...], sharding: Sharding, layout: Layout, rank: int, counts: tuple[int, ...] | None = None
) -> list[torch.Tensor]:
    """Per dim, the global indices ``rank`` holds, in its local order; ``counts``: each DP replica's rows
    (default: an even split, earlier replicas taking the extra)."""
    coord = layout.coord(rank)
    index = [torch.arange(n) for n in shape]
    if sharding.batch_dim is not None:
        rows = torch.arange(shape[sharding.batch_dim])
        parts = rows.tensor_split(layout.dp) if counts is None else rows.split(list(counts))
        index[sharding.batch_dim] = parts[coord.dp]
    if sharding.seq_dim is not None:
        length = shape[sharding.seq_dim]
        offset, full = sharding.window or (0, length)
        if sharding.zigzag and layout.cp > 1:
            seq = zigzag_indices(full, layout.cp, coord.cp)
        else:
            seq = torch.arange(full).tensor_split(layout.cp)[coord.cp]
        if sharding.sequence_parallel:
            seq = seq.tensor_split(layout.tp)[coord.tp]
        # a window keeps the positions it covers, in the rank's order, renumbered from its offset
        index[sharding.seq_dim] = seq[(seq >= offset) & (seq < offset + length)] - offset
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


def ideal_bytes(case: Case, call: int, rows: Rows = Rows()) -> dict[str, int]:
    """Minimum traffic, from masks: which destination ranks lack which elements in their own process;
    ``rows``: each side's DP row counts (default: even splits)."""
    cross = total = local = 0
    for key, spec in case.specs.items():
        shape = case.calls[call][key]
        held = {}
        for rank in source_ranks(case):
            mask = torch.zeros(shape, dtype=torch.bool)
            mask[
                torch.meshgrid(
                    *reference_indices(shape, spec.source, case.source.layout, rank, rows.source), indexing="ij"
                )
            ] = True
            held[rank] = mask
        lacking_anywhere = torch.zeros(shape, dtype=torch.bool)
        for rank in destination_ranks(case):
            need = torch.zeros(shape, dtype=torch.bool)
            index = reference_indices(shape, spec.destination, case.destination.layout, rank, rows.destination)
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


def layout(ranks, tp=1, cp=1, dp=1, pp=1) -> Layout:
    return Layout(tp=tp, cp=cp, dp=dp, pp=pp, ranks=tuple(ranks))


def rank0_to_rank1(name: str, ndim: int, **options) -> Boundary:
    """A boundary from rank 0 to rank 1, by default with the failure tests' short timeout."""
    return Boundary(name, Side(layout([0])), Side(layout([1])), TensorSpec(ndim=ndim),
                    **({"timeout_s": FAIL_TIMEOUT_S} | options))


def spec(ndim=3, dtype=FLOAT, **sides) -> TensorSpec:
    return TensorSpec(ndim=ndim, dtype=dtype, **sides)


# ------------------------------------------------------------------------- plans by brute force


def brute_force_pieces(key, shape, spec: TensorSpec, source: Side, destination: Side, rank: int, first_index: int,
                       rows: Rows = Rows()):
    """The pieces of ``boundary_plan.plan_pieces`` the slow way: every rank's box on both sides, ranks with
    equal boxes grouped, every pair of groups intersected (what the planner did before it searched by
    intervals; quadratic in the world)."""
    import itertools
    import math

    from hetero.parallel.boundary_plan import Piece, dim_overlaps, rank_box

    def groups(sharding, side, counts):
        found: dict = {}
        for r, coord in side.layout.coords():
            if coord.pp == side.stage:
                found.setdefault(rank_box(shape, sharding, side.layout, coord, counts), []).append(r)
        return [(box, tuple(members)) for box, members in found.items()]

    pieces = []
    for dst_box, dst_ranks in groups(spec.destination, destination, rows.destination):
        for src_box, src_ranks in groups(spec.source, source, rows.source):
            if rank not in dst_ranks and rank not in src_ranks:
                continue
            per_dim = [dim_overlaps(s, d) for s, d in zip(src_box, dst_box)]
            if not all(per_dim):
                continue
            pieces.append(Piece(index=first_index + len(pieces), key=key, dtype=spec.dtype,
                                blocks=tuple(itertools.product(*per_dim)),
                                numel=math.prod(sum(run.length for run in runs) for runs in per_dim),
                                senders=src_ranks, receivers=tuple(r for r in dst_ranks if r not in src_ranks),
                                local=tuple(r for r in dst_ranks if r in src_ranks)))
    return pieces
