"""Apply a module's layout to a projector: its hidden units split over TP (column, then row parallel),
or FSDP2 over dp. Data parallelism is the runtime's gradient sync."""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hetero.models.projector.model import MLPProjector
from hetero.parallel.fsdp import apply_fsdp
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.options import ParallelOptions


def parallelize_projector(model: MLPProjector, mesh: ModuleMesh, options: ParallelOptions) -> MLPProjector:
    if mesh.layout.tp > 1:
        parallelize_module(model, mesh.mesh["tp"], {"proj_in": ColwiseParallel(), "proj_out": RowwiseParallel()})
    if options.fsdp:
        apply_fsdp(model, (), mesh, options)
    return model
