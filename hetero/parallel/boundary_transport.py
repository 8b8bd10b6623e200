"""A boundary as the link between two pipeline stages, e.g. a vision encoder feeding an LLM's first stage.

A pipeline stage talks to its neighbours through a ``StageTransport``; ``LinkedTransport`` builds one
from two halves, the link to the previous stage and the link to the next, each of which may be:

- a ``P2PTransport`` to the neighbouring rank (its other neighbour left None): stages of one module;
- a ``BoundarySender``: the source module's last stage sending into a boundary (its next link);
- a ``BoundaryReceiver``: the destination module's first stage receiving from it (its previous link).

    boundary = Boundary("vision->llm", Side(vision), Side(llm), spec, async_sends=True)
    # ranks 0-1, the vision stage; ranks 2-5, the LLM's first stage (P2P on to its second)
    vision = LinkedTransport(None, BoundarySender(boundary, shape))
    llm_first = LinkedTransport(BoundaryReceiver(boundary, shape), P2PTransport(None, next_rank, ...))

Each stage module lives on one set of ranks: a rank in both the boundary's source and destination
stages (colocated modules) cannot use it as a pipeline link and is refused. The schedules call the
two sides in different orders (1F1B: the source runs F0 F1 B0 F2 .., the destination F0 B0 F1 B1 ..),
so the boundary must be built with ``async_sends=True``; ``finish()`` waits for its sends. The
boundary pairs calls by their order in each direction, so microbatches must cross in index order
(every schedule here does so); the adapters check it.

``shape`` is the global shape of one microbatch's tensor at the boundary; the source hands in its
own shard of it and the destination gets its own. Gradients: the boundary sums the gradients of
destination replicas (ranks holding the same shard, such as TP ranks). With ``grads_replicated``
(the default) each replica ends its backward holding the full gradient of its shard, as TP ranks do
after their all-reduce or plainly replicated stages do, so the receiver hands in grad / replicas
and the source gets that gradient once; with ``grads_replicated=False`` the replicas' gradients are
parts that sum to it and are handed in as they are.
"""

from __future__ import annotations

from typing import Literal, Protocol, Sequence

import torch

from hetero.errors import ConfigError
from hetero.parallel.boundary import Boundary, Transfer
from hetero.parallel.boundary_plan import replica_groups, side_boxes

__all__ = ["BoundaryReceiver", "BoundarySender", "LinkedTransport", "NextLink", "PreviousLink"]

Role = Literal["source", "destination"]


class PreviousLink(Protocol):
    """The half of a stage transport that faces the previous stage."""

    def recv_forward(self, microbatch: int) -> torch.Tensor: ...

    def send_backward(self, microbatch: int, tensor: torch.Tensor) -> None: ...

    def finish(self) -> None: ...


class NextLink(Protocol):
    """The half of a stage transport that faces the next stage."""

    def send_forward(self, microbatch: int, tensor: torch.Tensor) -> None: ...

    def recv_backward(self, microbatch: int) -> torch.Tensor: ...

    def finish(self) -> None: ...


class LinkedTransport:
    """A ``StageTransport`` made of a previous link and a next link (None on the first or last stage)."""

    def __init__(self, prev: PreviousLink | None, next: NextLink | None) -> None:
        self.prev = prev
        self.next = next

    def recv_forward(self, microbatch: int) -> torch.Tensor:
        return self._previous().recv_forward(microbatch)

    def send_forward(self, microbatch: int, tensor: torch.Tensor) -> None:
        self._next().send_forward(microbatch, tensor)

    def recv_backward(self, microbatch: int) -> torch.Tensor:
        return self._next().recv_backward(microbatch)

    def send_backward(self, microbatch: int, tensor: torch.Tensor) -> None:
        self._previous().send_backward(microbatch, tensor)

    def finish(self) -> None:
        """Finish both links (each waits for its own sends); a link given for both finishes once."""
        if self.prev is not None:
            self.prev.finish()
        if self.next is not None and self.next is not self.prev:
            self.next.finish()

    def _previous(self) -> PreviousLink:
        if self.prev is None:
            raise RuntimeError("this stage has no previous link (it is the first stage)")
        return self.prev

    def _next(self) -> NextLink:
        if self.next is None:
            raise RuntimeError("this stage has no next link (it is the last stage)")
        return self.next


