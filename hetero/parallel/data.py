"""Data-parallel gradient synchronization behind a small pluggable interface.

A ``GradSync`` is built over a module's named parameters and called once per optimizer step, after every
microbatch's backward; it leaves every replica holding the sum of the replicas' gradients. The default
buckets gradients into flat buffers and all-reduces them over the module's dp×cp group (context-parallel
ranks hold different tokens of the same samples, so their gradients are summed too). Compressed syncs
(``hetero.parallel.compression``) implement the same interface. Bytes are counted here, in hetero's own
code, with the ring model of ``compression.collective``.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hetero.parallel.compression.collective import GroupCollective

Key = TypeVar("Key")


def local_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The gradient this rank holds for ``param`` (its shard, for a DTensor parameter)."""
    grad = param.grad
    if grad is None:
        return None
    return grad.to_local() if isinstance(grad, DTensor) else grad


def local_data(param: nn.Parameter) -> torch.Tensor:
    """The values this rank holds for ``param`` (its shard, for a DTensor), as a plain tensor sharing storage."""
    return param.data.to_local() if isinstance(param.data, DTensor) else param.data


def split_like(flat: torch.Tensor, like: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Consecutive views of ``flat`` shaped like each tensor of ``like``: the inverse of flattening them."""
    offset = 0
    for t in like:
        yield flat[offset : offset + t.numel()].view_as(t)
        offset += t.numel()


def bucketed(
    grads: Iterable[tuple[Key, torch.Tensor]], bucket_bytes: int
) -> Iterable[list[tuple[Key, torch.Tensor]]]:
    """Consecutive runs of ``grads`` of one dtype and at most ``bucket_bytes`` (or one larger tensor)."""
    bucket: list[tuple[Key, torch.Tensor]] = []
    size = 0
    for key, g in grads:
        nbytes = g.numel() * g.element_size()
        if bucket and (size + nbytes > bucket_bytes or g.dtype != bucket[0][1].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append((key, g))
        size += nbytes
    if bucket:
        yield bucket


class GradSync(Protocol):
    @property
    def bytes_sent(self) -> int: ...

    def arm(self) -> None:
        """The step's final backward on this rank is next (a sync may start from its gradient hooks)."""

    def flush(self) -> None:
        """That backward is over (or was skipped here)."""

    def sync(self) -> None: ...

    def discard(self) -> None:
        """The step is skipped: finish what ``arm`` started without touching the gradients."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class AfterBackwardSync:
    """A gradient sync that runs whole at ``sync`` (a compressed one: its codecs need every gradient), so
    there is nothing to start during the backward and nothing in flight to finish."""

    def arm(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def discard(self) -> None:
        pass


class AllReduceGradSync:
    """Sum gradients over ``group`` in flat buckets of at most ``bucket_bytes`` (one dtype per bucket).

    Buckets are fixed at construction and start last bucket first (roughly the order in which the
    backward produces gradients, as DDP has them). Once ``arm``-ed for a step's final backward, a bucket's
    all-reduce starts from a gradient hook as soon as all its parameters' gradients are final, so it
    overlaps the rest of the backward. Buckets start strictly in order, every rank alike (NCCL matches
    collectives by order): one that is ready waits for the ones before it. ``sync`` starts whatever has
    not started (a replica that saw no rows in the final microbatch fires no hooks), waits, and only then
    writes the sums into the gradients, so until then each rank's gradients stay its own (the runtime's
    non-finite check reads them). ``reduce_dtype`` (e.g. bf16) is the precision the sums travel in.
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, nn.Parameter]],
        group: dist.ProcessGroup | GroupCollective,
        bucket_bytes: int = 25 * 2**20,
        reduce_dtype: torch.dtype | None = None,
        before_launch: Callable[[nn.Parameter], None] | None = None,
    ):
        """``before_launch(param)``: run on a parameter before its bucket leaves from a hook (the runtime
        settles a ``Partial`` TP gradient there)."""
        self.params = [p for _, p in named_params if p.requires_grad]
        self.comm = GroupCollective(group) if isinstance(group, dist.ProcessGroup) else group
        self.reduce_dtype, self.before_launch = reduce_dtype, before_launch
        # Grouped in parameter order (where a gradient sits in its bucket decides how a ring all-reduce
        # rounds its sum: this grouping keeps runs bitwise what they were), started last bucket first.
        shards = [(p, local_data(p)) for p in self.params]
        self.buckets = [[p for p, _ in bucket] for bucket in bucketed(shards, bucket_bytes)][::-1]
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self._armed = False
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._flights: list[tuple[dist.Work | None, torch.Tensor]] = []  # started buckets, in order
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]

    @property
    def bytes_sent(self) -> int:
        return self.comm.bytes_sent

    def arm(self) -> None:
        """The next backward is the step's last on this rank: start buckets as their gradients finish."""
        self._armed = True

    def flush(self) -> None:
        """That backward is over: start every bucket not started yet (a parameter that got no gradient in
        it, or a replica that skipped it, fires no hook), so that each module's buckets leave at the same
        point of every rank's step (modules whose replicas share ranks share a process group)."""
        for index in range(len(self._flights), len(self.buckets)):
            self._launch(index)

    def _grad_ready(self, param: nn.Parameter) -> None:
        if not self._armed:
            return
        self._ready[self._bucket_of[id(param)]].add(id(param))
        while len(self._flights) < len(self.buckets) and len(self._ready[len(self._flights)]) == len(
                self.buckets[len(self._flights)]):
            self._launch(len(self._flights))

    def _launch(self, index: int) -> None:
        if self.before_launch is not None:
            for param in self.buckets[index]:
                if param.grad is not None:
                    self.before_launch(param)
        grads = [_grad_or_zeros(p) for p in self.buckets[index]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.reduce_dtype is not None:
            flat = flat.to(self.reduce_dtype)
        self._flights.append((self.comm.all_reduce_async(flat), flat))

    def _finish(self) -> list[torch.Tensor]:
        self.flush()
        sums = []
        for work, flat in self._flights:
            if work is not None:
                work.wait()
            sums.append(flat)
        self._armed, self._flights = False, []
        self._ready = [set() for _ in self.buckets]
        return sums

    def sync(self) -> None:
        for bucket, flat in zip(self.buckets, self._finish()):
            grads = [_grad_or_zeros(p) for p in bucket]
            for g, piece in zip(grads, split_like(flat, grads)):
                g.copy_(piece)

    def discard(self) -> None:
        """End a step whose gradients are thrown away: the same collectives as ``sync``, nothing written."""
        self._finish()

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _grad_or_zeros(param: nn.Parameter) -> torch.Tensor:
    """The local gradient; a parameter that got none gets zeros here (every replica sends a full bucket)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return local_grad(param)


class GradSyncs:
    """Several gradient syncs over disjoint parameters and groups, run as one (dense weights over dp×cp,
    experts over their expert-data-parallel group): each starts, waits and writes in turn, every rank
    alike."""

    def __init__(self, syncs: list[AllReduceGradSync]):
        self.syncs = syncs

    @property
    def bytes_sent(self) -> int:
        return sum(sync.bytes_sent for sync in self.syncs)

    def arm(self) -> None:
        for sync in self.syncs:
            sync.arm()

    def flush(self) -> None:
        for sync in self.syncs:
            sync.flush()

    def sync(self) -> None:
        for sync in self.syncs:
            sync.sync()

    def discard(self) -> None:
        for sync in self.syncs:
            sync.discard()

    def remove_hooks(self) -> None:
        for sync in self.syncs:
            sync.remove_hooks()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
