"""Phased against one 1F1B over the graph, side by side on 2 ranks (one per core: an idle rank is an idle core).

    hetero bench schedules [--steps 4] [--alternations 3]

Placements:
- ``full graph``: the shipped ``full_graph`` experiment with the vision and DNA encoders and the video
  generator on rank 0, the LLM on rank 1 (phased, rank 1 waits for the encoders and rank 0 for the LLM);
- ``colocated VLM``: the shipped ``colocated_vlm`` with the LLM pp2 over ranks 0-1 and the vision encoder
  dp2 on both, 4 microbatches (phased, the encoder runs before and after the whole pipeline).

Each placement trains under both schedules, alternating ``--alternations`` times (one warmup step, then
``--steps`` timed steps each time, traced: ``hetero/runtime/trace.py``). Reported per schedule: the median
step time (the slowest rank's) over every timed step, and from each rank's trace its busy fraction (the
forwards' and backwards' math over its step time) and where the rest of its step goes, in ms per step:
stage links (inside a stage's forward or backward, waiting for or posting its pipeline messages), edge
calls (boundary transfers, their waits included), the step's end (loss check, replica syncs, clip,
optimizer) and other (Python between actions, the wait for the last sends). ``--trace-dir`` writes the
last timed step of each run as a Chrome trace, both ranks in one file. Ratios are measured side by side
in one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hetero.bench.ranks import each_rank, launched_by_torchrun
from hetero.bench.throughput import absolute_paths
from hetero.config import ExperimentConfig, load_experiment
from hetero.graph import Graph, build_graph
from hetero.models import default_registry
from hetero.runtime.schedule import Action, edge_ranks, edge_receivers, edge_senders
from hetero.runtime.trace import StepTrace, write_chrome_trace
from hetero.testing.multiprocess import run_ranks

SCHEDULES = ("phased", "graph_1f1b")
PLACEMENTS = {
    "full graph (encoders + generator on rank 0, LLM on rank 1)": (
        "full_graph", ["world_size=2", "vision.layout.dp=1", "dna.layout.dp=1", "video.layout.dp=1",
                       "video.layout.offset=0", "llm.layout.tp=1", "llm.layout.pp=1", "llm.layout.offset=1",
                       "batch.global_batch_size=8", "batch.micro_batch_size=2", "llm.micro_batch_size=2"]),
    "colocated VLM (LLM pp2 on ranks 0-1, vision dp2)": (
        "colocated_vlm", ["world_size=2", "vision.layout.dp=2", "llm.layout.tp=1", "llm.layout.dp=1",
                          "llm.layout.pp=2", "batch.global_batch_size=16", "batch.micro_batch_size=4",
                          "vision.micro_batch_size=2"]),
}


PARTS = ("compute", "stage_links", "edges", "step_end", "other")


def measure(rank: int, world_size: int, experiment: ExperimentConfig, steps: int) -> StepTrace:
    """This rank's trace of ``steps`` training steps, after a warmup step, each entered after a barrier."""
    from hetero.runtime import build_runtime
    from hetero.data.splits import load_splits

    runtime = build_runtime(experiment, default_registry())
    data = load_splits(experiment, runtime.graph, ("train",))["train"]
    runtime.train_step(data.batch(0))  # warmup
    runtime.start_trace()
    for step in range(1, steps + 1):
        dist.barrier()
        runtime.train_step(data.batch(step))
    return runtime.stop_trace()


def peer_waits(graph: Graph, traces: list[StepTrace]) -> list[float]:
    """Per rank, the seconds its edge calls spent before the ranks they wait for had entered them (under
    ``phased`` every rank of the call; otherwise, on a rank that takes data in, the ranks that send it):
    waiting for a peer, as opposed to moving the data."""
    entries: dict[tuple[int, int, str], float] = {}  # (rank, step, action) -> start
    for trace in traces:
        for step, span in _edge_spans(trace):
            entries[(trace.rank, step, span.name)] = span.start
    waits = [0.0] * len(traces)
    for trace in traces:
        for step, span in _edge_spans(trace):
            op, target, m = span.name.split(" ")
            action, edge = Action(op, target, int(m)), next(e for e in graph.edges if e.name == target)
            if graph.schedule == "phased":
                peers = edge_ranks(graph, edge)
            elif trace.rank in edge_receivers(graph, action):
                peers = edge_senders(graph, action) if op == "EB" else edge_ranks(graph, edge)
            else:
                continue
            last = max(entries[(r, step, span.name)] for r in peers)
            waits[trace.rank] += min(max(last - span.start, 0.0), span.end - span.start)
    return waits


