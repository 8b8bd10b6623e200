"""DiLoCo's outer sync over torchft's fault-tolerant replica groups (``Runtime(outer_comms={module: ...})``).

A torchft job is a set of replica groups that a ``LighthouseServer`` gathers into a quorum before every
outer round; each group has a ``Manager`` whose process group (torchft's reconfigurable ``ProcessGroupGloo``
on CPU) spans the groups of the current quorum. ``TorchftCollective`` is the ``Collective`` DiLoCo runs
over, for replica groups of one process each; every collective goes through the manager, so that a failing
peer marks the round as failed instead of raising or hanging, and ``commit_round`` says so.

Semantics (torchft 0.2.0):

- ``Manager.allreduce`` *averages* by default (``ReduceOp.AVG``: a gloo sum, then ``/= num_participants``).
  The ``Collective`` contract is a sum, so ``all_reduce`` passes ``ReduceOp.SUM`` and DiLoCo divides by
  ``size`` itself, exactly as over a torch.distributed group (the results are bitwise the same).
- ``start_round`` is ``Manager.start_quorum``, synchronous (managers are built with
  ``use_async_quorum=False``, as torchft's own DiLoCo requires): it blocks until the lighthouse forms a
  quorum, reconfigures the process group when the membership changed or the previous round failed, and
  heals a replica group whose step (count of committed rounds) is behind from a peer's registered state.
  ``size`` and ``rank`` are then the quorum's. When a replica group dies or joins, the next round runs
  with the new ``size``: the mean pseudo-gradient is over the groups that took part, and ``BlockQuant``
  re-chunks its payload for the new size (its owner residual restarts). Between rounds both keep the
  values of the last quorum.
- After the first error in a round, further collectives are skipped; failed or skipped ones leave zeros in
  their result (codecs then decode something harmless) and ``commit_round`` (``Manager.should_commit``)
  returns False. ``should_commit`` agrees within one replica group only: groups whose collectives all
  succeeded still commit, and at the next quorum a group left behind heals from one that committed. That
  needs state registered on the manager (``replica_manager(state_dict=..., load_state_dict=...)`` or
  ``Manager.register_state_dict_fn``). A peer that dies or aborts its process group mid-collective makes the
  collective fail on every replica (gloo reports the closed connection at once, or times out), so in that
  case every group drops the round.
- Bytes follow the ring model of ``GroupCollective`` and count every collective issued while the round was
  healthy (one that fails part-way is counted in full; skipped ones are not).
"""

from __future__ import annotations

import contextlib
import socket
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions, ReduceOp, Work
from torchft._torchft import LighthouseServer
from torchft.manager import Manager
from torchft.process_group import ProcessGroup, ProcessGroupGloo

from hetero.parallel.compression.background import PostingGate
from hetero.parallel.compression.collective import (
    _nbytes,
    issuing,
    all_gather_wire_bytes,
    all_reduce_wire_bytes,
    all_to_all_wire_bytes,
)


