"""Pipeline-parallel building blocks: the order in which a stage runs its microbatches, and the
point-to-point link between neighbouring stages of a module.

A stage's order lists forwards ("F", i) and backwards ("B", i). Sends are asynchronous and receives
block, so any order in which each stage runs F(i) after its predecessor's F(i) and B(i) after its
successor's B(i) completes; the runtime's schedules check theirs (``hetero.runtime.schedule``). In 1F1B's
steady state both neighbours send before they receive; NCCL runs a communicator's operations in order on
one stream, so on one group two sends facing each other would each wait, behind its own send, for the
other's receive once messages outgrow NCCL's buffers. Activations and gradients therefore travel on two
groups (``mesh.STAGE_GROUPS``), each carrying one direction of a link: a receive never queues behind a send.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")

Action = tuple[str, int]  # ("F" or "B", microbatch index)


def stage_order(schedule: str, warmup: int, num_microbatches: int) -> list[Action]:
    """"gpipe": every forward, then every backward. "1f1b": ``warmup`` forwards (at most all), then one
    forward and one backward in turn, then the remaining backwards."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches} must be >= 1")
    forwards = [("F", mb) for mb in range(num_microbatches)]
    backwards = [("B", mb) for mb in range(num_microbatches)]
    if schedule == "gpipe":
        return forwards + backwards
    warmup = min(warmup, num_microbatches)
    steady = [action for pair in zip(forwards[warmup:], backwards) for action in pair]
    return forwards[:warmup] + steady + backwards[num_microbatches - warmup :]


def schedule_actions(schedule: str, stage_index: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """The order of stage ``stage_index`` of a pipeline of ``num_stages``: 1F1B warms up with one forward
    per stage after it."""
    if num_stages < 1 or not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index={stage_index} is outside 0..{num_stages - 1} (num_stages={num_stages})")
    return stage_order(schedule, num_stages - stage_index - 1, num_microbatches)


class StageLink:
    """Point-to-point traffic with one neighbouring stage's rank: sends posted without waiting (``finish``
    waits for them) on ``send_group``, receives blocking on ``recv_group``. Both ends know each message's
    shape and dtype, so only the payload travels; messages on a link arrive in the order they were sent."""

    def __init__(self, peer: int, send_group: dist.ProcessGroup | None = None,
                 recv_group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu"):
        self.peer, self.send_group, self.recv_group, self.device = peer, send_group, recv_group, torch.device(device)
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []  # a send's tensor must outlive it
        self.sent_bytes = {"forward": 0, "backward": 0}

    def send(self, tensor: torch.Tensor, direction: str) -> None:
        tensor = tensor.detach().contiguous()
        self._pending.append((dist.isend(tensor, dst=self.peer, group=self.send_group), tensor))
        self.sent_bytes[direction] += tensor.numel() * tensor.element_size()

    def recv(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        dist.recv(buffer, src=self.peer, group=self.recv_group)
        return buffer

    def finish(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
