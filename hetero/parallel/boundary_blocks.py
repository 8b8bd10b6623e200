"""Where a boundary piece's elements sit in each side's local tensor, and its flat buffers.

A piece (``boundary_plan.Piece``) is a list of blocks, each a dense sub-box of both sides' local tensors;
its elements are the blocks flattened one after another (row-major), the canonical order both sides
derive alike. Senders gather them from their local tensor, receivers scatter them into theirs.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from hetero.parallel.boundary_plan import Block, Entry, Piece


class Values:
    """An entry's values, from flat per-piece buffers; ``packed_from`` packs them from local tensors on
    first use (once per piece)."""

    def __init__(
        self, flat: dict[int, torch.Tensor], tensors: Mapping[str, torch.Tensor] | None = None, side: str = ""
    ):
        self.flat = flat
        self.tensors = tensors
        self.side = side

    @classmethod
    def packed_from(cls, tensors: Mapping[str, torch.Tensor], side: str) -> Values:
        return cls({}, tensors, side)

    def __call__(self, entry: Entry) -> torch.Tensor:
        piece = entry.piece
        if piece.index not in self.flat:
            assert self.tensors is not None, "a buffer was not filled before its values were sent"
            self.flat[piece.index] = gather_blocks(self.tensors[piece.key], piece, self.side)
        return self.flat[piece.index][entry.start : entry.stop]


class OwnRange:
    """An entry's values from buffers that hold only this rank's receiver range of each piece."""

    def __init__(self, buffers: dict[int, torch.Tensor], rank: int):
        self.buffers = buffers
        self.rank = rank

    def __call__(self, entry: Entry) -> torch.Tensor:
        start = entry.piece.receiver_range(self.rank)[0]
        return self.buffers[entry.piece.index][entry.start - start : entry.stop - start]


def block_view(tensor: torch.Tensor, block: Block, side: str) -> torch.Tensor:
    view = tensor
    for dim, run in enumerate(block):
        start = run.src if side == "src" else run.dst
        if start != 0 or run.length != view.shape[dim]:
            view = view.narrow(dim, start, run.length)
    return view


def gather_blocks(tensor: torch.Tensor, piece: Piece, side: str) -> torch.Tensor:
    """The piece's elements in their canonical flat order, read from one side's local tensor."""
    views = [block_view(tensor, block, side).reshape(-1) for block in piece.blocks]
    return views[0] if len(views) == 1 else torch.cat(views)


def scatter_blocks(flat: torch.Tensor, tensor: torch.Tensor, piece: Piece, side: str) -> None:
    """Write the piece's flat elements into one side's local tensor."""
    offset = 0
    for block in piece.blocks:
        view = block_view(tensor, block, side)
        view.copy_(flat[offset : offset + view.numel()].view(view.shape))
        offset += view.numel()


def copy_blocks(source: torch.Tensor, destination: torch.Tensor, piece: Piece) -> None:
    for block in piece.blocks:
        block_view(destination, block, "dst").copy_(block_view(source, block, "src"))


def store(buffers: dict[int, torch.Tensor]) -> Callable[[Entry, torch.Tensor], None]:
    def put(entry: Entry, values: torch.Tensor) -> None:
        buffers[entry.piece.index][entry.start : entry.stop].copy_(values)

    return put


def part(flat: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    return flat[span[0] : span[1]]


def length(span: tuple[int, int]) -> int:
    return span[1] - span[0]
