"""Vision encoder: a ViT (hetero's own, or a SigLIP or CLIP tower) and, optionally, an MLP projector into
the LLM's width."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hetero.kernels.attention import merge_heads, split_heads
from hetero.models.projector.model import MLPProjector
from hetero.models.vit.config import ViTConfig


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATION = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "quick_gelu": quick_gelu}


class PatchEmbedding(nn.Module):
    """A linear map of each flattened patch. The weight keeps a convolution's (out, channels, p, p) shape, or
    over ``frames`` > 1 a Conv3d's (out, channels, frames, p, p), as vision checkpoints store it, and draws
    its initial values as ``nn.Linear`` does."""

    def __init__(self, channels: int, patch_size: int, out: int, bias: bool, frames: int = 1):
        super().__init__()
        depth = (frames,) if frames > 1 else ()
        self.weight = nn.Parameter(torch.empty(out, channels, *depth, patch_size, patch_size))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(channels * frames * patch_size**2)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return F.linear(patches, self.weight.flatten(1), self.bias)


class EncoderAttention(nn.Module):
    """Bidirectional multi-head self-attention (every patch sees every patch)."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_heads
        self.wq = nn.Linear(config.hidden_size, config.hidden_size)
        self.wk = nn.Linear(config.hidden_size, config.hidden_size, bias=config.key_bias)
        self.wv = nn.Linear(config.hidden_size, config.hidden_size)
        self.wo = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, images: list[int] | None = None) -> torch.Tensor:
        """``images``: packed images' patch counts along the sequence; each patch attends to its own
        image's, one image at a time (no cross-image scores computed). None: every patch to every one."""
        q, k, v = (split_heads(w(x), self.head_dim) for w in (self.wq, self.wk, self.wv))
        if images is None or len(images) <= 1:  # one image (or none): the whole sequence
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            out = torch.cat([F.scaled_dot_product_attention(*parts) for parts in
                             zip(q.split(images, 2), k.split(images, 2), v.split(images, 2))], 2)
        return self.wo(merge_heads(out))


class EncoderMLP(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.ffn_size)
        self.w2 = nn.Linear(config.ffn_size, config.hidden_size)
        self.activation = ACTIVATION[config.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.activation(self.w1(x)))


class EncoderBlock(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.attention = EncoderAttention(config)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = EncoderMLP(config)

    def forward(self, x: torch.Tensor, images: list[int] | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), images)
        return x + self.mlp(self.mlp_norm(x))


