"""An MLP projector of an encoder's features into an LLM's width (LLaVA's Linear-GELU-Linear)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLPProjector(nn.Module):
    def __init__(self, in_size: int, out_size: int):
        super().__init__()
        self.proj_in = nn.Linear(in_size, out_size)
        self.proj_out = nn.Linear(out_size, out_size)

    def reset_parameters(self) -> None:
        for linear in (self.proj_in, self.proj_out):
            nn.init.normal_(linear.weight, std=0.02)
            nn.init.zeros_(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_out(F.gelu(self.proj_in(x)))
