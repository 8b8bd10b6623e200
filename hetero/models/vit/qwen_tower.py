"""The vision towers of Qwen2.5-VL and Qwen3-VL at native resolution.

Input: the patches of any number of images and videos, packed, ``(patches, channels · temporal_patch ·
patch · patch)``, each image's in merge-block order (every ``merge × merge`` block of neighbouring patches
consecutive, blocks row-major: the order the Qwen processor writes), with each one's grid ``(t, h, w)`` in
patches (``t`` temporal patches of ``temporal_patch`` frames; a still image is one, its frame repeated).
Output: one token per merge block, ``(patches / merge², out_size)``, and for Qwen3-VL the DeepStack taps:
the same shape from the blocks in ``deepstack_layers``, each through its own merger.

What the two families share: a patch embedding over ``temporal_patch`` frames (a Conv3d's kernel, applied
as a linear map of the flattened patch), 2-D rotary positions in attention (height on the first half of
each head's frequencies, width on the second), attention within one temporal patch of one image only,
and a merger of each block's patches side by side into the LLM's width. Where they differ:

- Qwen2.5-VL: RMSNorm, a SwiGLU MLP with biases, no patch bias, and window attention: every block but
  those in ``full_attention_blocks`` attends within windows of ``window_size`` pixels (merge blocks of
  neighbouring rows and columns; the last window of a row or column takes what is left);
- Qwen3-VL: LayerNorm, a tanh-GELU MLP, a patch bias, a learned ``position_grid × position_grid`` table of
  positions resized to each image's grid (bilinear, corners aligned) and added after the patch embedding,
  and DeepStack taps.

Attention costs what the images cost: one scaled-dot-product call per window or temporal patch, never a
mask over the microbatch's patches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetero.models.gpt.rope import apply_rope
from hetero.models.vit.config import ViTConfig
from hetero.models.vit.model import PatchEmbedding

def _qwen3(config: ViTConfig) -> bool:
    return config.tower == "qwen3-vl"


def _norm(config: ViTConfig, width: int) -> nn.Module:
    return nn.LayerNorm(width, eps=1e-6) if _qwen3(config) else nn.RMSNorm(width, eps=1e-6)


class TowerAttention(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_heads
        # q, k and v apart (the checkpoints' fused ``qkv`` split on import) so that TP splits each by heads
        self.q, self.k, self.v = (nn.Linear(config.hidden_size, config.hidden_size) for _ in range(3))
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: list[int]) -> torch.Tensor:
        """``x`` (patches, hidden); ``groups``: consecutive lengths, each attending only within itself. Under
        TP this rank's heads only."""
        q, k, v = (f(x).unflatten(-1, (-1, self.head_dim)).transpose(0, 1) for f in (self.q, self.k, self.v))
        q, k = apply_rope(q[None], cos, sin)[0], apply_rope(k[None], cos, sin)[0]
        if len(groups) <= 1:  # one group, or none on a replica without images (FSDP2's gathers still run)
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            out = torch.cat([F.scaled_dot_product_attention(*parts) for parts in
                             zip(q.split(groups, 1), k.split(groups, 1), v.split(groups, 1))], 1)
        return self.proj(out.transpose(0, 1).flatten(1))


