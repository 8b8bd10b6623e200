"""Unsigned integers of ``bits`` bits each, laid end to end in int32 words, and back.

Value ``i`` takes bits ``i·bits`` .. ``i·bits + bits - 1`` of the stream (least significant first), so a
value may straddle two words. The words carry exactly these bits through a sum with any number of
all-zero contributions, which is how shared top-k sends one replica's indices in an all-reduce.
"""

from __future__ import annotations

import torch

WORD = 32


def packed_words(count: int, bits: int) -> int:
    """int32 words that ``count`` values of ``bits`` bits take."""
    return -(-count * bits // WORD)


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``values`` (1-D, each in 0 .. 2**bits - 1) as ``packed_words`` int32 words."""
    if not 1 <= bits <= WORD:
        raise ValueError(f"bits={bits} must be in 1..{WORD}")
    count = values.numel()
    start = torch.arange(count, device=values.device, dtype=torch.int64) * bits
    word, offset = start // WORD, start % WORD
    values = values.to(torch.int64)
    words = torch.zeros(packed_words(count, bits) + 1, dtype=torch.int64, device=values.device)
    words.scatter_add_(0, word, (values << offset) & 0xFFFFFFFF)  # bits of different values never overlap: + is |
    words.scatter_add_(0, word + 1, values >> (WORD - offset))  # what spills into the next word (0 if none)
    words = words[:-1]
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_bits(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` values of ``bits`` bits packed in ``words`` (``pack_bits``), as int64."""
    stream = torch.cat([words.to(torch.int64) & 0xFFFFFFFF, torch.zeros(1, dtype=torch.int64, device=words.device)])
    start = torch.arange(count, device=words.device, dtype=torch.int64) * bits
    word, offset = start // WORD, start % WORD
    joined = stream[word] | (stream[word + 1] << WORD)
    return (joined >> offset) & ((1 << bits) - 1)
