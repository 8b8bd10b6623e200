"""Causal attention over a zigzag CP split, block by block: by all-gather of K/V, or around a ring.

A CP rank holds two chunks of the sequence (``context.zigzag_indices``): query chunks ``r`` and
``2*cp-1-r``. Against key chunk ``j`` a query chunk ``i`` is a *full* block when ``j < i``, a *causal*
block on the diagonal (``j == i``), and empty when ``j > i``, so no block needs a mask beyond SDPA's own
``is_causal``, and empty blocks are never computed. The blocks of one query chunk are merged by their
log-sum-exp; the backward runs each block's backward with the merged output and log-sum-exp, which is
exact (``hetero.kernels.block_attention``). Packed rows (``documents``) refine each block by its
document mask (``Documents.block``): blocks that no document spans are skipped, those inside one
document stay plain, the others carry a mask. Every rank holds every row's document ids, so the ring
needs nothing more on the wire.

- ``allgather_attention``: K/V gathered over the CP group in global order (autograd-aware: their
  gradients reduce-scatter back), then per query chunk one full block over every earlier key and one
  causal block. One collective per tensor; each rank holds all S keys.
- ``ring_attention``: each rank starts with its own K/V; in ``cp`` steps every K/V block visits every
  rank (sent to the next rank, received from the previous one), the next block's transfer posted before
  the current block's compute, so it overlaps. Each rank holds two K/V blocks (S/cp positions) at a time.
  Backward passes the blocks around again with their gradient accumulators, which arrive home after the
  last step. Every rank posts the same sends and receives, in the same order and sizes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hetero.kernels.block_attention import block_backward, block_forward, merge_blocks
from hetero.kernels.documents import EMPTY, Documents


def block_kind(query_chunk: int, key_chunk: int) -> str | None:
    """``"full"``, ``"causal"`` or None (empty) for one (query chunk, key chunk) block of causal attention."""
    if key_chunk < query_chunk:
        return "full"
    return "causal" if key_chunk == query_chunk else None


def allgather_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, cp: int, kernel: str = "auto",
    documents: Documents | None = None,
) -> torch.Tensor:
    """``q``: this rank's two query chunks (batch, heads, 2c, head_dim); ``k``/``v``: every chunk, gathered in
    global order (batch, kv_heads, 2·cp·c, head_dim)."""
    return _GatheredBlocks.apply(q, k, v, (rank, 2 * cp - 1 - rank), kernel, documents)


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, rank: int, cp: int,
    kernel: str = "auto", documents: Documents | None = None,
) -> torch.Tensor:
    """``q``, ``k``, ``v``: this rank's two chunks each (batch, heads or kv_heads, 2c, head_dim)."""
    return _Ring.apply(q, k, v, group, rank, cp, kernel, documents)


def _mask(documents: Documents | None, queries: slice, keys: slice, causal: bool, dtype: torch.dtype):
    """The document mask of a block (None without documents or where none is needed; ``EMPTY``: skip it)."""
    return documents.block(queries, keys, causal, dtype) if documents is not None else None


def _half(x: torch.Tensor, half: int) -> torch.Tensor:
    c = x.shape[2] // 2
    return x[:, :, half * c : (half + 1) * c]


def _chunk(x: torch.Tensor, index: int, size: int) -> torch.Tensor:
    return x[:, :, index * size : (index + 1) * size]


