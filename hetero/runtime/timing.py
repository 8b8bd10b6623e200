"""Each module's compute time on this rank, without a host sync in the step.

On the CPU a wall clock around each forward and backward. On CUDA the work is only queued when the
Python call returns, so a pair of CUDA events brackets it on the stream instead; their times are read
(waiting for the last event) only when someone asks for the totals, outside the step.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator

import torch


class ModuleTimer:
    def __init__(self, names: Iterable[str], device: torch.device):
        self.device = device
        self._seconds = dict.fromkeys(names, 0.0)
        self._events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = defaultdict(list)

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events[name].append((start, end))
        else:
            tick = time.perf_counter()
            yield
            self._seconds[name] += time.perf_counter() - tick

    def seconds(self) -> dict[str, float]:
        """Seconds so far per module (on CUDA this waits for the recorded work to finish)."""
        for name, pairs in self._events.items():
            if pairs:
                pairs[-1][1].synchronize()
                self._seconds[name] += sum(start.elapsed_time(end) for start, end in pairs) / 1e3
                pairs.clear()
        return dict(self._seconds)
