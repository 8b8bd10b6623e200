"""Each rank's share of every module on paper: the parameters it holds and the bytes it reads from the
module's pretrained checkpoint, found by running the real parallelization on the meta device.

For each rank in turn this process joins a fake world of the placement's size (torch's ``fake`` backend:
collectives return at once, nothing is sent), builds that rank's module meshes as a job would, builds
each of its modules on the meta device and applies the module's ``parallelize``; what the rank's state
dict then holds locally (DTensor shards, its pipeline stage's layers, its experts) is its share. No
memory is allocated, so a 30B-parameter layout is counted on a laptop.

A rank reads from ``init.hf`` exactly the slices it holds, each in the checkpoint's dtype
(``config.json``'s ``torch_dtype`` or ``dtype``; fp32 when absent).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from hetero.graph.graph import Graph
from hetero.parallel.mesh import build_module_meshes

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True)
class RankShare:
    rank: int
    module: str
    parameters: int  # elements of the module's state (parameters and buffers) this rank holds
    checkpoint_bytes: int | None  # what it reads from init.hf; None without one


def rank_shares(graph: Graph) -> list[RankShare]:
    """Every (rank, module) share of ``graph``'s placement, in rank order. Runs outside any process group."""
    if dist.is_initialized():
        raise RuntimeError("rank_shares joins fake worlds of its own; call it outside a process group")
    placement = graph.placement
    experts = frozenset(name for name, node in graph.nodes.items() if node.kind.expert_parallel(node.config))
    sizes = {name: _dtype_bytes(node.settings.init.hf) for name, node in graph.nodes.items()}
    shares = []
    for rank in range(placement.world_size):
        dist.init_process_group("fake", rank=rank, world_size=placement.world_size, store=FakeStore())
        try:
            for name, mesh in build_module_meshes(placement, expert_modules=experts).items():
                node = graph.nodes[name]
                with torch.device("meta"):
                    model = node.kind.parallelize(node.kind.build(node.config), mesh, node.options)
                tensors = {id(t): t for t in model.state_dict(keep_vars=True).values()}  # tied weights once
                held = sum((t.to_local() if isinstance(t, DTensor) else t).numel() for t in tensors.values())
                shares.append(RankShare(rank, name, held, None if sizes[name] is None else held * sizes[name]))
        finally:
            dist.destroy_process_group()
    return shares


def _dtype_bytes(checkpoint: str | None) -> int | None:
    if checkpoint is None:
        return None
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
    return DTYPE_BYTES[dtype]

