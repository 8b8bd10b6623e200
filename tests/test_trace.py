"""Per-rank step traces (``hetero/runtime/trace.py``): on 2 ranks, a colocated VLM with the LLM pp2 under
one 1F1B over the graph, a traced step records each of the rank's scheduled actions once and in order,
each forward's and backward's math inside its action, the step's end after the actions; the parts of
the breakdown add up to the step; the Chrome trace holds both ranks; evaluation is not traced and the
traced step trains as the untraced one would."""

import json

import torch

from test_vlm_parity import batches, vlm_experiment

from hetero.testing.kinds import build_runtime
from hetero.runtime.trace import write_chrome_trace
from hetero.testing.multiprocess import run_ranks

LAYOUTS = {"vision": {"dp": 2}, "llm": {"pp": 2, "dp": 1}}


def traced(rank, world_size):
    runtime = build_runtime(vlm_experiment(2, LAYOUTS, 8, 4, schedule="graph_1f1b"))
    data = batches(8)[:2]
    first = runtime.train_step(data[0])
    trace = runtime.start_trace()
    runtime.evaluate(data[:1])
    second = runtime.train_step(data[1])
    assert runtime.stop_trace() is trace and runtime.trace is None
    return runtime.graph.schedule, [str(a) for a in runtime.actions[True]], trace, (first["loss"], second["loss"])


def untraced(rank, world_size):
    runtime = build_runtime(vlm_experiment(2, LAYOUTS, 8, 4, schedule="graph_1f1b"))
    return tuple(runtime.train_step(batch)["loss"] for batch in batches(8)[:2])


def test_a_traced_step_records_every_action_its_math_and_the_step_end(tmp_path):
    results = run_ranks(traced, 2)
    assert [losses for *_, losses in results] == run_ranks(untraced, 2)
    for rank, (schedule, actions, trace, _) in enumerate(results):
        assert schedule == "graph_1f1b" and trace.rank == rank and len(trace.steps) == 1
        step = trace.steps[0]
        spans = sorted(trace.spans, key=lambda s: s.start)
        assert all(step.start <= s.start <= s.end <= step.end for s in spans)
        assert [s.name for s in spans if s.category == "action"] == actions  # once each, in order, no evaluation
        math = [s for s in spans if s.category == "compute"]
        for span in math:  # inside the F or B of its module
            outer = [a for a in spans if a.category == "action" and a.start <= span.start and span.end <= a.end]
            assert len(outer) == 1 and outer[0].name.split(" ")[:2] in (["F", span.name], ["B", span.name])
        assert len(math) == sum(a.split(" ")[0] in ("F", "B") for a in actions)
        ends = [s for s in spans if s.category == "step_end"]
        last_action = max(s.end for s in spans if s.category == "action")
        assert [s.name for s in ends] == ["loss and non-finite check", "vision replica sync", "llm replica sync",
                                          "clip", "vision optimizer", "llm optimizer"]
        assert all(s.start >= last_action for s in ends)
        parts = trace.breakdown()
        assert parts["compute"] > 0 and parts["step_end"] > 0 and parts["other"] >= 0 and parts["stage_links"] >= 0
        total = sum(parts[p] for p in ("compute", "stage_links", "edges", "step_end", "other"))
        assert abs(total - parts["step"]) < 1e-9
    path = tmp_path / "step.json"
    write_chrome_trace(path, [trace for _, _, trace, _ in results])
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in events if e["ph"] == "X")
    assert len([e for e in events if e["ph"] == "X"]) == sum(len(t.spans) + 1 for _, _, t, _ in results)
    assert torch.isfinite(torch.tensor([loss for *_, losses in results for loss in losses])).all()
