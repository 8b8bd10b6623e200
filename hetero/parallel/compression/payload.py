"""A codec's parts as one flat byte buffer and back: the wire format of a compressed point-to-point link."""

from __future__ import annotations

import math

import torch

from hetero.parallel.compression.activation_codecs import ActivationCodec, Parts, payload_bytes


def part_shapes(codec: ActivationCodec, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """Each part's shape for a tensor of ``shape``: the leading dims, then the part's own width."""
    return {name: (*shape[:-1], width) for name, (_, width) in codec.widths(shape[-1]).items()}


def pack(parts: Parts) -> torch.Tensor:
    """The parts' bytes, one after another in the order of their names."""
    chunks = [parts[name].contiguous().view(torch.uint8).reshape(-1) for name in sorted(parts)]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def unpack(codec: ActivationCodec, buffer: torch.Tensor, shape: tuple[int, ...]) -> Parts:
    """Views of ``buffer`` as the parts of a tensor of ``shape`` (no copy)."""
    expected = payload_bytes(codec, shape)
    if buffer.numel() != expected:
        raise ValueError(f"a payload of {buffer.numel()} bytes does not hold a {shape} tensor's {expected}")
    parts, offset = {}, 0
    shapes = part_shapes(codec, shape)
    widths = codec.widths(shape[-1])
    for name in sorted(widths):
        dtype = widths[name][0]
        nbytes = math.prod(shapes[name]) * dtype.itemsize
        parts[name] = buffer[offset : offset + nbytes].view(dtype).view(shapes[name])
        offset += nbytes
    return parts
