"""Boundary traffic: hetero's boundary, run on gloo ranks, against a leader-and-broadcast bridge.

    python -m hetero.bench.boundary

For each case a [batch, seq, hidden] fp32 activation crosses from a source layout to a destination
layout once (forward). hetero's figures are read from the counters of a ``Boundary`` that really ran
on 8 gloo ranks (the destination shards are checked too). The leader bridge's figures are computed
here for the same case, modelled on Megatron core's bridge communicator: one leader per source DP
replica (its TP/CP rank 0) sends that replica's rows to one leader per destination DP replica, which
then broadcasts them across its TP group (a flat broadcast: the leader sends one copy per peer), each
payload preceded by a shape message (int64 per dim); four sequential rounds (shape, payload, shape
broadcast, payload broadcast; two without destination TP). It supports CP = 1, sequence parallelism
off, DP ratios that divide, and batches that split evenly; elsewhere it prints "unsupported". (A tree
or pipelined broadcast would spread the leader's broadcast load, at the price of more rounds.)

hetero takes one round of pairing headers (call and shapes, both ways on each crossing link, checked on
both sides before any payload moves: its meta bytes), one crossing round, plus one completion round
where destination ranks are replicas of one another.

Definitions (payload bytes; headers and shape messages are listed apart as "meta"):
- cross: bytes sent between different processes from the source module to the destination module.
  Minimum: every element some destination rank lacks in its own process, once ("tensor bytes once"
  when the placements are disjoint; less where ranks hold data on both sides).
- total: cross plus intra-module bytes (completion inside a module), i.e. all bytes received.
  Ideal: every destination rank receives each element it needs and does not already hold, once.
- max send / max recv: the largest payload any single rank sends / receives.
- rounds: sequential communication rounds on the critical path (the most any rank takes part in).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from hetero.parallel.boundary import Boundary, Sharding, Side, TensorSpec
from hetero.parallel.context import zigzag_indices
from hetero.parallel.layout import Coord, Layout
from hetero.testing.multiprocess import run_ranks

WORLD_SIZE = 8
SEQ, HIDDEN = 64, 128
ELEMENT = 4  # fp32
SHAPE_WORD = 8  # the leader bridge's shape messages: one int64 per dim


@dataclass(frozen=True)
class BenchCase:
    name: str
    source: Layout
    destination: Layout
    batch: int = 8
    source_sharding: Sharding = Sharding()
    destination_sharding: Sharding = Sharding()

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.batch, SEQ, HIDDEN)

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(ndim=3, source=self.source_sharding, destination=self.destination_sharding)


@dataclass(frozen=True)
class Figures:
    cross: int
    total: int
    max_send: int
    max_recv: int
    rounds: int
    meta: int


def lay(first: int, count: int, tp: int = 1, cp: int = 1, dp: int = 1) -> Layout:
    return Layout(tp=tp, cp=cp, dp=dp, pp=1, ranks=tuple(range(first, first + count)))


CASES = [
    BenchCase("colocated tp1dp4 -> tp2dp2", lay(0, 4, dp=4), lay(0, 4, tp=2, dp=2)),
    BenchCase("colocated tp2dp2 -> tp4", lay(0, 4, tp=2, dp=2), lay(0, 4, tp=4)),
    BenchCase("disjoint dp2 -> tp2dp2", lay(0, 2, dp=2), lay(2, 4, tp=2, dp=2)),
    BenchCase("overlapping dp4 -> tp2dp2", lay(0, 4, dp=4), lay(2, 4, tp=2, dp=2)),
    BenchCase("dp 1:2  tp2 -> dp2", lay(0, 2, tp=2), lay(2, 2, dp=2)),
    BenchCase("dp 2:1  dp2 -> tp2", lay(0, 2, dp=2), lay(2, 2, tp=2)),
    BenchCase("dp 4:2  dp4 -> tp2dp2", lay(0, 4, dp=4), lay(4, 4, tp=2, dp=2)),
    BenchCase("dp 3:2  dp3 -> tp2dp2", lay(0, 3, dp=3), lay(3, 4, tp=2, dp=2), batch=6),
    BenchCase("dp 1:4  dp1 -> tp4", lay(0, 1), lay(1, 4, tp=4)),
    BenchCase("tp both  tp2dp2 -> tp4", lay(0, 4, tp=2, dp=2), lay(4, 4, tp=4)),
    BenchCase("cp source  cp2dp2 -> tp2dp2", lay(0, 4, cp=2, dp=2), lay(4, 4, tp=2, dp=2)),
    BenchCase("cp dest  dp2 -> cp2dp2", lay(0, 2, dp=2), lay(2, 4, cp=2, dp=2)),
    BenchCase("cp both  tp2cp2 -> cp2dp2", lay(0, 4, tp=2, cp=2), lay(4, 4, cp=2, dp=2)),
    BenchCase(
        "sp dest  dp2 -> tp2dp2 sp",
        lay(0, 2, dp=2),
        lay(2, 4, tp=2, dp=2),
        destination_sharding=Sharding(sequence_parallel=True),
    ),
    BenchCase("uneven  5 rows dp2 -> tp2dp2", lay(0, 2, dp=2), lay(2, 4, tp=2, dp=2), batch=5),
]


# ------------------------------------------------------------------------------ what ranks hold


def held_indices(shape: tuple[int, ...], sharding: Sharding, layout: Layout, rank: int) -> list[torch.Tensor]:
    """Per dim, the global indices a rank holds (the bench's own slicing, independent of the plan)."""
    coord = layout.coord(rank)
    assert coord is not None
    index = [torch.arange(n) for n in shape]
    if sharding.batch_dim is not None:
        index[sharding.batch_dim] = index[sharding.batch_dim].tensor_split(layout.dp)[coord.dp]
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


def mask(shape: tuple[int, ...], index: list[torch.Tensor]) -> torch.Tensor:
    result = torch.zeros(shape, dtype=torch.bool)
    result[torch.meshgrid(*index, indexing="ij")] = True
    return result


def ideal(case: BenchCase) -> tuple[int, int]:
    """(minimum cross bytes, ideal total bytes) from what each destination rank lacks locally."""
    shape = case.shape
    held = {
        r: mask(shape, held_indices(shape, case.source_sharding, case.source, r)) for r in case.source.ranks
    }
    lacking_anywhere = torch.zeros(shape, dtype=torch.bool)
    total = 0
    for rank in case.destination.ranks:
        need = mask(shape, held_indices(shape, case.destination_sharding, case.destination, rank))
        lacking = need & ~held.get(rank, torch.zeros(shape, dtype=torch.bool))
        lacking_anywhere |= lacking
        total += int(lacking.sum()) * ELEMENT
    return int(lacking_anywhere.sum()) * ELEMENT, total


# ------------------------------------------------------------------------------ the leader model


def leader_figures(case: BenchCase) -> Figures | str:
    """The leader-and-broadcast bridge's traffic for ``case``, or why it cannot run it."""
    src, dst = case.source, case.destination
    if src.cp > 1 or dst.cp > 1:
        return "unsupported (CP > 1)"
    if case.source_sharding.sequence_parallel or case.destination_sharding.sequence_parallel:
        return "unsupported (sequence parallel)"
    if max(src.dp, dst.dp) % min(src.dp, dst.dp):
        return f"unsupported (DP {src.dp} -> {dst.dp})"
    if case.batch % src.dp or case.batch % dst.dp:
        return "unsupported (uneven batch: wrong shapes)"
    row = SEQ * HIDDEN * ELEMENT
    sent = dict.fromkeys(set(src.ranks) | set(dst.ranks), 0)
    received = dict(sent)
    cross = meta = 0

    def move(a: int, b: int, nbytes: int) -> None:
        if a != b:  # the same process: a local copy, counted as free
            sent[a] += nbytes
            received[b] += nbytes

    src_leaders = [src.rank_at(Coord(tp=0, cp=0, dp=i, pp=0)) for i in range(src.dp)]
    dst_leaders = [dst.rank_at(Coord(tp=0, cp=0, dp=j, pp=0)) for j in range(dst.dp)]
    for i, leader in enumerate(src_leaders):
        if src.dp >= dst.dp:
            targets, rows = [dst_leaders[i // (src.dp // dst.dp)]], case.batch // src.dp
        else:
            ratio = dst.dp // src.dp
            targets, rows = dst_leaders[i * ratio : (i + 1) * ratio], case.batch // dst.dp
        for target in targets:
            move(leader, target, rows * row)
            cross += rows * row if leader != target else 0
            meta += 3 * SHAPE_WORD if leader != target else 0
    for j, leader in enumerate(dst_leaders):
        peers = [dst.rank_at(Coord(tp=t, cp=0, dp=j, pp=0)) for t in range(1, dst.tp)]
        for peer in peers:
            move(leader, peer, case.batch // dst.dp * row)
            meta += 3 * SHAPE_WORD
    return Figures(
        cross=cross,
        total=sum(received.values()),
        max_send=max(sent.values()),
        max_recv=max(received.values()),
        rounds=4 if dst.tp > 1 else 2,
        meta=meta,
    )


# ------------------------------------------------------------------------------ hetero, measured


def measure_ranks(rank: int, world_size: int, cases: list[BenchCase]) -> dict[str, dict]:
    """On every rank: run each case's boundary once to warm up and once counted; check the shards."""
    results = {}
    for case in cases:
        boundary = Boundary(case.name, Side(case.source), Side(case.destination), case.spec, timeout_s=120)
        full = torch.arange(case.batch * SEQ * HIDDEN, dtype=torch.float32).reshape(case.shape)
        x = None
        if boundary.is_source:
            x = full[
                torch.meshgrid(
                    *held_indices(case.shape, case.source_sharding, case.source, rank), indexing="ij"
                )
            ]
        boundary.forward(x, case.shape)
        boundary.reset_counters()
        started = time.perf_counter()
        out = boundary.forward(x, case.shape).output
        seconds = time.perf_counter() - started
        if boundary.is_destination:
            index = held_indices(case.shape, case.destination_sharding, case.destination, rank)
            if not torch.equal(out, full[torch.meshgrid(*index, indexing="ij")]):
                raise AssertionError(f"{case.name}: rank {rank} received a wrong shard")
        results[case.name] = {"counters": boundary.counters(), "seconds": seconds}
    return results


def hetero_figures(per_rank: list[dict[str, int]]) -> Figures:
    def get(counters: dict[str, int], *kinds: str) -> int:
        return sum(counters[f"forward.{kind}"] for kind in kinds)

    return Figures(
        cross=sum(get(c, "cross_sent_bytes") for c in per_rank),
        total=sum(get(c, "cross_recv_bytes", "intra_recv_bytes") for c in per_rank),
        max_send=max(get(c, "cross_sent_bytes", "intra_sent_bytes") for c in per_rank),
        max_recv=max(get(c, "cross_recv_bytes", "intra_recv_bytes") for c in per_rank),
        rounds=max(get(c, "rounds") for c in per_rank),
        meta=sum(get(c, "header_sent_bytes") for c in per_rank),
    )


# ------------------------------------------------------------------------------------ reporting


def kib(nbytes: int) -> str:
    return f"{nbytes / 1024:.0f}K"


def row(figures: Figures | str) -> str:
    if isinstance(figures, str):
        return f"{figures:<52}"
    f = figures
    sizes = f"{kib(f.cross):>7} {kib(f.total):>7} {kib(f.max_send):>6} {kib(f.max_recv):>6}"
    return f"{sizes} {f.rounds:>3} {f.meta:>6}"


@dataclass(frozen=True)
class Outcome:
    case: BenchCase
    hetero: Figures
    leader: Figures | str  # a reason where the leader bridge cannot run the case
    minimum_cross: int
    ideal_total: int


def print_table(outcomes: list[Outcome]) -> None:
    header = f"{'cross':>7} {'total':>7} {'send':>6} {'recv':>6} {'rnd':>3} {'meta B':>6}"
    print(f"{'case':<30} {'tensor':>6} {'min x':>6} {'ideal':>6} | hetero {header} | leader {header}")
    for o in outcomes:
        tensor = o.case.batch * SEQ * HIDDEN * ELEMENT
        targets = f"{kib(tensor):>6} {kib(o.minimum_cross):>6} {kib(o.ideal_total):>6}"
        print(f"{o.case.name:<30} {targets} | hetero {row(o.hetero)} | leader {row(o.leader)}")


def checks(outcomes: list[Outcome]) -> list[tuple[str, bool]]:
    supported = [o for o in outcomes if isinstance(o.leader, Figures)]
    broadcasting = [o for o in supported if o.case.destination.tp > 1]
    equal = [
        o.case.name
        for o in broadcasting
        if (o.hetero.max_send, o.hetero.max_recv) == (o.leader.max_send, o.leader.max_recv)  # type: ignore[union-attr]
    ]
    return [
        (
            "hetero cross-module bytes equal the minimum on every case",
            all(o.hetero.cross == o.minimum_cross for o in outcomes),
        ),
        (
            "hetero total bytes equal the ideal on every case",
            all(o.hetero.total == o.ideal_total for o in outcomes),
        ),
        (
            f"hetero's largest per-rank send and receive are never above the leader's on the "
            f"{len(supported)} cases it supports; lower on {len(broadcasting) - len(equal)} of the "
            f"{len(broadcasting)} where it broadcasts (equal: {', '.join(equal) or 'none'})",
            all(
                o.hetero.max_send <= o.leader.max_send and o.hetero.max_recv <= o.leader.max_recv  # type: ignore[union-attr]
                for o in supported
            ),
        ),
        (
            f"hetero needs no more rounds than the leader on the {len(supported)} cases it supports (its "
            f"pairing headers take one), fewer on {sum(o.hetero.rounds < o.leader.rounds for o in supported)} "  # type: ignore[union-attr]
            f"of them",
            all(o.hetero.rounds <= o.leader.rounds for o in supported),  # type: ignore[union-attr]
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.parse_args(argv)
    started = time.monotonic()
    per_rank = run_ranks(measure_ranks, WORLD_SIZE, CASES, timeout_s=170)
    outcomes = [
        Outcome(
            case,
            hetero_figures([r[case.name]["counters"] for r in per_rank]),
            leader_figures(case),
            *ideal(case),
        )
        for case in CASES
    ]
    print(
        f"[batch, {SEQ}, {HIDDEN}] fp32 activation, forward, {WORLD_SIZE} gloo ranks. KiB except meta "
        f"(bytes); min x = minimum cross bytes, ideal = ideal total, send/recv = largest per rank, "
        f"rnd = rounds"
    )
    print_table(outcomes)
    print(
        "(the leader's cross can sit below the minimum on colocated cases: it counts rows a destination "
        "leader already holds and re-broadcasts as intra-module)\n"
    )
    results = checks(outcomes)
    for text, ok in results:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    print(f"({time.monotonic() - started:.0f} s)")
    return 0 if all(ok for _, ok in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
