"""Where a benchmark's ranks come from: processes on this machine (gloo, ``run_ranks``), or, under
torchrun, the launched job itself (NCCL on GPUs), every process one rank. Either way the caller gets
every rank's result; under torchrun only rank 0 does (the others get None) and reports.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch.distributed as dist

from hetero.config import ExperimentConfig
from hetero.graph import build_graph
from hetero.models import default_registry


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def each_rank(measure: Callable[..., Any], experiment: ExperimentConfig, *args: Any,
              timeout_s: float = 900.0) -> list[Any] | None:
    """``measure(rank, world_size, experiment, *args)`` on every rank of ``experiment``'s placement."""
    from hetero.bench.throughput import ensure_shards
    from hetero.parallel.mesh import init_distributed
    from hetero.testing.multiprocess import run_ranks

    placement = build_graph(experiment, default_registry()).placement
    if not launched_by_torchrun():
        ensure_shards(experiment)
        return run_ranks(measure, placement.world_size, experiment, *args, timeout_s=timeout_s,
                         collective_timeout_s=experiment.timeout_s)
    rank = init_distributed(placement, experiment.backend, experiment.timeout_s)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # each node writes its own copy of the shards
        ensure_shards(experiment)
    dist.barrier()
    result = measure(rank, placement.world_size, experiment, *args)
    per_rank: list[Any] = [None] * placement.world_size
    dist.all_gather_object(per_rank, result)
    return per_rank if rank == 0 else None
