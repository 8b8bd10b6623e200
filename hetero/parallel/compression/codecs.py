"""Compressed sums of a flat fp32 vector over replicas: what crosses the wire is the compressed payload.

A codec's ``exchange(v, comm, state)`` returns the sum over replicas of every replica's compressed ``v``
(decoded) and this replica's own decoded contribution, which error feedback subtracts from ``v`` to keep
what was not sent. ``state`` is a dict the caller keeps per bucket and checkpoints.

- ``TopK``: per segment of ``segment`` elements the ``k`` largest magnitudes, their in-segment indices
  packed at log2(segment) bits each and their values as fp32 or (``values``) 8-, 4- or 2-bit codes with bf16
  scales per block of kept values (what the codes leave out stays in the error-feedback residual),
  all-gathered: replicas pick different entries. With 2-bit values and segments of 4,096 (12-bit indices)
  this is SparseLoCo's payload.
- ``SharedTopK``: top-k whose indices every replica shares, so values sum in an all-reduce and the bytes
  per replica stay flat as replicas are added (``TopK``'s all-gather grows with them). Each call one
  replica in turn picks, per segment, the ``k`` largest magnitudes of its own vector; the indices (log2
  of the segment bits each, packed end to end: 10 bits in a segment of 1,024) reach the others in an
  all-reduce to which only it contributes, every replica's values at them in a
  second one: fp32, or through ``BlockQuant``'s two-phase sum (``values``: 8, 4 or 2 bits), whose bytes are
  flat in the replicas too. With ``union`` every replica picks its own top-k and all of them travel: the
  indices in an all-gather (their bytes grow with the replicas), every replica's values at the union of
  them in the sum (theirs do not): SparseLoCo's selection, with its values summed instead of gathered.
- ``RandomK``: the same ``ratio`` of entries on every replica (a generator seeded by the call count), so
  only the values travel, in a plain all-reduce.
- ``BlockQuant``: int8 or int4 codes with one bf16 scale per block (or 2-bit codes over two fitted bf16
  magnitudes, ``hetero.kernels.quantize``), summed in two phases: each replica
  sends chunk ``j`` of its codes to replica ``j`` (all-to-all), which decodes and sums its chunk, quantizes
  the sum again and all-gathers it. The second quantization keeps its own residual on the chunk's owner
  (``state["owner_residual"]``) and adds it back next time, so the sum carries no lasting bias either.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F

from hetero.kernels.formats import FITTED_BITS
from hetero.kernels.quantize import dequantize_blocks, quantize_blocks
from hetero.kernels.segment_topk import scatter_segments, segment_topk, segment_topk_indices
from hetero.parallel.compression.bit_packing import pack_bits, packed_words, unpack_bits
from hetero.parallel.compression.collective import Collective


class Codec(Protocol):
    biased: bool

    def exchange(self, v: torch.Tensor, comm: Collective, state: dict) -> tuple[torch.Tensor, torch.Tensor]: ...

    def exchange_with_feedback(
        self, grad: torch.Tensor, residual: torch.Tensor, comm: Collective, state: dict
    ) -> torch.Tensor: ...

    def contraction(self) -> float: ...


class _FeedbackByDifference:
    def exchange_with_feedback(
        self, grad: torch.Tensor, residual: torch.Tensor, comm: Collective, state: dict
    ) -> torch.Tensor:
        """Send ``grad + residual`` compressed; ``residual`` becomes what was left out. Returns the sum."""
        v = residual.add_(grad)
        total, own = self.exchange(v, comm, state)  # type: ignore[attr-defined]
        residual.sub_(own)
        return total


class TopK:
    biased = True

    def __init__(self, ratio: float, segment: int = 1024, values: BlockQuant | None = None):
        self.segment = segment
        self.k = max(1, round(ratio * segment))
        self.values = values
        self.index_bits = max(1, (segment - 1).bit_length())

    def contraction(self) -> float:
        """Worst-case ||C(x) - x||^2 / ||x||^2 (with fp32 values)."""
        return 1 - self.k / self.segment

    def exchange(self, v: torch.Tensor, comm: Collective, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        padded = _pad(v, self.segment)
        left_out = torch.zeros_like(padded)
        total = self._send(padded, left_out, comm)
        return total[: v.numel()], (padded - left_out)[: v.numel()]

    def exchange_with_feedback(
        self, grad: torch.Tensor, residual: torch.Tensor, comm: Collective, state: dict
    ) -> torch.Tensor:
        if grad.numel() % self.segment:  # the fused kernel needs whole segments
            padded_residual = _pad(residual, self.segment)
            total = self._send(_pad(grad, self.segment), padded_residual, comm)
            residual.copy_(padded_residual[: grad.numel()])
            return total[: grad.numel()]
        return self._send(grad, residual, comm)

    def _send(self, grad: torch.Tensor, residual: torch.Tensor, comm: Collective) -> torch.Tensor:
        values, indices = segment_topk(grad, residual, self.k, self.segment)
        count = values.numel()
        if self.values is None:
            value_bytes = values.view(-1).view(torch.uint8)
        else:  # quantized: what the codes leave out of the kept values stays in the residual
            codes, scales = self._quantize(values.view(-1))
            sent = self._dequantize(codes, scales, count).view_as(values)
            residual.view(-1, self.segment).scatter_add_(1, indices.long(), values - sent)
            value_bytes = torch.cat([codes, scales.view(torch.uint8)])
        index_bytes = pack_bits(indices.view(-1).long(), self.index_bits).view(torch.uint8)
        gathered = comm.all_gather(torch.cat([value_bytes, index_bytes]))
        split = value_bytes.numel()
        total = torch.zeros(grad.numel(), dtype=torch.float32, device=grad.device)
        for row in gathered:
            if self.values is None:
                got_values = _view(row[:split], torch.float32)
            else:
                code_bytes = codes.numel()
                got_values = self._dequantize(row[:code_bytes], _view(row[code_bytes:split], scales.dtype), count)
            got_indices = unpack_bits(_view(row[split:], torch.int32), self.index_bits, count)
            total += scatter_segments(got_values.view(values.shape), got_indices.view(indices.shape), grad.numel(),
                                      self.segment)
        return total

    def _quantize(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        codes, scales = quantize_blocks(_pad(values, self.values.block_size), self.values.bits, self.values.block_size)
        return codes, scales.reshape(-1)

    def _dequantize(self, codes: torch.Tensor, scales: torch.Tensor, count: int) -> torch.Tensor:
        return dequantize_blocks(codes, scales, self.values.bits, self.values.block_size)[:count]


class SharedTopK(_FeedbackByDifference):
    biased = True

    def __init__(self, ratio: float, segment: int = 1024, values: BlockQuant | None = None, union: bool = False):
        self.segment = segment
        self.k = max(1, round(ratio * segment))
        self.values = values
        self.union = union
        self.index_bits = max(1, (segment - 1).bit_length())

    def contraction(self) -> float:
        """Worst-case ||C(x) - x||^2 / ||x||^2 on a replica whose turn it is not: the chosen entries may hold
        none of its mass (with ``union``, each replica's own top-k is among them: that of ``TopK``)."""
        return 1 - self.k / self.segment if self.union else 1.0

    def exchange(self, v: torch.Tensor, comm: Collective, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        padded = _pad(v, self.segment)
        segments = padded.view(-1, self.segment)
        chosen = self._union(segments, comm) if self.union else self._in_turn(segments, comm, state)
        values = padded[chosen]
        if self.values is None:
            own = values.clone()
            comm.all_reduce(values)
        else:  # quantized: this replica's decoded values are what it sent
            values, own = self.values.exchange(values, comm, state.setdefault("values", {}))
        own = torch.zeros_like(padded).index_copy_(0, chosen, own)
        total = torch.zeros_like(padded).index_copy_(0, chosen, values)
        return total[: v.numel()], own[: v.numel()]

    def _in_turn(self, segments: torch.Tensor, comm: Collective, state: dict) -> torch.Tensor:
        """One replica's top-k, replicas taking turns call by call: positions in the padded vector, ascending."""
        calls = int(state.get("calls", 0))
        state["calls"] = calls + 1
        count = segments.shape[0] * self.k
        if comm.rank == calls % comm.size:  # this replica's turn to choose
            wire = pack_bits(segment_topk_indices(segments, self.k).view(-1), self.index_bits)
        else:
            wire = torch.zeros(packed_words(count, self.index_bits), dtype=torch.int32, device=segments.device)
        # a sum with one contributor carries its bits: each index log2(segment) bits, packed in int32 words
        comm.all_reduce(wire)
        return self._positions(unpack_bits(wire, self.index_bits, count).view(-1, self.k))

    def _union(self, segments: torch.Tensor, comm: Collective) -> torch.Tensor:
        """Every replica's own top-k, all-gathered (index bytes grow with the replicas, value bytes do not),
        merged: positions in the padded vector, ascending and each once."""
        count = segments.shape[0] * self.k
        mine = pack_bits(segment_topk_indices(segments, self.k).view(-1), self.index_bits)
        every = [self._positions(unpack_bits(row, self.index_bits, count).view(-1, self.k))
                 for row in comm.all_gather(mine)]
        return torch.unique(torch.cat(every))  # sorted; its size depends on the data (a host sync on a GPU)

    def _positions(self, indices: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(indices.shape[0], device=indices.device).unsqueeze(1) * self.segment
        return (indices + offsets).view(-1)


class RandomK(_FeedbackByDifference):
    biased = True  # unscaled, so that error feedback applies; the d/k-scaled variant is unbiased but noisy

    def __init__(self, ratio: float, seed: int = 0):
        self.ratio = ratio
        self.seed = seed

    def contraction(self) -> float:
        """Expected ||C(x) - x||^2 / ||x||^2."""
        return 1 - self.ratio

    def exchange(self, v: torch.Tensor, comm: Collective, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        calls = int(state.get("calls", 0))
        state["calls"] = calls + 1
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + calls)
        k = max(1, round(self.ratio * v.numel()))
        indices = torch.randperm(v.numel(), generator=generator)[:k].to(v.device)
        values = v[indices].contiguous()
        own = torch.zeros_like(v).index_copy_(0, indices, values)
        comm.all_reduce(values)
        total = torch.zeros_like(v).index_copy_(0, indices, values)
        return total, own


class BlockQuant(_FeedbackByDifference):
    biased = True  # round-to-nearest

    def __init__(self, bits: int, block_size: int = 64):
        self.bits = bits
        self.block_size = block_size

    def contraction(self) -> float:
        """Worst-case ||C(x) - x||^2 / ||x||^2: each element is off by at most half a step of absmax/qmax; at 2
        bits each magnitude is its group's mean, so a block's error is its groups' spread, at most ||x||^2."""
        if self.bits == FITTED_BITS:
            return 1.0
        limit = 2 ** (self.bits - 1) - 1
        return min(1.0, self.block_size / (4 * limit**2))

    def exchange(self, v: torch.Tensor, comm: Collective, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        n = comm.size
        padded = _pad(v, n * self.block_size)
        chunk = padded.numel() // n
        codes, scales = quantize_blocks(padded, self.bits, self.block_size)
        scales = scales.reshape(-1)
        own = dequantize_blocks(codes, scales, self.bits, self.block_size)
        outgoing = torch.cat([codes.view(n, -1), scales.view(n, -1).view(torch.uint8)], dim=1)
        incoming = comm.all_to_all(outgoing.view(-1)).view(n, -1)
        code_width = codes.numel() // n
        chunk_sum = torch.zeros(chunk, dtype=torch.float32, device=v.device)
        for row in incoming:
            chunk_sum += dequantize_blocks(
                row[:code_width], _view(row[code_width:], scales.dtype), self.bits, self.block_size
            )
        owner_residual = state.get("owner_residual")
        if owner_residual is None or owner_residual.numel() != chunk:
            owner_residual = torch.zeros_like(chunk_sum)
        chunk_sum += owner_residual
        sum_codes, sum_scales = quantize_blocks(chunk_sum, self.bits, self.block_size)
        sum_scales = sum_scales.reshape(-1)
        sent_sum = dequantize_blocks(sum_codes, sum_scales, self.bits, self.block_size)
        state["owner_residual"] = chunk_sum - sent_sum
        gathered = comm.all_gather(torch.cat([sum_codes, sum_scales.view(torch.uint8)]))
        total = torch.cat(
            [
                dequantize_blocks(row[: sum_codes.numel()], _view(row[sum_codes.numel() :], scales.dtype),
                                  self.bits, self.block_size)
                for row in gathered
            ]
        )
        return total[: v.numel()], own[: v.numel()]


def _view(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes of a received payload as ``dtype`` (copied when their offset is not aligned for it)."""
    if payload.storage_offset() % dtype.itemsize:
        payload = payload.clone()
    return payload.view(dtype)


def _pad(v: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = math.ceil(v.numel() / multiple) * multiple - v.numel()
    return F.pad(v, (0, extra)) if extra else v
