"""Pipeline-parallel schedules (GPipe and non-interleaved 1F1B) over pluggable stage transports.

A stage runs its slice of the model on every microbatch in the order ``schedule_actions`` gives.
Activations and gradients enter and leave the stage through a ``StageTransport``: by default a
``P2PTransport`` to the neighbouring stages' ranks, later also the multi-module trainer's boundary
communicators. Sends are asynchronous and receives block, so any action order that respects the data
dependencies (F(i) after the previous stage's F(i), B(i) after the next stage's B(i)) cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b")

Action = tuple[str, int]  # ("F" or "B", microbatch index)
LossFn = Callable[[torch.Tensor, Any], torch.Tensor]


class StageTransport(Protocol):
    """Where a stage's input activations and output gradients come from, and where its results go."""

    def recv_forward(self, microbatch: int) -> torch.Tensor:
        """Return this microbatch's input activation (blocks until it is there)."""
        ...

    def send_forward(self, microbatch: int, tensor: torch.Tensor) -> None:
        """Hand this microbatch's output activation to the next stage (may return before delivery)."""
        ...

    def recv_backward(self, microbatch: int) -> torch.Tensor:
        """Return the loss gradient w.r.t. this microbatch's output activation (blocks)."""
        ...

    def send_backward(self, microbatch: int, tensor: torch.Tensor) -> None:
        """Hand the gradient w.r.t. this microbatch's input activation to the previous stage."""
        ...

    def finish(self) -> None:
        """Wait until every send of this step has completed."""
        ...


