"""When the Triton kernels run instead of their torch references."""

from __future__ import annotations

import importlib.util
import os

import torch


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """CUDA tensors take the Triton kernels; ``HETERO_TRITON=0`` forces the torch references everywhere."""
    return x.is_cuda and os.environ.get("HETERO_TRITON", "1") != "0" and triton_available()
