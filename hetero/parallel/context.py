"""Context-parallel (CP) causal attention: the sequence is split over the ranks of a CP group.

Layout ("zigzag"). A sequence of length S is cut into 2*cp chunks of S/(2*cp) tokens. CP rank r holds
chunk r followed by chunk 2*cp-1-r, i.e. S/cp tokens. Under a causal mask the cost of a query grows with
its position, so pairing an early chunk with the mirrored late chunk gives every rank the same amount of
attention work; a plain contiguous split would leave the last rank with most of it.

Attention runs block by block (``context_attention``): each (query chunk, key chunk) block is empty,
causal on the diagonal, or full, merged by log-sum-exp, with K/V either all-gathered over the CP group
(``cp_attention: allgather``, each rank holds all S keys) or passed around it as a ring (``ring``, S/cp
keys at a time, each transfer overlapped with the previous block's compute). No (S/cp)×S mask is built.

Everything runs on gloo (CPU) and NCCL (GPU) alike: all-gather, reduce-scatter and point-to-point sends
(``torch.distributed.nn.functional`` is avoided because its backward needs ops gloo lacks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hetero.kernels.attention import causal_attention
from hetero.kernels.documents import Documents
from hetero.parallel.context_attention import allgather_attention, ring_attention
from hetero.parallel.options import CP_ATTENTION
from hetero.parallel.torch_compat import all_gather_single, reduce_scatter_single


def zigzag_indices(
    seq_len: int, cp: int, rank: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions held by CP ``rank``, in local order: chunk ``rank``, then chunk ``2*cp-1-rank``."""
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"need cp >= 1 and 0 <= rank < cp, got cp={cp}, rank={rank}")
    if seq_len % (2 * cp) != 0:
        raise ValueError(f"seq_len={seq_len} is not divisible by 2*cp={2 * cp}")
    chunk = seq_len // (2 * cp)
    offsets = torch.arange(chunk, device=device)
    return torch.cat([rank * chunk + offsets, (2 * cp - 1 - rank) * chunk + offsets])


def split_for_cp(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """This rank's part of a full-sequence tensor, whose sequence lies along ``dim``."""
    return x.index_select(dim, zigzag_indices(x.shape[dim], cp, rank, device=x.device))


class _AllGather(torch.autograd.Function):
    """Concatenate every rank's tensor along dim 0; the gradient is reduce-scattered (summed) back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        all_gather_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        world = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
        reduce_scatter_single(out, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def gather_from_cp(local: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of ``split_for_cp``: all-gather the local parts over ``group``, in global sequence order.

    Autograd-aware: the gradient of the full tensor is summed over the group and sliced back per rank.
    """
    cp = dist.get_world_size(group)
    gathered = _AllGather.apply(local.movedim(dim, 0), group).movedim(0, dim)
    seq_len = gathered.shape[dim]
    # Gathered order is rank 0's positions, then rank 1's, ...; argsort maps it to global order.
    positions = torch.cat([zigzag_indices(seq_len, cp, r, device=local.device) for r in range(cp)])
    return gathered.index_select(dim, torch.argsort(positions))


class ContextParallelAttention(torch.nn.Module):
    """Causal attention over a sequence split zigzag-wise across the CP group (see the module docstring).

    ``forward(q, k, v)`` takes this rank's (batch, heads, S/cp, head_dim) parts and returns the output for
    its local queries, causal over global positions. k/v may have fewer heads than q (GQA), and v's heads
    may be narrower than k's (multi-head latent attention). ``documents``
    (packed rows): the whole rows' document ids; a token sees only its own document. ``method``:
    ``ring`` or ``allgather``. With cp == 1 it is ``causal_attention`` and ``group`` is not used.
    """

    def __init__(self, group: dist.ProcessGroup, cp: int, rank: int, method: str = "ring", kernel: str = "auto"):
        super().__init__()
        if cp > 1 and (dist.get_world_size(group) != cp or dist.get_rank(group) != rank):
            raise ValueError(
                f"cp={cp}, rank={rank} do not match the group: size {dist.get_world_size(group)}, "
                f"this process's rank in it {dist.get_rank(group)}"
            )
        if method not in CP_ATTENTION:
            raise ValueError(f"cp attention method {method!r} is not one of {', '.join(CP_ATTENTION)}")
        self.group, self.cp, self.rank, self.method, self.kernel = group, cp, rank, method, kernel

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        if self.cp == 1:
            return causal_attention(q, k, v, documents)
        if (width := v.shape[-1]) != k.shape[-1]:  # narrower values (multi-head latent attention): zero-padded,
            if width > k.shape[-1]:                # so that k and v travel and meet the kernels as one shape
                raise ValueError(f"v's heads are {width} wide, wider than k's {k.shape[-1]}")
            return self(q, k, F.pad(v, (0, k.shape[-1] - width)), documents)[..., :width]
        if self.method == "ring":
            return ring_attention(q, k, v, self.group, self.rank, self.cp, self.kernel, documents)
        k, v = gather_from_cp(k, 2, self.group), gather_from_cp(v, 2, self.group)
        return allgather_attention(q, k, v, self.rank, self.cp, self.kernel, documents)