class P2PTransport:
    """Point-to-point exchange with the previous and next stage's ranks; the default transport.

    Both sides know the activation shape in advance, so only the payload travels, and the gradient
    has the activation's shape. Messages on one link arrive in the order they were sent, which is
    microbatch order in every schedule here, so the microbatch index itself is not transmitted.
    """

    def __init__(
        self,
        prev_rank: int | None,
        next_rank: int | None,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.group = group
        self.device = torch.device(device)
        # (handle, tensor) for every send in flight: the tensor must outlive the send
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self.sent_bytes = {"forward": 0, "backward": 0}  # payload bytes this transport sent

    def recv_forward(self, microbatch: int) -> torch.Tensor:
        return self._recv(self.prev_rank, "previous")

    def send_forward(self, microbatch: int, tensor: torch.Tensor) -> None:
        self._send(self.next_rank, "next", tensor)
        self.sent_bytes["forward"] += tensor.numel() * tensor.element_size()

    def recv_backward(self, microbatch: int) -> torch.Tensor:
        return self._recv(self.next_rank, "next")

    def send_backward(self, microbatch: int, tensor: torch.Tensor) -> None:
        self._send(self.prev_rank, "previous", tensor)
        self.sent_bytes["backward"] += tensor.numel() * tensor.element_size()

    def finish(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def _recv(self, src: int | None, side: str) -> torch.Tensor:
        if src is None:
            raise RuntimeError(f"this stage has no {side} rank to receive from")
        buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        dist.recv(buffer, src=src, group=self.group)
        return buffer

    def _send(self, dst: int | None, side: str, tensor: torch.Tensor) -> None:
        if dst is None:
            raise RuntimeError(f"this stage has no {side} rank to send to")
        if tensor.shape != self.shape or tensor.dtype != self.dtype:
            raise ValueError(
                f"sending a {tuple(tensor.shape)} {tensor.dtype} tensor over a transport built for "
                f"{tuple(self.shape)} {self.dtype}; the receiver would misread it"
            )
        tensor = tensor.detach().contiguous()
        self._pending.append((dist.isend(tensor, dst=dst, group=self.group), tensor))


class PipelineStage:
    """One stage of a pipeline: its slice of the model, its position and its transport."""

    def __init__(
        self, module: nn.Module, stage_index: int, num_stages: int, transport: StageTransport
    ) -> None:
        _check_stage(stage_index, num_stages)
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.transport = transport

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


def schedule_actions(schedule: str, stage_index: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """The order in which one stage runs forwards ("F", i) and backwards ("B", i) of its microbatches.

    "gpipe": every forward, then every backward. "1f1b": min(num_stages - stage_index - 1, M) warmup
    forwards, then alternating one forward and one backward, then the remaining backwards.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches} must be >= 1")
    _check_stage(stage_index, num_stages)
    forwards = [("F", mb) for mb in range(num_microbatches)]
    backwards = [("B", mb) for mb in range(num_microbatches)]
    if schedule == "gpipe":
        return forwards + backwards
    warmup = min(num_stages - stage_index - 1, num_microbatches)
    steady = [action for pair in zip(forwards[warmup:], backwards) for action in pair]
    return forwards[:warmup] + steady + backwards[num_microbatches - warmup :]


def run_pipeline(
    stage: PipelineStage,
    schedule: str,
    num_microbatches: int,
    inputs: Sequence[Any] | None,
    targets: Sequence[Any] | None,
    loss_fn: LossFn,
) -> list[torch.Tensor]:
    """Run forward and backward of every microbatch on this stage in the given schedule.

    ``inputs`` (first stage only) and ``targets`` (last stage only) hold one entry per microbatch.
    Gradients accumulate into the parameters' ``.grad``; zeroing them and stepping the optimizer is
    the caller's job, as is scaling the loss inside ``loss_fn``. Returns the detached per-microbatch
    losses on the last stage and an empty list elsewhere.
    """
    actions = schedule_actions(schedule, stage.stage_index, stage.num_stages, num_microbatches)
    _check_data(stage, num_microbatches, inputs, targets)
    # microbatch -> (received activation or None on the first stage, tensor to backprop from)
    saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
    losses: list[torch.Tensor] = []
    for kind, mb in actions:
        if kind == "F":
            saved[mb] = _forward(stage, mb, inputs, targets, loss_fn, losses)
        else:
            _backward(stage, mb, *saved.pop(mb))
    stage.transport.finish()
    return losses


@dataclass
class PipelineForward:
    """The forward half of a GPipe step, kept for ``pipeline_backward``: per microbatch, the received
    activation (None on the first stage) and the tensor to backpropagate from (the last stage: the
    loss ``loss_fn`` returned); ``losses`` as ``run_pipeline`` returns them."""

    stage: PipelineStage
    saved: list[tuple[torch.Tensor | None, torch.Tensor]]
    losses: list[torch.Tensor]


def pipeline_forward(
    stage: PipelineStage,
    num_microbatches: int,
    inputs: Sequence[Any] | None,
    targets: Sequence[Any] | None,
    loss_fn: LossFn,
) -> PipelineForward:
    """Every forward of a GPipe step on this stage, and nothing else: other modules can run between it
    and ``pipeline_backward`` (a module fed by the last stage's outputs returns their gradients there)."""
    _check_data(stage, num_microbatches, inputs, targets)
    losses: list[torch.Tensor] = []
    saved = [_forward(stage, mb, inputs, targets, loss_fn, losses) for mb in range(num_microbatches)]
    return PipelineForward(stage, saved, losses)


def pipeline_backward(forward: PipelineForward, extra: Sequence[torch.Tensor] | None = None) -> None:
    """Every backward of the step ``forward`` began, in microbatch order (GPipe). ``extra`` (last stage
    only): per microbatch a scalar added to the loss before its backward, e.g. the inner product of
    outputs with the gradients a downstream module returned for them."""
    stage = forward.stage
    if extra is not None and (not stage.is_last or len(extra) != len(forward.saved)):
        raise ValueError(
            f"extra objectives belong to the last stage, one per microbatch; stage {stage.stage_index} of "
            f"{stage.num_stages} got {len(extra)} for {len(forward.saved)} microbatches"
        )
    for mb, (received, out) in enumerate(forward.saved):
        _backward(stage, mb, received, out if extra is None else out + extra[mb])
    forward.saved.clear()
    stage.transport.finish()


def _check_data(stage: PipelineStage, num_microbatches: int, inputs: Sequence[Any] | None,
                targets: Sequence[Any] | None) -> None:
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches} must be >= 1")
    if stage.is_first and (inputs is None or len(inputs) != num_microbatches):
        given = "None" if inputs is None else f"{len(inputs)} inputs"
        raise ValueError(f"the first stage needs {num_microbatches} inputs, one per microbatch; got {given}")
    if stage.is_last and (targets is None or len(targets) != num_microbatches):
        given = "None" if targets is None else f"{len(targets)} targets"
        raise ValueError(f"the last stage needs {num_microbatches} targets, one per microbatch; got {given}")


def _forward(
    stage: PipelineStage,
    mb: int,
    inputs: Sequence[Any] | None,
    targets: Sequence[Any] | None,
    loss_fn: LossFn,
    losses: list[torch.Tensor],
) -> tuple[torch.Tensor | None, torch.Tensor]:
    received = None
    if stage.is_first:
        x = inputs[mb]
    else:
        # a fresh leaf, whatever the transport returned, so that backward leaves its gradient in .grad
        received = stage.transport.recv_forward(mb).detach().requires_grad_()
        x = received
    out = stage.module(x)
    if stage.is_last:
        out = loss_fn(out, targets[mb])
        losses.append(out.detach())
    else:
        stage.transport.send_forward(mb, out.detach())
    return received, out


def _backward(stage: PipelineStage, mb: int, received: torch.Tensor | None, out: torch.Tensor) -> None:
    if stage.is_last:
        out.backward()
    else:
        out.backward(stage.transport.recv_backward(mb))
    if received is not None:
        # an output that does not depend on the input leaves no gradient; the previous stage still waits
        grad = received.grad if received.grad is not None else torch.zeros_like(received)
        stage.transport.send_backward(mb, grad)


def _check_stage(stage_index: int, num_stages: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1")
    if not 0 <= stage_index < num_stages:
        raise ValueError(
            f"stage_index={stage_index} is outside 0..{num_stages - 1} (num_stages={num_stages})"
        )
