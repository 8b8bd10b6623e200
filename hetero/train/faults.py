"""When one rank fails, every rank stops soon, and the job says which rank and module failed.

``FaultGuard`` wraps a job's work after the process group exists:

- every rank bumps a heartbeat counter in the job's store once a second (a background thread);
- a rank whose code raises records its error in the store, prints a report and exits non-zero at once
  (no interpreter shutdown: its peers may be blocked in a collective with it); so does a rank whose data
  worker died, though torch may report that inside a collective;
- a rank whose collective fails because a peer died reads the store: a peer that recorded an error is
  named with that error; otherwise the peers whose heartbeats stopped without their marking an exit are
  named as the ones that died (or hang);
- a rank that the launcher stops (torchrun sends SIGTERM to the others when one rank exits) does the same
  before it exits (SIGTERM and SIGCHLD are unblocked, whatever mask the job inherited);
- a watchdog thread ends the rank when one step (``guard.step``) runs longer than ``timeout_s`` (a peer
  that hangs without dying), naming the peers whose heartbeats stopped.

Under torchrun the first rank to exit makes the launcher stop the others; with ``--max-restarts`` it
starts them again and ``train.checkpoint.resume=auto`` continues from the newest checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Iterator

import torch.distributed as dist

from hetero.parallel.placement import Placement

HEARTBEAT_S = 1.0
DATA_WORKER = "DataLoader worker"  # how torch names a data worker that died (``train.data.workers``)


class NonFiniteError(RuntimeError):
    """A step's loss or gradients were not finite and ``train.nonfinite=stop``."""


def describe_rank(placement: Placement, rank: int) -> str:
    """``rank 3 (llm tp1 pp1 dp0; vision dp3)``: a rank and its place in every module it runs."""
    roles = []
    for name in placement.modules_on(rank):
        layout, coord = placement.layouts[name], placement.coord(name, rank)
        axes = [f"{axis}{getattr(coord, axis)}" for axis in ("tp", "cp", "pp", "dp") if getattr(layout, axis) > 1]
        roles.append(" ".join([name, *axes]))
    return f"rank {rank} ({'; '.join(roles) or 'no module'})"


