"""A simulated network link under a rank's data-parallel collectives: what a slower network would cost.

Each collective also occupies the link for ``latency + wire bytes / bandwidth`` (the bytes this rank sends
by the ring model of ``collective``). The link carries one transfer at a time: one posted while another is
on it starts when that one ends. Whoever waits for a collective's result waits until its transfer is over,
so time spent computing while a transfer is on the link (an overlapped bucket, a DiLoCo round in the
background) is not added to the step, and time spent waiting is: the step time then shows how much of the
communication a method leaves exposed.

    llm:
      parallel:
        simulated_link: {latency_ms: 5, gbit_s: 1}   # off while gbit_s is 0
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch.distributed as dist


@dataclass
class LinkConfig:
    latency_ms: float = 0.0
    gbit_s: float = 0.0  # 0: no simulated link

    @property
    def enabled(self) -> bool:
        return self.gbit_s > 0

    def errors(self, where: str) -> list[str]:
        found = []
        if self.gbit_s < 0:
            found.append(f"{where}.gbit_s={self.gbit_s} must be >= 0 (0: no simulated link)")
        if self.latency_ms < 0:
            found.append(f"{where}.latency_ms={self.latency_ms} must be >= 0")
        elif self.latency_ms and not self.enabled:
            found.append(f"{where}.latency_ms={self.latency_ms} needs a bandwidth: set {where}.gbit_s > 0")
        return found


class SimulatedLink:
    """The link's schedule: when each transfer posted on it ends (``post``), and waiting for that (``wait``)."""

    def __init__(self, config: LinkConfig, clock=time.perf_counter):
        self.latency_s = config.latency_ms / 1e3
        self.bytes_per_s = config.gbit_s * 1e9 / 8
        self.clock = clock
        self.free_at = 0.0
        self.busy_s = 0.0  # time the link spent carrying transfers
        self._lock = threading.Lock()  # a DiLoCo round posts from its own thread

    def post(self, nbytes: int) -> float:
        """Put ``nbytes`` on the link now; return the clock time at which they have arrived."""
        with self._lock:
            start = max(self.clock(), self.free_at)
            duration = self.latency_s + nbytes / self.bytes_per_s
            self.free_at = start + duration
            self.busy_s += duration
            return self.free_at

    def wait(self, until: float) -> None:
        left = until - self.clock()
        if left > 0:
            time.sleep(left)


class LinkedWork:
    """An async collective's work whose ``wait`` also waits for its transfer on the simulated link."""

    def __init__(self, work: dist.Work, link: SimulatedLink, arrives: float):
        self.work, self.link, self.arrives = work, link, arrives

    def wait(self) -> bool:
        done = self.work.wait()
        self.link.wait(self.arrives)
        return done
