"""Rotary position embeddings: frequencies (with Llama 3's and YaRN's scalings), M-RoPE's axes, the
cos/sin tables of given positions, and the rotation of a head's channels by them."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hetero.models.gpt.config import GPTConfig, RopeScaling


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                     device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """The rotary inverse frequencies (head_dim // 2), stretched by ``scaling``, and the factor that
    scales cos and sin (YaRN's; 1 otherwise)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = 1.0 / theta**exponents
    if scaling is None or scaling.type == "none":
        return inv_freq, 1.0
    factor, context = scaling.factor, scaling.original_max_position
    if scaling.type == "llama3":
        # Long wavelengths (past context / low_freq_factor) slow down by ``factor``, short ones (below
        # context / high_freq_factor) keep theirs, and those between blend linearly in context / wavelength.
        wavelength = 2 * math.pi / inv_freq
        blend = ((context / wavelength - scaling.low_freq_factor)
                 / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0.0, 1.0)
        return (1 - blend) * inv_freq / factor + blend * inv_freq, 1.0
    # yarn: dimensions that turn fewer than beta_slow times over the original context are interpolated
    # (divided by factor), those that turn more than beta_fast times kept, with a linear ramp between.
    def dimension(rotations: float) -> float:
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dimension(scaling.beta_fast)), 0)
    high = min(math.ceil(dimension(scaling.beta_slow)), head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low)
            / max(high - low, 1e-3)).clamp(0.0, 1.0)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    attention = scaling.attention_factor
    if attention is None:
        attention = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq, attention


def mrope_axes(sections: Sequence[int], interleaved: bool, device: torch.device | None = None) -> torch.Tensor:
    """Which position (0 temporal, 1 height, 2 width) turns each rotary frequency under M-RoPE: contiguous
    sections, or height and width on every third frequency (1, 4, ... and 2, 5, ...) as far as their
    counts reach and temporal on the rest."""
    temporal, height, width = sections
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3, device=device), torch.tensor([temporal, height, width], device=device))
    frequency = torch.arange(temporal + height + width, device=device)
    axes = torch.zeros_like(frequency)
    axes[(frequency % 3 == 1) & (frequency < 3 * height)] = 1
    axes[(frequency % 3 == 2) & (frequency < 3 * width)] = 2
    return axes


def rope_angles(head_dim: int, positions: torch.Tensor, theta: float, scaling: RopeScaling | None = None,
                mrope: tuple[Sequence[int], bool] | None = None) -> tuple[torch.Tensor, float]:
    """Rotary angles (*positions' rows, seq, head_dim) and the factor scaling cos and sin, for absolute
    positions (seq,), one row each (batch, seq), or under M-RoPE (3, batch, seq): temporal, height and width
    positions, each turning its share of the frequencies (``mrope``: the sections and whether they are
    interleaved, ``mrope_axes``)."""
    inv_freq, attention = rope_frequencies(head_dim, theta, scaling, positions.device)
    angles = positions.to(torch.float32)[..., None] * inv_freq
    if positions.dim() == 3:
        if mrope is None:
            raise ValueError("positions (3, batch, seq) are M-RoPE's, but the model has no mrope_sections")
        axes = mrope_axes(*mrope, device=positions.device)
        angles = angles.gather(0, axes.expand(1, *angles.shape[1:])).squeeze(0)
    return torch.cat([angles, angles], dim=-1), attention


def rope_tables(head_dim: int, positions: torch.Tensor, theta: float, scaling: RopeScaling | None = None,
                mrope: tuple[Sequence[int], bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles of ``positions`` (``rope_angles``), each (seq or batch, seq, head_dim)."""
    angles, attention = rope_angles(head_dim, positions, theta, scaling, mrope)
    return angles.cos() * attention, angles.sin() * attention


def mrope_of(config: GPTConfig) -> tuple[Sequence[int], bool] | None:
    """``rope_angles``' ``mrope`` for ``config``: None without M-RoPE."""
    return (config.mrope_sections, config.mrope_interleaved) if config.mrope_sections else None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, heads, seq, head_dim) by the position tables (seq, rotary) or, one row each,
    (batch, seq, rotary): the first ``rotary`` channels of each head (all of them, or partial rotary's part)."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    if (turned := cos.shape[-1]) < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :turned], cos, sin), x[..., turned:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
