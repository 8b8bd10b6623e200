"""One rank's timeline of the steps it traces, in the Chrome trace format (chrome://tracing, Perfetto).

A span per action of the schedule (``F``/``B``/``EF``/``EB``, category ``action``), a span per
forward or backward's math inside it (``compute``: what ``ModuleTimer`` counts) and one per part of
the step's end (``step_end``: the loss check, replica syncs, clip, optimizer). Everything else in a
step (Python between actions, the wait for the last sends) is the gap between spans.

Times are host wall-clock times. On the CPU that is when the work ran; on CUDA it is when the work was
queued, so for a GPU timeline run ``torch.profiler`` instead: every span is also a
``record_function`` range, so the profiler's trace names the same actions.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

CATEGORIES = ("action", "compute", "step_end")


@dataclass(frozen=True)
class Span:
    name: str
    category: str
    start: float  # seconds, perf_counter
    end: float


class StepTrace:
    def __init__(self, rank: int):
        self.rank = rank
        self.spans: list[Span] = []
        self.steps: list[Span] = []  # one per traced step

    @contextlib.contextmanager
    def span(self, name: str, category: str) -> Iterator[None]:
        with torch.profiler.record_function(name):
            start = time.perf_counter()
            yield
            self.spans.append(Span(name, category, start, time.perf_counter()))

    @contextlib.contextmanager
    def step(self, number: int) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.steps.append(Span(f"step {number}", "step", start, time.perf_counter()))

    def breakdown(self) -> dict[str, float]:
        """Seconds over the traced steps: ``step`` (their wall time), ``compute``, ``stage_links`` (inside
        ``F``/``B`` but outside their math: waiting for and posting stage messages), ``edges`` (``EF``/``EB``
        calls), ``step_end`` and ``other`` (what no span covers)."""
        total = defaultdict(float)
        for span in self.spans:
            seconds = span.end - span.start
            if span.category == "action":
                total["edges" if span.name.startswith("E") else "stage_actions"] += seconds
            else:
                total[span.category] += seconds
        step = sum(s.end - s.start for s in self.steps)
        stage_links = total["stage_actions"] - total["compute"]
        other = step - total["stage_actions"] - total["edges"] - total["step_end"]
        return {"step": step, "compute": total["compute"], "stage_links": stage_links, "edges": total["edges"],
                "step_end": total["step_end"], "other": other}

    def last_step(self) -> StepTrace:
        """A trace of the last traced step alone."""
        last = StepTrace(self.rank)
        last.steps = self.steps[-1:]
        last.spans = [s for s in self.spans if s.start >= last.steps[0].start] if last.steps else []
        return last

    def chrome_events(self, origin: float) -> list[dict]:
        """This rank's spans as complete events (``ph: X``), the rank as pid, in microseconds after
        ``origin`` (a ``perf_counter`` time: ranks on one host share the clock)."""
        events = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}]
        lanes = {"step": 0, "action": 1, "step_end": 1, "compute": 2}
        for span in [*self.steps, *self.spans]:
            events.append({"name": span.name, "cat": span.category, "ph": "X", "pid": self.rank,
                           "tid": lanes[span.category], "ts": (span.start - origin) * 1e6,
                           "dur": (span.end - span.start) * 1e6})
        return events


def write_chrome_trace(path: Path, traces: list[StepTrace]) -> None:
    """Write every rank's trace as one file, from the earliest traced step's start."""
    origin = min((t.steps[0].start for t in traces if t.steps), default=0.0)
    events = [event for trace in traces for event in trace.chrome_events(origin)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
