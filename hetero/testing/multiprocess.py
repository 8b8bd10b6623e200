"""Run a function on N ranks, each a separate process in a real gloo world, under a hard timeout.

``run_ranks(fn, 4, arg)`` calls ``fn(rank, world_size, arg)`` on ranks 0..3 after the default process
group is initialized, and returns each rank's return value. If any rank raises, the other ranks are
killed and ``RankFailure`` carries the first failing rank's traceback. If the ranks do not all finish
within ``timeout_s``, every process is killed and ``RankTimeout`` names the ranks still running (their
Python stacks are dumped to stderr just before). Nothing can hang the caller.

Processes come from a forkserver that has already imported torch and hetero's runtime, so starting 8
ranks is cheap and no thread state of the caller (e.g. OpenMP pools in pytest's process) leaks into the
children.

Every rank records the point-to-point operations and collectives ``fn`` posts, and a run whose traffic
breaks a rule NCCL enforces (``hetero.testing.comm_rules``) raises ``CommRuleViolation`` even though gloo
ran it (``comm_rules=False`` turns the check off).
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

from hetero.testing.comm_rules import Recorder, check

_CONTEXT = mp.get_context("forkserver")
# What nearly every rank imports, so that each fork starts with it: the runtime pulls in DTensor (and
# sympy through it), about 1 CPU-second a rank when imported after the fork. Only imports: nothing here
# may start a thread or an OpenMP pool before the fork (a module that fails to import is skipped).
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "hetero", "hetero.runtime",
                                 "hetero.testing.experiments", "hetero.testing.parity", "hetero.testing.references",
                                 "hetero.testing.full_graph"])


class RankFailure(RuntimeError):
    """A rank raised or died; the message holds that rank's traceback."""

    def __init__(self, rank: int, detail: str):
        super().__init__(f"rank {rank} failed:\n{detail}")
        self.rank = rank
        self.detail = detail


class RankTimeout(TimeoutError):
    """Some ranks did not finish within the timeout and were killed."""


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    backend: str,
    timeout_s: float,
    collective_timeout_s: float,
    args: tuple,
    kwargs: dict,
    results: Any,
    comm_rules: bool,
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    faulthandler.dump_traceback_later(max(1.0, timeout_s - 2.0), exit=False)
    try:
        dist.init_process_group(
            backend=backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout_s),
        )
        recorder = Recorder() if comm_rules else None
        if recorder is not None:
            recorder.install()
        value = fn(rank, world_size, *args, **kwargs)
        if recorder is not None:
            recorder.uninstall()
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        _report(results, rank, False, traceback.format_exc())
        os._exit(1)  # skip interpreter shutdown: peers may be blocked in collectives with us
    _report(results, rank, True, (value, recorder.record() if recorder is not None else None))


def _report(results: Any, rank: int, ok: bool, value: Any) -> None:
    # Plain pickle, not the queue's own pickler: torch registers a reduction there that shares tensors
    # through file descriptors of this process, which would be gone by the time the parent reads them.
    results.put(pickle.dumps((rank, ok, value)))
    results.close()
    results.join_thread()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    collective_timeout_s: float | None = None,
    backend: str = "gloo",
    comm_rules: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return their results.

    ``timeout_s`` bounds the whole run; ``collective_timeout_s`` (default: the same) is the process
    group's own timeout, after which a collective that lacks a peer raises on the waiting rank.
    ``comm_rules``: check the traffic against NCCL's rules once every rank is done.
    """
    if not 1 <= world_size <= 8:
        raise ValueError(f"world_size={world_size}: the harness runs 1 to 8 ranks on this machine")
    results = _CONTEXT.Queue()
    with tempfile.TemporaryDirectory(prefix="hetero-ranks-") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            _CONTEXT.Process(
                target=_rank_main,
                args=(
                    fn,
                    rank,
                    world_size,
                    init_file,
                    backend,
                    timeout_s,
                    collective_timeout_s or timeout_s,
                    args,
                    kwargs,
                    results,
                    comm_rules,
                ),
                name=f"rank{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        try:
            reports = _collect(procs, results, timeout_s)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
            for proc in procs:
                proc.join(5)
            results.close()
    if comm_rules:
        check([record for _, record in reports])
    return [value for value, _ in reports]


def _collect(procs: list[Any], results: Any, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    values: dict[int, Any] = {}
    while len(values) < len(procs):
        try:
            rank, ok, value = pickle.loads(results.get(timeout=0.2))
        except queue.Empty:
            dead = [
                rank
                for rank, proc in enumerate(procs)
                if rank not in values and not proc.is_alive() and proc.exitcode not in (0, None)
            ]
            if dead:
                _drain_after_death(results, values)
                rank = dead[0]
                raise RankFailure(rank, f"process exited with code {procs[rank].exitcode} without reporting")
            if time.monotonic() > deadline:
                pending = [rank for rank in range(len(procs)) if rank not in values]
                raise RankTimeout(
                    f"ranks {pending} did not finish within {timeout_s:.0f} s and were killed "
                    f"(their stacks were dumped to stderr)"
                )
            continue
        if not ok:
            raise RankFailure(rank, value)
        values[rank] = value
    return [values[rank] for rank in range(len(procs))]


def _drain_after_death(results: Any, values: dict[int, Any]) -> None:
    """A rank died: if it (or another) queued a traceback first, raise that instead."""
    try:
        while True:
            rank, ok, value = pickle.loads(results.get(timeout=0.5))
            if not ok:
                raise RankFailure(rank, value)
            values[rank] = value
    except queue.Empty:
        return