class _BoundaryLink:
    """What both adapters share: checks on the rank and boundary, transfers in flight, their order."""

    role: Role

    def __init__(self, boundary: Boundary, shape: Sequence[int]) -> None:
        _check_boundary(boundary, self.role)
        self.boundary = boundary
        self.shape = tuple(int(n) for n in shape)
        boundary.plan(self.shape)  # checks the shape against both layouts now rather than mid-schedule
        self._transfers: dict[int, Transfer] = {}
        self._next_microbatch = {"forward": 0, "backward": 0}

    def finish(self) -> None:
        """Wait for the boundary's sends; every microbatch sent forward must have come back by now."""
        self.boundary.wait_sends()
        if self._transfers:
            raise RuntimeError(
                f"boundary {self.boundary.name!r}: microbatches {sorted(self._transfers)} crossed forward "
                f"but not backward before finish()"
            )
        self._next_microbatch = {"forward": 0, "backward": 0}

    def _in_order(self, direction: str, microbatch: int) -> None:
        """The boundary pairs calls by their order: refuse a microbatch that would pair with another."""
        expected = self._next_microbatch[direction]
        if microbatch != expected:
            raise RuntimeError(
                f"boundary {self.boundary.name!r}: microbatch {microbatch} crosses {direction} where "
                f"microbatch {expected} is due; microbatches must cross in index order in each direction"
            )
        self._next_microbatch[direction] += 1

    def _take(self, microbatch: int) -> Transfer:
        self._in_order("backward", microbatch)
        return self._transfers.pop(microbatch)


class BoundarySender(_BoundaryLink):
    """The source stage's next link: activations into the boundary, their gradients back out."""

    role: Role = "source"

    def send_forward(self, microbatch: int, tensor: torch.Tensor) -> None:
        self._in_order("forward", microbatch)
        self._transfers[microbatch] = self.boundary.forward(tensor, self.shape)

    def recv_backward(self, microbatch: int) -> torch.Tensor:
        grad = self.boundary.backward(self._take(microbatch), None)
        assert isinstance(grad, torch.Tensor), "a source rank of a one-tensor boundary gets a tensor"
        return grad


class BoundaryReceiver(_BoundaryLink):
    """The destination stage's previous link: activations out of the boundary, their gradients back in.

    ``grads_replicated`` says what the stage's input gradients are on replicas of one shard (see the
    module docstring): full gradients, divided here by the replica count, or parts of a sum.
    """

    role: Role = "destination"

    def __init__(self, boundary: Boundary, shape: Sequence[int], *, grads_replicated: bool = True) -> None:
        super().__init__(boundary, shape)
        self.replicas = _replica_count(boundary, self.shape) if grads_replicated else 1

    def recv_forward(self, microbatch: int) -> torch.Tensor:
        self._in_order("forward", microbatch)
        transfer = self.boundary.forward(None, self.shape)
        self._transfers[microbatch] = transfer
        assert isinstance(transfer.output, torch.Tensor), "a destination rank gets its shard"
        return transfer.output

    def send_backward(self, microbatch: int, tensor: torch.Tensor) -> None:
        grad = tensor / self.replicas if self.replicas > 1 else tensor
        self.boundary.backward(self._take(microbatch), grad)


def _check_boundary(boundary: Boundary, role: Role) -> None:
    """Refuse a boundary or rank that cannot serve as this stage's link."""
    adapter = "BoundarySender" if role == "source" else "BoundaryReceiver"
    if boundary.is_source and boundary.is_destination:
        raise ConfigError(
            f"boundary {boundary.name!r}: rank {boundary.rank} is in both its source stage and its "
            f"destination stage; as a pipeline link each stage's module lives on its own ranks, so "
            f"colocated modules call the boundary directly (forward then backward, in one order)"
        )
    ranks = boundary.sources if role == "source" else boundary.destinations
    if boundary.rank not in ranks:
        raise ConfigError(
            f"boundary {boundary.name!r}: rank {boundary.rank} is not in its {role} stage (ranks "
            f"{list(ranks)}); build {adapter} only there"
        )
    if not boundary.async_sends:
        raise ConfigError(
            f"boundary {boundary.name!r}: build it with async_sends=True to use it as a pipeline link; the "
            f"two stages call it in different orders and waiting for each send could deadlock"
        )
    if not boundary.single or not next(iter(boundary.specs.values())).differentiable:
        raise ConfigError(
            f"boundary {boundary.name!r}: a pipeline link carries one floating-point tensor; build the "
            f"boundary from one TensorSpec with a floating-point dtype"
        )


def _replica_count(boundary: Boundary, shape: tuple[int, ...]) -> int:
    """How many destination ranks hold the same shard as this rank (itself included)."""
    (spec,) = boundary.specs.values()
    for _, ranks in replica_groups(side_boxes(shape, spec.destination, boundary.destination)):
        if boundary.rank in ranks:
            return len(ranks)
    raise AssertionError(f"rank {boundary.rank} is a destination rank of boundary {boundary.name!r}")
