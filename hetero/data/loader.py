"""The training loop's batches, prepared ahead: ``train.data.workers`` processes build the batches of the
next steps while the current one trains.

``StepLoader`` iterates over steps ``first .. last``, each a ``(step, batch, skipped)`` with the batch
of ``(step - 1) // sample_reuse`` (this rank's, given its ``reads``) and the samples its source newly
skipped building it (``train.data.on_error=skip``: place -> why, for ``SampleBatches.skip`` in the loop's
process). With no workers the batches are built in the loop's own process, when asked for; with workers
a ``torch.utils.data.DataLoader`` over the steps keeps ``PREFETCH`` batches per worker in flight, in step
order, and copies them into pinned memory when the job runs on CUDA. A worker that raises, dies or hangs
past ``timeout_s`` raises in the loop (its error, or the DataLoader's), where the job's data agreement
stops every rank (``hetero.train.data_agreement``). ``wait_s`` is how long the loop waited for each batch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from hetero.data.sources.format import Batches

PREFETCH = 2


class StepBatches(Dataset):
    """Step ``first + i``'s batch and the samples skipped building it, for a DataLoader's workers;
    ``reads``: what this rank reads (``hetero.data.rank_batches``), None for the global batches."""

    def __init__(self, batches: Batches, first: int, last: int, sample_reuse: int, reads=None):
        self.batches, self.first, self.last, self.sample_reuse, self.reads = batches, first, last, sample_reuse, reads

    def __len__(self) -> int:
        return max(0, self.last - self.first + 1)

    def __getitem__(self, i: int) -> tuple[int, dict[str, torch.Tensor], dict]:
        step = self.first + i
        before = set(getattr(self.batches, "bad", ()))
        position = (step - 1) // self.sample_reuse
        batch = self.batches.batch(position, self.reads)
        return step, batch, {k: v for k, v in getattr(self.batches, "bad", {}).items() if k not in before}


def _worker_setup(_: int) -> None:
    torch.set_num_threads(1)  # a worker decodes; the training process keeps the cores' threads
    # Batches by shared-memory file name: the default (a file descriptor each tensor) makes the loop ask
    # the worker's own thread for every descriptor, so a busy machine that has not scheduled the worker
    # holds up a batch that was ready.
    torch.multiprocessing.set_sharing_strategy("file_system")


def _check_started(source) -> None:
    """Raise if a worker already died. torch's SIGCHLD handler watches the workers only from when their pids
    are registered, after all have forked: a worker that died before (a busy machine can hold the loop there)
    is found by nothing, as a DataLoader with a timeout waits that long on its queue without looking."""
    for worker in source._workers:
        if not worker.is_alive():
            raise RuntimeError(f"DataLoader worker (pid {worker.pid}) exited unexpectedly (exit code {worker.exitcode})")


class StepLoader:
    def __init__(self, batches: Batches, first: int, last: int, sample_reuse: int, workers: int,
                 device: torch.device, timeout_s: float, reads=None):
        self.steps = StepBatches(batches, first, last, sample_reuse, reads)
        self.workers, self.device, self.timeout_s = workers, device, timeout_s
        self.wait_s = 0.0

    def __iter__(self) -> Iterator[tuple[int, dict[str, torch.Tensor], dict]]:
        if not self.workers:
            source = (self.steps[i] for i in range(len(self.steps)))
        else:
            source = iter(DataLoader(self.steps, batch_size=None, shuffle=False, num_workers=self.workers,
                                     prefetch_factor=PREFETCH, pin_memory=self.device.type == "cuda",
                                     worker_init_fn=_worker_setup, timeout=self.timeout_s))
        try:
            if self.workers:
                _check_started(source)
            while True:
                tick = time.perf_counter()
                try:
                    item = next(source)
                except StopIteration:
                    return
                self.wait_s = time.perf_counter() - tick
                yield item
        finally:
            # Stop the workers now, also after an error: until then torch's SIGCHLD handler, which knows
            # their pids, raises again in whatever runs when any child process ends.
            stop = getattr(source, "_shutdown_workers", None)
            if stop is not None:
                stop()
