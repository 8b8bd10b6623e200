"""FSDP2 over a module's flattened dp×cp ranks (parameters, gradients and optimizer state sharded)."""

from __future__ import annotations

from typing import Iterable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from hetero.parallel.mesh import ModuleMesh


def apply_fsdp(model: nn.Module, blocks: Iterable[nn.Module], mesh: ModuleMesh) -> None:
    """One FSDP unit per block plus the root; gradients are summed over replicas, not averaged."""
    dp_cp = DeviceMesh.from_group(
        mesh.group("dp_cp"), mesh.mesh.device_type, mesh=list(mesh.group_ranks["dp_cp"]), mesh_dim_names=("dp_cp",)
    )
    units = [*blocks, model]
    for unit in units:
        fully_shard(unit, mesh=dp_cp)
    for unit in units:
        # Each microbatch loss is already divided by the global token count, so replicas' gradients
        # are summed; plain SUM because gloo has no PREMUL_SUM.
        unit.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        unit.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