def _edge_spans(trace: StepTrace):
    for step, bounds in enumerate(trace.steps):
        for span in trace.spans:
            if span.category == "action" and span.name.startswith("E") and bounds.start <= span.start <= bounds.end:
                yield step, span


def send_progress(rank: int, world_size: int, sender_computes: bool, trials: int = 16) -> list[float]:
    """How long a receive takes (ms from posting it; rank 0's figures) when the peer posted the send 2 ms
    earlier, while this rank computed, and then sleeps or computes for 10 ms. Under graph_1f1b a rank
    posts an edge's send and goes on computing while the receiver finishes its own work: this is what
    the receiver pays per call for the sender's being busy."""
    import torch

    def compute(ms: float) -> None:
        a, start = torch.randn(64, 64), time.perf_counter()
        while time.perf_counter() - start < ms / 1e3:
            a = (a @ a).tanh()

    late = []
    buffer = torch.zeros(256)
    for _ in range(trials):
        dist.barrier()
        if rank == 1:
            work = dist.isend(torch.ones(256), 0)
            compute(10) if sender_computes else time.sleep(0.010)
            work.wait()
        else:
            compute(2)
            posted = time.perf_counter()
            dist.irecv(buffer, 1).wait()
            late.append((time.perf_counter() - posted) * 1e3)
    return late


def run(steps: int, alternations: int, trace_dir: Path | None = None) -> dict[str, dict[str, dict[str, Any]]] | None:
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for label, (name, overrides) in PLACEMENTS.items():
        runs: dict[str, list[list[StepTrace]]] = {schedule: [] for schedule in SCHEDULES}
        graphs = {}
        for a in range(alternations):
            for schedule in SCHEDULES:
                experiment = absolute_paths(load_experiment(name, [*overrides, f"schedule={schedule}"]))
                graphs[schedule] = build_graph(experiment, default_registry())
                traces = each_rank(measure, experiment, steps, timeout_s=900)
                if traces is None:
                    return None
                runs[schedule].append(traces)
                if trace_dir is not None:
                    write_chrome_trace(trace_dir / f"{name}-{schedule}-run{a + 1}.json", [t.last_step() for t in traces])
        results[label] = {}
        for schedule, repeats in runs.items():
            step_times = [max(s.end - s.start for s in step) for traces in repeats
                          for step in zip(*(t.steps for t in traces))]
            timed = steps * len(repeats)
            per_rank = [{part: sum(traces[rank].breakdown()[part] for traces in repeats) / timed
                         for part in ("step", *PARTS)} for rank in range(2)]
            for rank, waits in enumerate(zip(*(peer_waits(graphs[schedule], traces) for traces in repeats))):
                per_rank[rank]["peer_wait"] = sum(waits) / timed
            results[label][schedule] = {"step_s": statistics.median(step_times), "ranks": per_rank,
                                        "busy": [r["compute"] / r["step"] for r in per_rank]}
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--alternations", type=int, default=3, help="times each schedule runs, in turn")
    parser.add_argument("--trace-dir", type=Path, default=None, help="write each run's last step as a Chrome trace")
    args = parser.parse_args(argv)
    results = run(args.steps, args.alternations, args.trace_dir)
    if results is None:
        return
    for label, by_schedule in results.items():
        print(label)
        base = by_schedule["phased"]["step_s"]
        for schedule, figures in by_schedule.items():
            busy = ", ".join(f"rank {r} {b:.0%}" for r, b in enumerate(figures["busy"]))
            print(f"  {schedule:<11} {figures['step_s'] * 1e3:8.1f} ms/step  x{base / figures['step_s']:.2f} "
                  f"vs phased   busy: {busy}")
        for schedule, figures in by_schedule.items():
            for rank, parts in enumerate(figures["ranks"]):
                spent = "  ".join(f"{part} {parts[part] * 1e3:5.1f}" for part in PARTS)
                print(f"    {schedule:<11} rank {rank} ms/step: {spent}  (edges waiting for a peer "
                      f"{parts['peer_wait'] * 1e3:.1f})")
    if not launched_by_torchrun():
        late = {how: run_ranks(send_progress, 2, how == "computes", comm_rules=False)[0] for how in ("sleeps", "computes")}
        print("a send posted before its receive: the receive takes "
              + ", ".join(f"{statistics.median(t):.1f} ms (worst {max(t):.1f}) if the sender then {how}"
                          for how, t in late.items()) + " (median: on gloo the data moves on the sender's CPU)")


if __name__ == "__main__":
    main()
