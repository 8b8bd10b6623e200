"""Per-module optimizer settings (the ``optim:`` block of a module) and the AdamW they build."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor


@dataclass
class OptimizerConfig:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.0
    eps: float = 1e-8
    warmup_steps: int = 0  # linear warmup from lr/warmup_steps
    decay_steps: int = 0  # cosine decay to 10% of lr over this many steps after warmup (0: constant)

    def lr_at(self, step: int) -> float:
        """Learning rate for 0-based optimizer step ``step``."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.decay_steps <= 0:
            return self.lr
        progress = min(1.0, (step - self.warmup_steps) / self.decay_steps)
        return self.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def build_adamw(model: nn.Module, config: OptimizerConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        model.parameters(),
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        weight_decay=config.weight_decay,
        eps=config.eps,
    )


def clip_gradients(params: list[torch.nn.Parameter], limit: float) -> float:
    """The gradient norm over every parameter (TP shards gathered), scaled down to ``limit`` (0: off)."""
    grads = [p.grad for p in params if p.grad is not None]
    full = [g.full_tensor() if isinstance(g, DTensor) else g for g in grads]
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in full))
    if limit > 0 and norm > limit:
        for g in grads:
            g.mul_(limit / (norm + 1e-6))
    return norm
