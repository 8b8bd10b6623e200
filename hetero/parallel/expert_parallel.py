"""Expert parallelism: a layer's experts split over an EP group, tokens exchanged by all-to-all.

Rank ``r`` of an EP group of ``n`` holds experts ``r·E/n .. (r+1)·E/n - 1`` (the experts' weights are
DTensors ``Shard(0)`` over the group's 1-D mesh, so checkpoints reshard across EP degrees). A layer's
rows arrive sorted by expert with their counts; the dispatch

1. swaps the per-expert counts (an all-to-all of ``E`` integers), then copies them to the host: the
   uneven exchange needs its split sizes there (dropless routing's one device-to-host copy per layer and
   microbatch, as in Megatron's and torchtitan's dropless paths);
2. sends each rank the rows for its experts and receives the rows for its own (all-to-all, uneven);
3. runs its experts on what arrived, regrouped from source-major to expert-major order, and puts the
   outputs back in arrival order;
4. returns them to the ranks they came from (the inverse all-to-all).

Both exchanges are autograd functions whose backward is the mirror exchange, so gradients travel the
same way back. Every rank of a group posts the same collectives in the same order with sizes that match
pairwise (each rank's send split to a peer is that peer's receive split), as NCCL requires. ``bytes_sent``
counts the rows (and counts) this rank hands to other ranks, forward and backward.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

# A layer's local experts (e.g. the gpt kind's ``Experts``): rows grouped by expert, each group's row count
# -> the outputs in the same order.
GroupedExperts = Callable[[torch.Tensor, list[int]], torch.Tensor]


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, receive: list[int], send: list[int], dispatch: "ExpertAllToAll"):
        ctx.receive, ctx.send, ctx.dispatch = receive, send, dispatch
        return dispatch.exchange(x, receive, send)

    @staticmethod
    def backward(ctx, grad):
        return ctx.dispatch.exchange(grad.contiguous(), ctx.send, ctx.receive), None, None, None


class ExpertAllToAll:
    def __init__(self, group: dist.ProcessGroup, size: int, index: int, num_experts: int):
        self.group, self.size, self.index = group, size, index
        self.local_experts = num_experts // size
        self.bytes_sent = 0

    def exchange(self, x: torch.Tensor, receive: list[int], send: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(receive), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), receive, send, group=self.group)
        row = math.prod(x.shape[1:]) * x.element_size()
        self.bytes_sent += (sum(send) - send[self.index]) * row
        return out

    def __call__(self, experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        n, local = self.size, self.local_experts
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts.contiguous(), group=self.group)
        self.bytes_sent += (n - 1) * local * counts.element_size()
        host = torch.stack([counts, incoming]).cpu()
        sent, arrived = host[0].view(n, local), host[1].view(n, local)  # [peer, its expert] and [source, my expert]
        send, receive = sent.sum(1).tolist(), arrived.sum(1).tolist()
        received = _Exchange.apply(x, receive, send, self)
        order = _expert_major(arrived).to(x.device)
        out = experts(received[order], arrived.sum(0).tolist())
        back = torch.empty_like(order)
        back[order] = torch.arange(len(order), device=order.device)
        return _Exchange.apply(out[back], send, receive, self)


def _expert_major(arrived: torch.Tensor) -> torch.Tensor:
    """Indices that reorder rows laid out source-major (``arrived[s, e]`` rows from source ``s`` for
    expert ``e``) into expert-major order."""
    starts = (arrived.flatten().cumsum(0) - arrived.flatten()).view_as(arrived)
    pieces = [torch.arange(int(starts[s, e]), int(starts[s, e] + arrived[s, e]), dtype=torch.long, device="cpu")
              for e in range(arrived.shape[1]) for s in range(arrived.shape[0])]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device="cpu")


def shard_experts(experts: nn.Module, mesh) -> None:
    """Keep this rank's experts (a ``moe.Experts``: stacked w1, w3, w2) as DTensor shards over the EP mesh
    (every rank built all of them alike)."""
    index, size = mesh.get_local_rank(), mesh.size()
    for name in ("w1", "w3", "w2"):
        full = getattr(experts, name)
        local = full.detach().chunk(size, dim=0)[index].clone()
        setattr(experts, name, nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False)))


def is_expert_weight(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert-parallel shard (a DTensor over an EP mesh)."""
    return isinstance(param, DTensor) and param.device_mesh.mesh_dim_names == ("ep",)
