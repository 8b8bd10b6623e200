"""torchft's own DiLoCo as a reference peer: one replica group trained by ``torchft.local_sgd.DiLoCo``.

``run_torchft_diloco`` is meant to run inside a rank of ``hetero.testing.multiprocess.run_ranks`` (rank ``r``
is replica group ``r``; rank 0 runs the lighthouse and shares its address over the default process group),
so a benchmark can put it side by side with hetero's DiLoCo on the same model, data and schedule:

    def rank_main(rank, world_size):
        model = build_model()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run = run_torchft_diloco(model, inner, lambda m, step: loss_on(rank, m, step), set_lr, steps=64,
                                 sync_every=8)
        return run.losses, run.bytes_sent

    run_ranks(rank_main, 2, timeout_s=300)

What torchft's DiLoCo does (0.2.0, one fragment): every ``sync_every`` inner steps it takes a quorum, computes
the pseudo-gradient ``anchor - theta`` per parameter, all-reduces it with the manager's default
``ReduceOp.AVG`` (a sum divided by the number of participants), restores the anchor, lets the outer
optimizer step on it with the mean pseudo-gradient as gradient, and saves the result as the new anchor. If
the round does not commit the replica returns to its anchor. That is hetero's DiLoCo without compression,
with the same Nesterov SGD outer step; the results agree bitwise on two replicas (see the tests).

Bytes: every ``Manager.allreduce`` call (one per parameter tensor: torchft does not bucket by default) is
counted as a fp32 ring all-reduce, ``2 (n-1)/n`` times the tensor's bytes with ``n`` the participants of
the round, the model ``GroupCollective`` uses; calls skipped after an error in the round are not counted.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torchft.local_sgd import DiLoCo
from torchft.manager import Manager

from hetero.parallel.compression.collective import _nbytes, all_reduce_wire_bytes
from hetero.parallel.compression.torchft_replicas import replica_manager, shared_lighthouse


@dataclass
class TorchftDiLoCoRun:
    losses: list[float]  # per inner step, on this replica's data
    bytes_sent: int  # by the outer syncs' all-reduces, ring model
    commits: int  # outer rounds committed (the manager's step)
    state: dict[str, torch.Tensor]  # the model's final state_dict


class _AllreduceBytes:
    """Replaces one manager's ``allreduce`` (on that instance) by a call that counts its ring bytes first."""

    def __init__(self, manager: Manager):
        self.manager = manager
        self.allreduce = manager.allreduce
        self.bytes_sent = 0
        manager.allreduce = self  # type: ignore[method-assign]

    def __call__(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> dist.Work:
        if self.manager.errored() is None:
            self.bytes_sent += all_reduce_wire_bytes(_nbytes(tensor), self.manager.num_participants())
        return self.allreduce(tensor, *args, **kwargs)


def run_torchft_diloco(
    model: nn.Module,
    inner: torch.optim.Optimizer,
    loss_fn: Callable[[nn.Module, int], torch.Tensor],
    set_lr: Callable[[int], None],
    steps: int,
    sync_every: int,
    clip: float = 0.0,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    replica: int | None = None,
    lighthouse_addr: str | None = None,
    timeout: timedelta = timedelta(seconds=30),
    sync_delay: int = 0,
    update_alpha: float = 0.0,
) -> TorchftDiLoCoRun:
    """Train ``model`` with its ``inner`` optimizer for ``steps`` inner steps as one replica group of a
    torchft DiLoCo job.

    Every replica must start from the same weights (no initial sync); ``loss_fn(model, step)`` is the loss
    on this replica's batch of ``step``; ``set_lr(step)`` sets the inner learning rates before each step;
    gradients are clipped to norm ``clip`` first when it is positive. The outer optimizer is ``SGD(lr=outer_lr, momentum=outer_momentum, nesterov=True)``, every
    ``sync_every`` steps (inner steps after the last sync are not synced).

    ``replica`` defaults to the rank in the default process group. Without ``lighthouse_addr`` the default
    group's rank 0 runs the lighthouse (one replica group per rank). ``timeout`` bounds every wait of the
    manager (quorum, collectives, commit), so a missing peer fails the run rather than hanging it.
    ``sync_delay`` and ``update_alpha``: torchft's ``fragment_sync_delay`` and ``fragment_update_alpha``
    (Streaming DiLoCo's overlap: the all-reduce starts that many steps early; local and global weights mix).
    """
    replica = dist.get_rank() if replica is None else replica
    outer = torch.optim.SGD(model.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=True)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["inner"])

    address = contextlib.nullcontext(lighthouse_addr) if lighthouse_addr is not None else shared_lighthouse()
    losses: list[float] = []
    with address as addr, replica_manager(
        f"replica_{replica}", addr, timeout, state_dict=state_dict, load_state_dict=load_state_dict
    ) as manager:
        counter = _AllreduceBytes(manager)
        with DiLoCo(manager, [model], inner, outer, sync_every=sync_every, pin_memory=False,
                    fragment_sync_delay=sync_delay, fragment_update_alpha=update_alpha):
            for step in range(steps):
                set_lr(step)
                inner.zero_grad(set_to_none=True)
                loss = loss_fn(model, step)
                loss.backward()
                if clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                inner.step()  # DiLoCo's post-step hook runs the outer round every sync_every steps
                losses.append(loss.item())
        commits = manager.current_step()
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    return TorchftDiLoCoRun(losses, counter.bytes_sent, commits, state)
