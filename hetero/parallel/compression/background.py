"""A DiLoCo round run in the background: on a worker thread, and on an accelerator on a stream of its own.

The round's collectives go over a process group nothing else uses meanwhile (the module's ``grad_sync``
group), and run while the training thread computes. They are *issued* only where the training thread
lets them (``PostingGate``): one at the send and one after each later inner step, the rest where the round
lands. So every rank issues them at the same points among its other collectives, the order NCCL needs
across communicators (a rank that issued them whenever its thread got there could cross another's order
and both would wait forever). Waiting for them, and the codec's work between them, stay on the thread.
On a GPU the round's stream first waits for the work that produced its inputs, and the training stream
waits for the round's stream before it reads the result; both tensors are recorded on the stream that
uses them last, so the caching allocator does not hand their memory out early.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

import torch


class PostingGate:
    """Where the round's thread may issue a collective: each ``let_one_post`` of the training thread lets
    exactly one through (``posting``) and returns once it is issued, or at once when the round is over."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._permit, self._posted = threading.Semaphore(0), threading.Semaphore(0)
        self.over = False

    @contextlib.contextmanager
    def posting(self) -> Iterator[None]:
        """Around issuing one collective, on the round's thread."""
        self._permit.acquire()
        try:
            yield
        finally:
            self._posted.release()

    def end(self) -> None:
        """On the round's thread, when the round returns or raises."""
        self.over = True
        self._posted.release()

    def let_one_post(self) -> None:
        if self.over:
            return
        self._permit.release()
        self._posted.acquire()


class BackgroundRound:
    """At most one round in flight: ``start`` it, ``finish`` it (its result), or ``peek`` at it for a checkpoint."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.Stream(device) if device.type != "cpu" else None
        self.gate = PostingGate()  # the round's collectives issue through it
        self._pool: ThreadPoolExecutor | None = None
        self._flight: Future | None = None

    @property
    def in_flight(self) -> bool:
        return self._flight is not None

    def start(self, round_fn: Callable[..., torch.Tensor | None], *args: Any) -> None:
        if self._flight is not None:
            raise RuntimeError("a DiLoCo round is still in flight; the next starts after it lands")
        if self.stream is not None:
            self.stream.wait_stream(torch.accelerator.current_stream(self.device))
            for arg in args:
                if isinstance(arg, torch.Tensor):
                    arg.record_stream(self.stream)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="hetero-diloco-round")
        self.gate.reset()
        self._flight = self._pool.submit(self._run, round_fn, args)
        self.gate.let_one_post()

    def advance(self) -> None:
        """One inner step later: the round may issue its next collective."""
        if self._flight is not None:
            self.gate.let_one_post()

    def _run(self, round_fn: Callable[..., torch.Tensor | None], args: tuple) -> torch.Tensor | None:
        try:
            if self.stream is None:
                return round_fn(*args)
            torch.accelerator.set_device_index(self.device.index)  # a new thread starts on device 0
            with self.stream:
                return round_fn(*args)
        finally:
            self.gate.end()

    def peek(self) -> torch.Tensor | None:
        """Wait for the round in flight (its error raises here) and return its result, leaving it in flight."""
        assert self._flight is not None
        while not self.gate.over:
            self.gate.let_one_post()
        return self._flight.result()

    def finish(self) -> torch.Tensor | None:
        result = self.peek()
        self._flight = None
        if self.stream is not None:
            current = torch.accelerator.current_stream(self.device)
            current.wait_stream(self.stream)
            if result is not None:
                result.record_stream(current)
        return result

    def restore(self, result: torch.Tensor | None) -> None:
        """A round saved in flight (``peek``), put back in flight by a resumed run."""
        done: Future = Future()
        done.set_result(result)
        self._flight = done
        self.gate.reset()
        self.gate.over = True

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
