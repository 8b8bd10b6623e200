"""Vision encoder: a ViT and an MLP projector into the LLM's width."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetero.kernels.attention import merge_heads, split_heads
from hetero.kinds.vit.config import ViTConfig




class EncoderAttention(nn.Module):
    """Bidirectional multi-head self-attention (every patch sees every patch)."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_heads
        self.wq = nn.Linear(config.hidden_size, config.hidden_size)
        # No key bias: it adds the same score to every key of a query, which softmax cancels exactly.
        self.wk = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.wv = nn.Linear(config.hidden_size, config.hidden_size)
        self.wo = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(w(x), self.head_dim) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.wo(merge_heads(out))


class EncoderMLP(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.ffn_size)
        self.w2 = nn.Linear(config.ffn_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class EncoderBlock(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.hidden_size)
        self.attention = EncoderAttention(config)
        self.mlp_norm = nn.LayerNorm(config.hidden_size)
        self.mlp = EncoderMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class VisionEncoder(nn.Module):
    """ViT (patch embedding, class token, learned positions, pre-norm blocks) and an MLP projector.

    ``forward(images)`` returns (batch, num_patches, out_size): the features of block ``feature_layer``
    with the class token dropped, normalized, and projected (Linear-GELU-Linear) into the LLM's width.
    """

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.config = config
        patch_dim = config.channels * config.patch_size**2
        self.patch_embed = nn.Linear(patch_dim, config.hidden_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size))
        self.pos_embed = nn.Parameter(torch.zeros(1, config.seq_len, config.hidden_size))
        used = config.feature_layer % config.num_layers + 1  # blocks after the feature layer never run
        self.layers = nn.ModuleDict({str(i): EncoderBlock(config) for i in range(used)})
        # Pre-norm blocks leave the residual stream at the scale of the small initial weights; the
        # norm hands the projector unit-scale features, so image embeddings reach the LLM at the
        # scale of its token embeddings instead of vanishing under its RMSNorm epsilon.
        self.feature_norm = nn.LayerNorm(config.hidden_size)
        self.proj_in = nn.Linear(config.hidden_size, config.out_size)
        self.proj_out = nn.Linear(config.out_size, config.out_size)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.pos_embed, std=0.02)

    def patches(self, images: torch.Tensor) -> torch.Tensor:
        """(batch, channels, H, W) -> (batch, num_patches, channels * patch * patch), row-major patches."""
        p = self.config.patch_size
        batch, channels, height, width = images.shape
        x = images.reshape(batch, channels, height // p, p, width // p, p)
        return x.permute(0, 2, 4, 1, 3, 5).reshape(batch, (height // p) * (width // p), channels * p * p)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(self.patches(images))
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.layers.values():
            x = block(x)
        return self.proj_out(F.gelu(self.proj_in(self.feature_norm(x[:, 1:]))))
