"""M-RoPE positions of a row (Qwen2-VL and later): three per token (temporal, height, width), computed on
the host from where the row's images and videos sit and their grids, before the row is split for context
parallelism.

A text token's three positions are equal and count on from the token before. A vision span of a
``t × h × w`` grid (in the LLM's tokens, after the tower's spatial merge) takes, at token ``(k, i, j)``,
``start + floor(k · time_step)``, ``start + i``, ``start + j``, where ``start`` is the position the next
text token would have had; the text after it continues from the span's largest position plus one.
Positions restart at 0 in every document of a packed row.

For images (``t = 1``) and Qwen3-VL's videos (one span per frame) this is what transformers computes. For
a Qwen2.5-VL video of several temporal patches transformers 5.x continues at ``start + max(h, w)`` instead
of the largest position plus one, which lets text positions fall back below the video's last temporal
positions; hetero keeps the rule of the original Qwen2-VL release (``docs/qwen_vl.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VisionSpan:
    """An image or video in a row: its first token's index in the row, its grid in the LLM's tokens
    (temporal, height, width; ``t·h·w`` tokens in that order) and how far the temporal position moves
    per temporal step (Qwen2.5-VL videos: ``tokens_per_second`` × seconds per temporal patch)."""

    start: int
    grid: tuple[int, int, int]
    time_step: float = 1.0

    @property
    def tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w


def mrope_positions(length: int, spans: Sequence[VisionSpan], document_starts: Sequence[int] = (0,),
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """The (3, length) M-RoPE positions of a row of ``length`` tokens holding ``spans`` (in row order, none
    crossing a document's start) whose documents start at ``document_starts`` (0 first)."""
    if not document_starts or document_starts[0] != 0:
        raise ValueError(f"document_starts={list(document_starts)} must begin with 0")
    positions = torch.empty(3, length, dtype=torch.long, device=device)
    restarts = set(document_starts)
    pending = sorted(spans, key=lambda span: span.start)
    at, current = 0, 0
    while at < length:
        if at in restarts:
            current = 0
        if pending and pending[0].start == at:
            span = pending.pop(0)
            end = at + span.tokens
            if end > length or any(at < s < end for s in restarts):
                raise ValueError(f"the vision span at {at} of {span.tokens} tokens crosses the end of its "
                                 f"{'row' if end > length else 'document'}")
            block = _span_positions(span, current, device)
            positions[:, at:end] = block
            current, at = int(block.max()) + 1, end
            continue
        following = min([length, *(s for s in restarts if s > at), *(s.start for s in pending[:1])])
        positions[:, at:following] = torch.arange(current, current + following - at, device=device)
        current, at = current + following - at, following
    if pending:
        raise ValueError(f"the vision span at {pending[0].start} is not in the row's {length} tokens")
    return positions


def _span_positions(span: VisionSpan, start: int, device: torch.device | str) -> torch.Tensor:
    t, h, w = span.grid
    temporal = (torch.arange(t, device=device) * torch.tensor(span.time_step, dtype=torch.float32, device=device)).long()
    grid = torch.meshgrid(temporal, torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    return torch.stack(grid).reshape(3, -1) + start
