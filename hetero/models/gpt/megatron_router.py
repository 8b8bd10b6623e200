"""megatron-core's top-k router carrying hetero's auxiliary losses in place of its own.

megatron-core routes as the native layer does (the same scores, top-k and gate normalization, dropless),
but its auxiliary losses are means over a microbatch, scaled in the backward by a process-wide factor
that its own schedules set. hetero's are sums over tokens that decompose over ranks and microbatches,
scaled by 1 / the global batch's tokens (``moe.py``). So megatron's are switched off
(``moe_router_load_balancing_type="none"``, no z-loss) and this router attaches hetero's to the routing
probabilities: the per-row balance, counted over whole rows, and the z-loss, both from the router's
logits. Imported only where megatron-core is installed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.moe.router import TopKRouter

from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.moe import Routing, with_aux_loss


class AuxLossRouter(TopKRouter, Routing):
    def __init__(self, *, config, pg_collection, gpt: GPTConfig):
        super().__init__(config=config, pg_collection=pg_collection)
        self.gpt = gpt
        self.aux_scale: float | None = None  # the forward's (``MegatronGPT.forward`` sets it)
        self.row_group: dist.ProcessGroup | None = None  # ranks holding other tokens of the same rows (TP)
        self.start_records(gpt.num_experts)

    def counts_this_forward(self) -> bool:
        # megatron-core's recompute runs the first forward without gradients and the counted one inside
        # the backward; without recompute the one forward runs with gradients
        return torch.is_grad_enabled()

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """The router's logits in the input's dtype, or in fp32 with ``router_fp32``, as the native router
        computes them (megatron-core 0.16.1's own gating names TransformerEngine's GEMM even where it is
        not installed)."""
        if not self.gpt.router_fp32:
            return F.linear(input, self.weight)
        with torch.autocast(input.device.type, enabled=False):
            return F.linear(input.float(), self.weight.float())

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """megatron-core's routing of ``logits`` (seq, batch, experts), its probabilities carrying the
        auxiliary losses times ``aux_scale`` into the backward."""
        seq, batch, num = logits.shape
        probs, routing_map = super().routing(logits, padding_mask)
        self.record(routing_map.sum(0), routing_map.shape[0] * self.gpt.top_k,
                    torch.zeros((), device=logits.device))
        if self.aux_scale is None:
            return probs, routing_map
        flat = logits.reshape(-1, num).float()
        scores = flat.softmax(-1) if self.gpt.gate == "softmax" else flat.sigmoid()
        row_of = torch.arange(batch, device=logits.device).repeat(seq)  # tokens are sequence-major
        row_counts = routing_map.view(seq, batch, num).sum(0).float()
        aux = self.aux_loss(self.gpt, flat, scores, row_counts, row_of, self.row_group)
        return with_aux_loss(probs, aux * self.aux_scale), routing_map
