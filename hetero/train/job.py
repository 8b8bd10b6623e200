"""What every training job does around its loop: checks, process groups, checkpoints, fault guard, log.

``start_job`` validates the experiment, finds and verifies the checkpoint to resume from (before any
process group exists), joins the launcher's world, builds every module's meshes and returns a ``Job``.
``run_job`` runs a job's loop inside ``job.guard.running()``; the loop resumes with ``job.resume(state)``
and saves with ``job.checkpoints``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from hetero.config import ExperimentConfig, validate
from hetero.parallel.data import GradSync
from hetero.parallel.mesh import ModuleMesh, build_module_meshes, init_distributed
from hetero.parallel.placement import Placement
from hetero.train.checkpoint import Checkpointable, Checkpointer, RunIdentity, check_resumable, resolve_resume
from hetero.train.faults import FaultGuard, NonFiniteError
from hetero.train.optim import clip_gradients
from hetero.train.run_log import RunLog


def run_identity(experiment: ExperimentConfig, placement: Placement) -> RunIdentity:
    """What a checkpoint of this run records to be resumed safely (see ``check_resumable``)."""
    modules = experiment.modules
    return RunIdentity(
        models={n: {"kind": m.kind, "model": asdict(experiment.model_config(n))} for n, m in modules.items()},
        data={
            "seed": experiment.seed,
            "batch.global_batch_size": experiment.batch.global_batch_size,
            "train.sample_reuse": experiment.train.sample_reuse,
        },
        local={
            "layouts": {n: asdict(layout) for n, layout in placement.layouts.items()},
            "modules": {
                n: {"parallel": asdict(m.parallel), "compression": asdict(m.compression),
                    "micro_batch_size": experiment.micro_batch_size(n)}
                for n, m in modules.items()
            },
            "edges": [asdict(edge) for edge in experiment.edges],
        },
    )


@dataclass
class Job:
    experiment: ExperimentConfig
    placement: Placement
    rank: int
    meshes: dict[str, ModuleMesh]
    checkpoints: Checkpointer
    resume_from: Path | None
    same_local: bool
    guard: FaultGuard
    log: RunLog

    def resume(self, state: Checkpointable) -> int:
        """Load the checkpoint found at start into ``state``; the step to continue after (0: none)."""
        if self.resume_from is None:
            return 0
        step = self.checkpoints.load(state, self.resume_from, self.same_local)
        self.log.resumed(self.resume_from, step, self.same_local)
        return step

    def apply_gradients(
        self, step: int, name: str, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], sync: GradSync | None
    ) -> float:
        """A lone module's update: sync gradients over DP, clip them (``train.grad_clip``), then step, or skip
        the step when the synced norm (the same on every rank) is not finite. Returns the norm."""
        if sync is not None:
            sync.sync()
        norm = clip_gradients(params, self.experiment.train.grad_clip)
        if math.isfinite(norm):
            optimizer.step()
        else:
            self.check_finite(step, {name: []})
        return norm

    def check_finite(self, step: int, where: dict[str, list[str]]) -> None:
        """Log a step skipped for non-finite values (``where``: module -> ranks) and apply the policy."""
        self.log.skipped(step, where)
        if self.experiment.train.nonfinite == "stop":
            raise NonFiniteError(
                f"step {step}: non-finite loss or gradients in {', '.join(where)}; train.nonfinite=stop ends the "
                f"job (train.nonfinite=skip skips such steps)"
            )


def run_job(experiment: ExperimentConfig, loop: Callable[[Job], dict[str, float]]) -> dict[str, float]:
    """Start the job, run its ``loop`` under the fault guard, log the summary and leave the process group."""
    job = start_job(experiment)
    with job.guard.running():
        summary = loop(job)
    job.log.finish(summary)
    return summary


def start_job(experiment: ExperimentConfig) -> Job:
    placement = validate(experiment)
    cfg = experiment.train
    run_dir = Path(cfg.run_dir) / experiment.name
    checkpoints = Checkpointer(
        cfg.checkpoint, Path(cfg.checkpoint.dir or run_dir / "checkpoints"), run_identity(experiment, placement)
    )
    resume_from = resolve_resume(cfg.checkpoint, checkpoints.root)
    same_local = check_resumable(resume_from, checkpoints.identity)[1] if resume_from is not None else True
    rank = init_distributed(placement, experiment.backend, experiment.timeout_s)
    meshes = build_module_meshes(placement, experiment.timeout_s)
    checkpoints.attach()
    return Job(
        experiment, placement, rank, meshes, checkpoints, resume_from, same_local,
        FaultGuard(placement, experiment.timeout_s), RunLog(experiment, run_dir, enabled=rank == 0),
    )


class SingleModule:
    """The checkpointable state of a job of one module with a plain DP all-reduce: its model and optimizer."""

    def __init__(self, name: str, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.name, self.model, self.optimizer = name, model, optimizer
        self.step = 0

    def checkpoint_modules(self) -> dict[str, tuple[nn.Module, torch.optim.Optimizer]]:
        return {self.name: (self.model, self.optimizer)}

    def local_state(self) -> dict:
        return {}

    def load_local_state(self, state: dict) -> None:
        pass

    def reset_local_state(self) -> None:
        pass