class TowerMLP(nn.Module):
    """SwiGLU with biases (Qwen2.5-VL) or Linear, tanh-GELU, Linear (Qwen3-VL)."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        width, inner = config.hidden_size, config.ffn_size
        self.gate = None if _qwen3(config) else nn.Linear(width, inner)
        self.up = nn.Linear(width, inner)
        self.down = nn.Linear(inner, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is None:
            return self.down(F.gelu(self.up(x), approximate="tanh"))
        return self.down(F.silu(self.gate(x)) * self.up(x))


class TowerBlock(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.attention_norm = _norm(config, config.hidden_size)
        self.attention = TowerAttention(config)
        self.mlp_norm = _norm(config, config.hidden_size)
        self.mlp = TowerMLP(config)

    def forward(self, x, cos, sin, groups):
        x = x + self.attention(self.attention_norm(x), cos, sin, groups)
        return x + self.mlp(self.mlp_norm(x))


class BlockMerger(nn.Module):
    """Each merge block's patches side by side, normed (per patch before, or as a whole after: DeepStack's
    mergers), then Linear-GELU-Linear into ``out_size``."""

    def __init__(self, config: ViTConfig, norm_after: bool = False):
        super().__init__()
        self.width = config.hidden_size * config.merge**2
        self.norm_after = norm_after
        self.norm = _norm(config, self.width if norm_after else config.hidden_size)
        self.proj_in = nn.Linear(self.width, self.width)
        self.proj_out = nn.Linear(self.width, config.out_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.width)) if self.norm_after else self.norm(x).reshape(-1, self.width)
        return self.proj_out(F.gelu(self.proj_in(x)))


class QwenVisionTower(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbedding(config.channels, config.patch_size, config.hidden_size, _qwen3(config),
                                          frames=config.temporal_patch)
        self.pos_embed = (nn.Parameter(torch.zeros(config.position_grid**2, config.hidden_size))
                          if _qwen3(config) else None)
        self.layers = nn.ModuleDict({str(i): TowerBlock(config) for i in range(config.num_layers)})
        self.merger = BlockMerger(config)
        self.deepstack = nn.ModuleDict({str(i): BlockMerger(config, norm_after=True) for i in config.deepstack_layers})
        if self.pos_embed is not None:
            nn.init.normal_(self.pos_embed, std=0.02)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        config, device = self.config, patches.device
        x = self.patch_embed(patches)
        if self.pos_embed is not None:  # on a replica without images too: FSDP2 reduces its (zero) gradient
            x = x + torch.cat([self.grid_positions(t, h, w) for t, h, w in grids] or [self.pos_embed[:0]])
        angles = self._rotary_angles(grids, device)
        frames = [h * w for t, h, w in grids for _ in range(t)]
        order, windows = self._windows(grids, device) if not _qwen3(config) else (None, frames)
        if order is not None:  # windows made consecutive, whole merge blocks at a time
            x, angles = x[order], angles[order]
        cos, sin = angles.cos(), angles.sin()
        taps = []
        for index, block in self.layers.items():
            full = _qwen3(self.config) or int(index) in self.config.full_attention_blocks
            x = block(x, cos, sin, frames if full else windows)
            if index in self.deepstack:
                taps.append(self.deepstack[index](x))
        merged = self.merger(x)
        if order is not None:
            back = torch.argsort(order[:: config.merge**2] // config.merge**2)
            merged, taps = merged[back], [tap[back] for tap in taps]
        return merged, taps

    def grid_positions(self, t: int, h: int, w: int) -> torch.Tensor:
        """The learned position table resized to ``h × w`` patches (bilinear, corners aligned), in
        merge-block order, repeated for each temporal patch: (t · h · w, hidden)."""
        side, m = self.config.position_grid, self.config.merge
        table = self.pos_embed.view(1, side, side, -1).permute(0, 3, 1, 2)
        grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0].permute(1, 2, 0)
        blocks = grid.reshape(h // m, m, w // m, m, -1).transpose(1, 2).reshape(h * w, -1)
        return blocks.repeat(t, 1)

    def _rotary_angles(self, grids, device) -> torch.Tensor:
        """(patches, head_dim): each patch's height angles then width angles, twice (rotated by halves)."""
        m, rows = self.config.merge, []
        for t, h, w in grids:
            hh, ww = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
            place = torch.stack([hh, ww], -1).reshape(h // m, m, w // m, m, 2).transpose(1, 2).reshape(h * w, 2)
            rows.append(place.repeat(t, 1))
        place = torch.cat(rows).to(torch.float32) if rows else torch.zeros(0, 2, device=device)
        spatial = self.config.hidden_size // self.config.num_heads // 2
        inv_freq = 1.0 / self.config.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32, device=device) / spatial)
        angles = torch.cat([place[:, :1] * inv_freq, place[:, 1:] * inv_freq], -1)
        return torch.cat([angles, angles], -1)

    def _windows(self, grids, device) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL's windows: the order that makes each window's patches consecutive (whole merge blocks,
        windows row-major within each temporal patch) and the windows' lengths in patches."""
        config = self.config
        m, side = config.merge, config.window_size // (config.merge * config.patch_size)
        unit, order, lengths, first = m * m, [], [], 0
        for t, h, w in grids:
            bh, bw = h // m, w // m
            blocks = torch.arange(t * bh * bw, device=device).view(t, bh, bw) + first
            for frame in blocks:
                for top in range(0, bh, side):
                    for left in range(0, bw, side):
                        window = frame[top:top + side, left:left + side].reshape(-1)
                        order.append(window)
                        lengths.append(len(window) * unit)
            first += t * bh * bw
        blocks = torch.cat(order) if order else torch.zeros(0, dtype=torch.long, device=device)
        return (blocks[:, None] * unit + torch.arange(unit, device=device)).reshape(-1), lengths