class FaultGuard:
    def __init__(self, placement: Placement, timeout_s: float):
        self.placement, self.timeout_s = placement, timeout_s
        self.rank = dist.get_rank()
        # The store the process group was created with (torch has no public accessor): under torchrun the
        # agent hosts it, so it outlives any worker.
        self.store = dist.distributed_c10d._get_default_store()
        self.prefix = f"hetero/faults/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.current: tuple[str, float] | None = None  # (what, since) while a step runs
        self._stop = threading.Event()
        self._exiting = threading.Lock()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(Exception):
                self.store.add(f"{self.prefix}heartbeat/{self.rank}", 1)

    def _watch(self) -> None:
        while not self._stop.wait(1.0):
            current = self.current
            if current is not None and time.monotonic() - current[1] > self.timeout_s:
                self._exit(f"{current[0]} did not finish within timeout_s={self.timeout_s:g} s", None)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Guard the job's work: any exception ends this rank with a report naming the failed rank."""
        # SIGTERM is handled on a thread: Python runs signal handlers only on the main thread, between
        # bytecodes, so a rank blocked in a collective would not react until the collective returns. The
        # interpreter's C handler writes the signal number to the wakeup socket at once.
        # A blocked signal mask outlives fork and exec: a job started by a process that blocks SIGCHLD or
        # SIGTERM (a CI runner, a supervisor) would never see the launcher's stop nor torch's data-worker
        # watch (its SIGCHLD handler), and would wait out the DataLoader's timeout after a worker died.
        previous_mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGCHLD})
        wake_read, wake_write = socket.socketpair()
        wake_write.setblocking(False)
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
        previous_fd = signal.set_wakeup_fd(wake_write.fileno(), warn_on_full_buffer=False)
        threads = [threading.Thread(target=fn, daemon=True) for fn in (self._beat, self._watch)]
        threads.append(threading.Thread(target=self._terminated, args=(wake_read,), daemon=True))
        for thread in threads:
            thread.start()
        try:
            yield
        except BaseException as err:  # noqa: BLE001 - every failure ends the rank the same way
            self._exit(f"{type(err).__name__}: {err}", err)
        finally:
            self._stop.set()
            signal.set_wakeup_fd(previous_fd)
            signal.signal(signal.SIGTERM, previous)
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
            wake_write.close()
            # Joined, not left as daemons: a daemon thread still inside a store call when the interpreter
            # finalizes aborts the process ("terminate called without an active exception").
            for thread in threads:
                thread.join(timeout=HEARTBEAT_S + 5.0)

    def _terminated(self, wake: socket.socket) -> None:
        """The launcher stops the surviving ranks when one exits: say which peer it was first."""
        with contextlib.suppress(OSError):
            while True:
                woken = wake.recv(64)
                if not woken:  # the guard closed its end: the job is over
                    return
                if signal.SIGTERM in woken:
                    break
            self._exit("stopped by the launcher (SIGTERM), as another rank ended", None)

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        """Mark a bounded piece of work (a training step, an evaluation) for the watchdog."""
        self.current = (what, time.monotonic())
        yield
        self.current = None  # left set when the step raises: the report names it

    def _silent_peers(self) -> list[int]:
        """Peers whose heartbeat counter did not move over three heartbeats (dead or hung)."""
        with contextlib.suppress(Exception):
            keys = [f"{self.prefix}heartbeat/{r}" for r in range(dist.get_world_size())]
            before = [self.store.add(k, 0) for k in keys]
            time.sleep(3 * HEARTBEAT_S)
            after = [self.store.add(k, 0) for k in keys]
            silent = [r for r, (a, b) in enumerate(zip(before, after)) if a == b and r != self.rank]
            return [r for r in silent if not self.store.check([f"{self.prefix}exiting/{r}"])]  # not stopping cleanly
        return []

    def _recorded_errors(self) -> dict[int, str]:
        errors = {}
        for peer in range(dist.get_world_size()):
            key = f"{self.prefix}error/{peer}"
            with contextlib.suppress(Exception):
                if peer != self.rank and self.store.check([key]):
                    errors[peer] = self.store.get(key).decode()
        return errors

    def _exit(self, message: str, err: BaseException | None) -> None:
        if not self._exiting.acquire(blocking=False):  # another thread is already reporting and exiting
            time.sleep(3600)
        if threading.current_thread() is threading.main_thread():
            # torch's data loader raises from its SIGCHLD handler wherever the main thread is when a worker
            # dies; raised inside the report it would end the rank without one
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        try:
            self._report(message, err)
        except BaseException:  # noqa: BLE001 - an exception raised asynchronously into the report: once more
            with contextlib.suppress(BaseException):
                self._report(message, err)
        os._exit(1)

    def _report(self, message: str, err: BaseException | None) -> None:
        """Record this rank's failure in the store and print its report (naming the peer it started at)."""
        with contextlib.suppress(Exception):
            self.store.set(f"{self.prefix}exiting/{self.rank}", message)
        own = describe_rank(self.placement, self.rank)
        step = f" in {self.current[0]}" if self.current else ""
        lines = [f"hetero: {own} failed{step}: {message}"]
        communication = err is None or isinstance(err, (dist.DistBackendError, dist.DistNetworkError)) or (
            isinstance(err, RuntimeError) and any(w in str(err) for w in ("Connection", "Gloo", "gloo", "peer"))
        )
        if err is not None and DATA_WORKER in str(err):  # this rank's data worker died, wherever that surfaced
            communication = False
        detail = ""
        if not communication:
            with contextlib.suppress(Exception):
                self.store.set(f"{self.prefix}error/{self.rank}", f"{own}: {message}")
            detail = "".join(traceback.format_exception(err))
        else:
            recorded = self._recorded_errors()
            if recorded:
                lines += [f"hetero: the failure started at {text}" for text in recorded.values()]
            else:
                silent = self._silent_peers()
                lines += [
                    f"hetero: {describe_rank(self.placement, peer)} stopped responding (its process died or hangs)"
                    for peer in silent
                ]
        # Whole lines in single writes: ranks share the launcher's pipe, and print writes its closing "\n"
        # separately, so another rank's report could begin in the middle of this one's last line. The
        # summary stays short enough for one atomic pipe write; the traceback follows in its own.
        sys.stderr.flush()
        for text in ("\n".join(lines) + "\n", detail):
            if text:
                os.write(sys.stderr.fileno(), text.encode())