class PatchMerger(nn.Module):
    """Each ``merge`` × ``merge`` block of neighbouring patches (a row-major grid ``side`` wide) into one
    token: a LayerNorm of each patch, the block's patches side by side, then Linear-GELU-Linear into
    ``out_size`` (Qwen2-VL's merger)."""

    def __init__(self, hidden_size: int, merge: int, out_size: int, eps: float):
        super().__init__()
        self.merge, width = merge, hidden_size * merge**2
        self.norm = nn.LayerNorm(hidden_size, eps=eps)
        self.proj_in = nn.Linear(width, width)
        self.proj_out = nn.Linear(width, out_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, patches, hidden = x.shape
        side, m = math.isqrt(patches), self.merge
        x = self.norm(x).view(batch, side // m, m, side // m, m, hidden).permute(0, 1, 3, 2, 4, 5)
        return self.proj_out(F.gelu(self.proj_in(x.reshape(batch, patches // m**2, m * m * hidden))))


class VisionEncoder(nn.Module):
    """ViT: patch embedding, a class token (where the variant has one), learned positions, pre-norm blocks.

    ``forward(images)`` returns (batch, feature_tokens, out_size): the features of block ``feature_layer``
    with the class token dropped, normalized (``feature_norm``), and projected (Linear-GELU-Linear) into
    the LLM's width where the encoder holds its ``projector``, or merged ``merge`` × ``merge`` into one
    token each (``PatchMerger``). A pipeline stage (``keep_stage``) holds
    some of the blocks: the first embeds the images, later ones take the previous stage's hidden states
    (batch, seq_len, hidden_size), and all but the last hand theirs on.
    """

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbedding(config.channels, config.patch_size, config.hidden_size, config.patch_bias)
        self.cls_token = nn.Parameter(torch.zeros(config.hidden_size)) if config.class_token else None
        self.pos_embed = nn.Parameter(torch.zeros(config.seq_len, config.hidden_size))
        self.pre_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps) if config.pre_norm else None
        self.layers = nn.ModuleDict({str(i): EncoderBlock(config) for i in range(config.used_layers)})
        # Pre-norm blocks leave the residual stream at the scale of the small initial weights; the
        # norm hands the projector unit-scale features, so image embeddings reach the LLM at the
        # scale of its token embeddings instead of vanishing under its RMSNorm epsilon.
        self.feature_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps) if config.feature_norm else None
        self.projector = MLPProjector(config.hidden_size, config.out_size) if config.projector else None
        self.merger = (PatchMerger(config.hidden_size, config.merge, config.out_size, config.norm_eps)
                       if config.merge > 1 else None)
        self.is_last_stage = True
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, PatchEmbedding)):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.pos_embed, std=0.02)

    def patches(self, images: torch.Tensor) -> torch.Tensor:
        """(batch, channels, H, W) -> (batch, num_patches, channels * patch * patch), row-major patches."""
        p = self.config.patch_size
        batch, channels, height, width = images.shape
        x = images.reshape(batch, channels, height // p, p, width // p, p)
        return x.permute(0, 2, 4, 1, 3, 5).reshape(batch, (height // p) * (width // p), channels * p * p)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(self.patches(images))
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], 1, -1), x], dim=1)
        x = x + self.pos_embed
        return self.pre_norm(x) if self.pre_norm is not None else x

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """Images (batch, channels, H, W) on the first stage, hidden states on later ones; with ``grids``,
        images at their own sizes, packed (``forward_packed``)."""
        if grids is not None:
            return self.forward_packed(x, grids)
        if x.dim() == 4:
            x = self.embed(x)
        for block in self.layers.values():
            x = block(x)
        if not self.is_last_stage:
            return x
        return self.features(x[:, int(self.config.class_token and not self.config.class_feature):])

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if self.feature_norm is not None:
            x = self.feature_norm(x)
        if self.merger is not None:
            return self.merger(x)
        return self.projector(x) if self.projector is not None else x

    def grid_positions(self, height: int, width: int) -> torch.Tensor:
        """The learned positions (an image_size grid) resized to a grid of ``height`` × ``width`` patches
        (bilinear; the trained grid itself comes back unchanged): (height * width, hidden_size)."""
        side = self.config.image_size // self.config.patch_size
        table = self.pos_embed[int(self.config.class_token):]
        if (height, width) == (side, side):
            return table
        grid = table.view(1, side, side, -1).permute(0, 3, 1, 2)
        resized = F.interpolate(grid, size=(height, width), mode="bilinear", align_corners=False)
        return resized[0].permute(1, 2, 0).reshape(height * width, -1)

    def forward_packed(self, patches: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """Images at their own sizes, packed: ``patches`` (total, channels * patch * patch), image after
        image, each row-major over its ``grids`` entry (height, width in patches). Projections and MLPs
        run on the whole packed sequence, attention image by image (no score between two images is
        computed); a replica without images runs its blocks on none (FSDP2's gathers need every
        replica). Returns (total, out_size). Call it through ``forward`` (``grids=``) where FSDP2's
        hooks must run."""
        x = self.patch_embed(patches)
        if grids:
            x = x + torch.cat([self.grid_positions(h, w) for h, w in grids])
        if self.pre_norm is not None:
            x = self.pre_norm(x)
        images = [h * w for h, w in grids]
        x = x[None]
        for block in self.layers.values():
            x = block(x, images)
        return self.features(x[0])

