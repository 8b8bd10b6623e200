"""Model FLOPs of a training step, the figure MFU divides: Megatron's per-layer count.

Every matmul costs 2·m·n·k; attention adds the score and value products over the whole s×s matrix
(causal masking is not discounted, as in Megatron and PaLM); a mixture of experts counts the experts a
token goes through (active parameters) and its router; backward costs twice the forward, so a
training step is 3× the forward. Recomputed activations are not counted again (model FLOPs, not
hardware FLOPs).

Each kind brings its own closed form through the contract (``Kind.forward_flops``; the GPT's and the
vision encoder's live in their folders, ``hetero/models/gpt/flops.py`` and ``hetero/models/vit/flops.py``).
Modules without one (GeneZip's dynamic chunking, the video generator) are counted by running one forward
under ``torch.utils.flop_counter`` with attention included (``counted_forward_flops``).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

TRAINING_MULTIPLIER = 3  # forward + backward (input and weight gradients)


def projector_forward_flops_per_image(in_size: int, out_size: int, tokens: int) -> float:
    """Forward FLOPs of an MLP projector (two matmuls) over one image's ``tokens``."""
    return 2 * tokens * (in_size * out_size + out_size * out_size)


def counted_forward_flops(model: torch.nn.Module, *inputs: torch.Tensor) -> float:
    """FLOPs of one forward of ``model`` as torch's flop counter sees them, CPU attention kernels included."""
    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops}
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        model(*inputs)
    return float(counter.get_total_flops())


def _attention_flops(query: torch.Size, key: torch.Size, value: torch.Size, *args, out_shape=None, **kwargs) -> int:
    """Scores and weighted values of (batch, heads, seq, head_dim) attention, from the operands' shapes
    (torch's counter knows only the GPU attention kernels)."""
    batch, heads, queries, head_dim = query
    return 2 * batch * heads * queries * key[-2] * (head_dim + value[-1])