class _GatheredBlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, chunks: tuple[int, int], kernel: str, documents: Documents | None):
        c = q.shape[2] // 2
        outs, lses = [], []
        for half, i in enumerate(chunks):
            qi, parts = _half(q, half), []
            for keys, causal in _gathered_blocks(i, c):
                mask = _mask(documents, slice(i * c, (i + 1) * c), keys, causal, q.dtype)
                if mask is not EMPTY:
                    parts.append(block_forward(qi, k[:, :, keys], v[:, :, keys], causal, kernel, mask))
            out, lse = merge_blocks(parts)
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs, 2), torch.cat(lses, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunks, ctx.kernel, ctx.documents = chunks, kernel, documents
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        c = q.shape[2] // 2
        grad_q, grad_k, grad_v = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for half, i in enumerate(ctx.chunks):
            args = (_half(grad, half), _half(q, half))
            merged = (_half(out, half), lse[:, :, half * c : (half + 1) * c])
            for keys, causal in _gathered_blocks(i, c):
                mask = _mask(ctx.documents, slice(i * c, (i + 1) * c), keys, causal, q.dtype)
                if mask is EMPTY:
                    continue
                gq, gk, gv = block_backward(*args, k[:, :, keys], v[:, :, keys], *merged, causal, ctx.kernel, mask)
                _half(grad_q, half).add_(gq)
                grad_k[:, :, keys] += gk
                grad_v[:, :, keys] += gv
        return grad_q, grad_k, grad_v, None, None, None


def _gathered_blocks(i: int, c: int) -> list[tuple[slice, bool]]:
    """Query chunk ``i``'s blocks over the gathered keys: its own chunk (causal), then every earlier chunk
    at once (full; they are contiguous in global order)."""
    return [(slice(i * c, (i + 1) * c), True)] + ([(slice(0, i * c), False)] if i > 0 else [])


class _Shift:
    """``tensor`` sent to the next CP rank while the previous rank's arrives (posted now, waited later)."""

    def __init__(self, tensor: torch.Tensor, group: dist.ProcessGroup, rank: int, cp: int, tag: int):
        self.received = torch.empty_like(tensor)
        self.works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor, group=group, group_peer=(rank + 1) % cp, tag=tag),
            dist.P2POp(dist.irecv, self.received, group=group, group_peer=(rank - 1) % cp, tag=tag),
        ])

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


KV_TAG, GRAD_TAG = 11, 12


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, rank: int, cp: int, kernel: str, documents: Documents | None):
        c = q.shape[2] // 2
        mine = (rank, 2 * cp - 1 - rank)
        kv = torch.stack([k, v])
        merged: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]
        for step in range(cp):
            source = (rank - step) % cp
            upcoming = _Shift(kv, group, rank, cp, KV_TAG) if step < cp - 1 else None
            for half, i in enumerate(mine):
                for key_half, j in enumerate((source, 2 * cp - 1 - source)):
                    kind = block_kind(i, j)
                    mask = _ring_mask(documents, kind, i, j, c, q.dtype)
                    if kind is None or mask is EMPTY:
                        continue
                    part = block_forward(_half(q, half), _half(kv[0], key_half), _half(kv[1], key_half),
                                         kind == "causal", kernel, mask)
                    merged[half] = part if merged[half] is None else merge_blocks([merged[half], part])
            if upcoming is not None:
                kv = upcoming.wait()
        out = torch.cat([merged[0][0], merged[1][0]], 2)
        lse = torch.cat([merged[0][1], merged[1][1]], 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.rank, ctx.cp, ctx.kernel, ctx.documents = group, rank, cp, kernel, documents
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        group, rank, cp, kernel = ctx.group, ctx.rank, ctx.cp, ctx.kernel
        c = q.shape[2] // 2
        mine = (rank, 2 * cp - 1 - rank)
        wide = torch.promote_types(q.dtype, torch.float32)
        grad_q = torch.zeros(q.shape, dtype=wide, device=q.device)
        kv = torch.stack([k, v])
        grad_kv = torch.zeros(kv.shape, dtype=wide, device=kv.device)  # the visiting block's, travelling with it
        for step in range(cp):
            source = (rank - step) % cp
            upcoming = _Shift(kv, group, rank, cp, KV_TAG) if step < cp - 1 else None
            for half, i in enumerate(mine):
                merged = (_half(out, half), lse[:, :, half * c : (half + 1) * c])
                for key_half, j in enumerate((source, 2 * cp - 1 - source)):
                    kind = block_kind(i, j)
                    mask = _ring_mask(ctx.documents, kind, i, j, c, q.dtype)
                    if kind is None or mask is EMPTY:
                        continue
                    gq, gk, gv = block_backward(_half(grad, half), _half(q, half), _half(kv[0], key_half),
                                                _half(kv[1], key_half), *merged, kind == "causal", kernel, mask)
                    _half(grad_q, half).add_(gq)
                    _half(grad_kv[0], key_half).add_(gk)
                    _half(grad_kv[1], key_half).add_(gv)
            # after the last step this brings each rank its own block's accumulator, from every rank
            grad_kv = _Shift(grad_kv, group, rank, cp, GRAD_TAG).wait()
            if upcoming is not None:
                kv = upcoming.wait()
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None, None, None, None


def _ring_mask(documents: Documents | None, kind: str | None, i: int, j: int, c: int, dtype: torch.dtype):
    if kind is None:
        return None
    return _mask(documents, slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c), kind == "causal", dtype)