class TorchftCollective:
    """The ``Collective`` of a one-process replica group in a torchft job."""

    def __init__(self, manager: Manager):
        if manager._use_async_quorum:  # torchft's DiLoCo makes the same check
            raise ValueError("TorchftCollective needs a Manager built with use_async_quorum=False")
        self.manager = manager
        self.size = 0  # set by start_round from the quorum
        self.rank = 0
        self.bytes_sent = 0
        self.gate: PostingGate | None = None

    def start_round(self) -> None:
        """Join the next quorum (blocking, within the manager's quorum timeout)."""
        self.manager.start_quorum()
        rank = self.manager.participating_rank()
        if rank is None:
            raise RuntimeError("this replica group is a spare: TorchftCollective needs every group in")
        self.size, self.rank = self.manager.num_participants(), rank

    def commit_round(self) -> bool:
        """Whether this group's collectives of the round all succeeded (and enough groups took part)."""
        return self.manager.should_commit()

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the quorum, in place (``ReduceOp.SUM``: the manager's default averages)."""
        if self.manager.errored() is None:
            self.bytes_sent += all_reduce_wire_bytes(_nbytes(tensor), self.size)
            with issuing(self.gate):
                work = self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM)
            work.wait()  # errors go to the manager
        if self.manager.errored() is not None:
            tensor.zero_()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every replica's ``tensor`` stacked along a new first dimension, in quorum-rank order."""
        out = torch.zeros((self.size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        send = tensor.contiguous()
        if self._run(lambda pg: pg.allgather([list(out.unbind(0))], [send], AllgatherOptions()), out):
            self.bytes_sent += all_gather_wire_bytes(_nbytes(tensor), self.size)
        return out

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """Chunk ``i`` of dimension 0 goes to quorum rank ``i``; chunk ``j`` of the result came from ``j``."""
        out = torch.zeros_like(tensor)
        send = tensor.contiguous()
        if self._run(lambda pg: pg.alltoall_base(out, send, [], [], AllToAllOptions()), out):
            self.bytes_sent += all_to_all_wire_bytes(_nbytes(tensor), self.size)
        return out

    def _run(self, launch: Callable[[ProcessGroup], Work], out: torch.Tensor) -> bool:
        """Issue one collective on the manager's process group, with the manager's error handling.

        Skipped (returns False) after an earlier error in the round. An error raised while issuing it, while
        it runs, or the manager's timeout is reported to the manager, and ``out`` is zeroed.
        """
        if self.manager.errored() is not None:
            return False
        try:
            with issuing(self.gate):
                work = launch(self.manager._pg)  # the process group the manager reconfigures at every quorum
            self.manager.wrap_future(work.get_future(), None).wait()
        except Exception as e:  # raised while issuing, e.g. by an aborted process group
            self.manager.report_error(e)
        if self.manager.errored() is not None:
            out.zero_()
        return True


def _lighthouse_server(
    min_replicas: int, join_timeout: timedelta, heartbeat_timeout: timedelta
) -> LighthouseServer:
    return LighthouseServer(
        bind="[::]:0",
        min_replicas=min_replicas,
        join_timeout_ms=int(join_timeout.total_seconds() * 1000),
        heartbeat_timeout_ms=int(heartbeat_timeout.total_seconds() * 1000),
    )


@contextlib.contextmanager
def lighthouse(
    min_replicas: int,
    join_timeout: timedelta = timedelta(seconds=10),
    heartbeat_timeout: timedelta = timedelta(seconds=5),
) -> Iterator[str]:
    """Run a ``LighthouseServer`` in this process for the block; yields its address.

    The first quorum waits for ``min_replicas`` replica groups; later ones wait up to ``join_timeout`` for
    heartbeating stragglers, and a group whose heartbeat stops for ``heartbeat_timeout`` is left out.
    """
    server = _lighthouse_server(min_replicas, join_timeout, heartbeat_timeout)
    try:
        yield server.address()
    finally:
        server.shutdown()


@contextlib.contextmanager
def shared_lighthouse(
    join_timeout: timedelta = timedelta(seconds=10),
    heartbeat_timeout: timedelta = timedelta(seconds=5),
) -> Iterator[str]:
    """A lighthouse for a job whose default process group has one rank per replica group.

    Rank 0 runs it (``min_replicas`` = world size) and broadcasts its address over the default group, so
    every rank gets it within that group's timeout. When the block ends normally the ranks meet in a barrier
    before rank 0 stops the lighthouse; when it raises, the lighthouse stops at once.
    """
    server = None
    if dist.get_rank() == 0:
        server = _lighthouse_server(dist.get_world_size(), join_timeout, heartbeat_timeout)
    try:
        address = [server.address() if server is not None else None]
        dist.broadcast_object_list(address, src=0)
        yield str(address[0])
        dist.barrier()
    finally:
        if server is not None:
            server.shutdown()


@contextlib.contextmanager
def replica_manager(
    replica_id: int | str,
    lighthouse_addr: str,
    timeout: timedelta = timedelta(seconds=30),
    min_replica_size: int = 1,
    state_dict: Callable[[], Any] | None = None,
    load_state_dict: Callable[[Any], None] | None = None,
    hostname: str = socket.gethostname(),
) -> Iterator[Manager]:
    """The ``Manager`` of a one-process replica group on CPU (gloo), shut down when the block ends.

    The group's own ``TCPStore`` is started here. ``timeout`` bounds every wait: quorum, the gloo process
    group and the manager's futures, ``should_commit``, connections. The quorum is synchronous
    (``use_async_quorum=False``). Replicas start from identically seeded weights, so there is no initial
    weight sync (``init_sync=False``); ``state_dict``/``load_state_dict`` (optional; more can be registered
    with ``Manager.register_state_dict_fn``) are what a group that fell behind receives from a peer.
    A round commits only with at least ``min_replica_size`` groups in the quorum.
    """
    # the group's store: the manager and the quorum's process groups connect to it; it lives with this block
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=min_replica_size,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="localhost",
        store_port=store.port,
        lighthouse_addr=lighthouse_addr,
        replica_id=str(replica_id),
        hostname=hostname,
        init_sync=False,
    )
    try:
        yield manager
    finally:
        manager.shutdown(wait=False)
        pg.shutdown()
