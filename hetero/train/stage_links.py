"""The links between a module's pipeline stages (plain P2P, or compressed per ``compression.pipeline``)
and the function-as-module a trainer's pipeline stage runs."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from hetero.parallel.compressed_p2p import CompressedNextLink, CompressedPreviousLink
from hetero.parallel.compression.edge import EdgeEnd
from hetero.parallel.compression.edge_config import EdgeCompressionConfig
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.pipeline import P2PTransport
from hetero.train.module_runtime import ModuleRuntime


def llm_stage_edges(module: ModuleRuntime | None, config: EdgeCompressionConfig) -> dict[str, EdgeEnd]:
    """This rank's ends of a module's compressed stage edges: "previous" and/or "next" (none when the
    config is off, the module has one stage, or this rank does not hold it)."""
    ends: dict[str, EdgeEnd] = {}
    if module is None or not config.enabled or module.mesh.layout.pp == 1:
        return ends
    if not module.mesh.is_first_stage:
        ends["previous"] = EdgeEnd(config, "downstream", f"{module.name} stage edge")
    if not module.mesh.is_last_stage:
        ends["next"] = EdgeEnd(config, "upstream", f"{module.name} stage edge")
    return ends


def stage_links(mesh: ModuleMesh, activation: tuple[int, ...], edges: Mapping[str, EdgeEnd]):
    """This stage's links to the previous and next stage of its module (None at either end), through
    the compressed edge ends in ``edges`` where given."""
    layout, coord = mesh.layout, mesh.coord
    prev_link = next_link = None
    if coord.pp > 0:
        prev_rank = layout.rank_at(coord._replace(pp=coord.pp - 1))
        if "previous" in edges:
            prev_link = CompressedPreviousLink(prev_rank, activation, edges["previous"])
        else:
            prev_link = P2PTransport(prev_rank, None, activation, torch.float32)
    if coord.pp < layout.pp - 1:
        next_rank = layout.rank_at(coord._replace(pp=coord.pp + 1))
        if "next" in edges:
            next_link = CompressedNextLink(next_rank, activation, edges["next"])
        else:
            next_link = P2PTransport(None, next_rank, activation, torch.float32)
    return prev_link, next_link


class CallableStage(nn.Module):
    """A function as the module of a pipeline stage."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)
