"""Per-module parallel settings beyond the layout's degrees (the ``parallel:`` block of a module)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hetero.parallel.compression.link import LinkConfig

PIPELINE_SCHEDULES = ("gpipe", "1f1b")
PRECISIONS = ("fp32", "bf16")
REDUCE_DTYPES = {"fp32": None, "bf16": torch.bfloat16}  # None: the gradients' own dtype (fp32)
CP_ATTENTION = ("ring", "allgather")


@dataclass
class ParallelOptions:
    sequence_parallel: bool = False  # shard norms and residuals over the sequence inside TP groups
    pipeline_schedule: str = "1f1b"
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    precision: str = "fp32"  # bf16: bf16 compute (autocast), fp32 master weights and gradients
    reduce_precision: str = "fp32"  # the dtype DP gradient sums travel in (plain all-reduce and FSDP2)
    grad_bucket_mb: float = 25.0  # gradient all-reduce bucket size for data parallelism
    fsdp: bool = False  # shard parameters, gradients and optimizer state over dp×cp with FSDP2
    cp_attention: str = "ring"  # under cp > 1: K/V passed around the CP group (ring) or all-gathered
    # A forward-only encoder on ranks of its own: how many of the next step's microbatches it computes
    # and sends while its consumers finish this step (0: none); their outputs wait at the receivers.
    forward_ahead: int = 0
    # a slower network under this module's data-parallel sync (compression.link): what it would cost
    simulated_link: LinkConfig = field(default_factory=LinkConfig)

    def errors(self, module: str) -> list[str]:
        errors = []
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            errors.append(
                f"{module}.parallel.pipeline_schedule={self.pipeline_schedule!r} is not one of "
                f"{', '.join(PIPELINE_SCHEDULES)}"
            )
        if self.precision not in PRECISIONS:
            errors.append(f"{module}.parallel.precision={self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.reduce_precision not in REDUCE_DTYPES:
            errors.append(f"{module}.parallel.reduce_precision={self.reduce_precision!r} is not one of "
                          f"{', '.join(REDUCE_DTYPES)}")
        if self.cp_attention not in CP_ATTENTION:
            errors.append(f"{module}.parallel.cp_attention={self.cp_attention!r} is not one of {', '.join(CP_ATTENTION)}")
        if self.forward_ahead < 0:
            errors.append(f"{module}.parallel.forward_ahead={self.forward_ahead} must be >= 0 (0: off)")
        if self.grad_bucket_mb <= 0:
            errors.append(f"{module}.parallel.grad_bucket_mb={self.grad_bucket_mb} must be > 0")
        errors += self.simulated_link.errors(f"{module}.parallel.simulated_link")
        if self.simulated_link.enabled and self.fsdp:
            errors.append(f"{module}.parallel.simulated_link puts hetero's gradient sync on a slower link; FSDP2 "
                          f"reduce-scatters itself: set {module}.parallel.fsdp=false or simulated_link.gbit_s=0")
        return errors
