"""Packed rows: several documents per row, each attending causally to itself only.

``Documents`` holds which document each token of a row belongs to, over the whole row (global positions,
before any CP split): ids non-decreasing along the row, a new id where a document starts (the packer's
tail of padding is a document of its own). Attention asks it for the mask of a block of (query positions,
key positions), both contiguous ranges of the row. Because documents are contiguous, a block is
classified from the ids at its ends alone, on the host copy, with no device sync:

- ``EMPTY``: no query shares a document with any key (the block is skipped);
- ``None``: every pair the causal rule allows is in one document (the plain causal or full block);
- a ``BlockMask``: an additive mask (0 or -inf) built on the device, and which queries have any key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockMask:
    additive: torch.Tensor  # (batch, 1, q_len, k_len): 0 where a query may see a key, -inf elsewhere
    has_keys: torch.Tensor  # (batch, 1, q_len) bool: queries that see at least one key of the block


EMPTY = "empty"


def document_positions(ids: torch.Tensor) -> torch.Tensor:
    """Positions (batch, seq) that restart at 0 where each document starts, for ids (batch, seq)."""
    index = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def document_errors(ids: torch.Tensor) -> list[str]:
    """What makes ``ids`` (batch, seq) unusable as document ids: a decrease along a row."""
    if ids.dim() != 2:
        return [f"documents must be (rows, positions), got shape {tuple(ids.shape)}"]
    falls = torch.nonzero(ids[:, 1:] < ids[:, :-1])
    if len(falls):
        row, at = (int(v) for v in falls[0])
        return [f"documents must not decrease along a row: row {row} falls from {int(ids[row, at])} to "
                f"{int(ids[row, at + 1])} at position {at + 1}; give each document of a row a larger id than the one before"]
    return []


class Documents:
    """Document ids of packed rows: ``host`` (batch, seq) on the CPU and the same on ``device``."""

    def __init__(self, host: torch.Tensor, device: torch.device):
        self.host = host.cpu()
        self.ids = self.host.to(device)
        self._blocks: dict[tuple, BlockMask | str | None] = {}

    def positions(self) -> torch.Tensor:
        """Each token's position within its document, on the device."""
        return document_positions(self.ids)

    def block(self, queries: slice, keys: slice, causal: bool, dtype: torch.dtype) -> BlockMask | str | None:
        """The mask of queries ``queries`` (positions of the row) against keys ``keys``. ``causal``: the two
        ranges are the same (a diagonal block); otherwise every key lies before every query."""
        key = (queries.start, queries.stop, keys.start, keys.stop, causal, dtype)
        if key not in self._blocks:
            self._blocks[key] = self._classify(queries, keys, causal, dtype)
        return self._blocks[key]

    def _classify(self, queries: slice, keys: slice, causal: bool, dtype: torch.dtype) -> BlockMask | str | None:
        host = self.host
        first_query, last_query = host[:, queries.start], host[:, queries.stop - 1]
        first_key, last_key = host[:, keys.start], host[:, keys.stop - 1]
        if causal:
            if bool((first_query == last_query).all()):
                return None
        else:
            if not bool((first_query == last_key).any()):
                return EMPTY
            if bool((last_query == first_key).all()):
                return None
        q, k = self.ids[:, queries], self.ids[:, keys]
        allowed = q[:, :, None] == k[:, None, :]
        if causal:
            allowed &= torch.ones(allowed.shape[1:], dtype=torch.bool, device=allowed.device).tril()
            has_keys = torch.ones(q.shape, dtype=torch.bool, device=q.device)
        else:
            has_keys = q == k[:, -1:]  # ids rise along the row: a query meets a key only in the last key's document
        additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))
        return BlockMask(additive[:, None], has_keys[:, None])
