"""FSDP2 over a module's flattened dp×cp ranks (parameters, gradients and optimizer state sharded)."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.options import REDUCE_DTYPES, ParallelOptions


def apply_fsdp(model: nn.Module, blocks: Iterable[nn.Module], mesh: ModuleMesh, options: ParallelOptions) -> None:
    """One FSDP unit per block plus the root; gradients are summed over replicas, not averaged, in
    ``reduce_precision`` (fp32 by default) into fp32 shards. Weights are gathered in fp32 and compute
    follows the module's autocast, as every module's does: gathering bf16 weights (``param_dtype``) rounds
    every weight, norms' included, and moved GeneZip's bf16 gradients at step 1 13% off the autocast
    reference, against 0.2% with fp32 gathers (measured, dp2)."""
    policy = MixedPrecisionPolicy(reduce_dtype=REDUCE_DTYPES[options.reduce_precision] or torch.float32)
    dp_cp = DeviceMesh.from_group(
        mesh.group("dp_cp"), mesh.mesh.device_type, mesh=list(mesh.group_ranks["dp_cp"]), mesh_dim_names=("dp_cp",)
    )
    units = [*blocks, model]
    for unit in units:
        fully_shard(unit, mesh=dp_cp, mp_policy=policy)
    for unit in units:
        # Each microbatch loss is already divided by the global token count, so replicas' gradients
        # are summed; plain SUM because gloo has no PREMUL_SUM.
        unit.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        unit.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
