"""Cluster bring-up check: build every module's process groups under torchrun and verify each one.

    torchrun --nproc_per_node 4 launch/check_groups.py experiment=colocated_vlm [overrides]

Every rank all-reduces its global rank on each of its groups (tp, cp, dp, pp, dp_cp per module) and
compares the sum with the group's members from the layout. Rank 0 prints the rank map, then one line per
rank; the exit code is non-zero if any group is wrong. Works with gloo (CPU) and NCCL (GPU).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from hetero.config import load_experiment
from hetero.graph import build_graph
from hetero.models import default_registry
from hetero.parallel.mesh import build_module_meshes, init_distributed, resolve_backend
from hetero.parallel.rank_map import format_rank_map, rank_map


def check_groups(overrides: list[str]) -> bool:
    experiment = load_experiment("", overrides)
    placement = build_graph(experiment, default_registry()).placement
    rank = init_distributed(placement, experiment.backend, experiment.timeout_s)
    meshes = build_module_meshes(placement, experiment.timeout_s)
    device = "cuda" if resolve_backend(experiment.backend) == "nccl" else "cpu"
    wrong = []
    for name, module in meshes.items():
        for kind, group in module.groups.items():
            value = torch.tensor([float(rank)], device=device)
            dist.all_reduce(value, group=group)
            expected = sum(module.group_ranks[kind])
            if value.item() != expected:
                wrong.append(f"{name}.{kind}: sum {value.item():.0f}, expected {expected}")
    if rank == 0:
        print(format_rank_map(rank_map(experiment, placement)), flush=True)
    lines: list[object] = [None] * placement.world_size
    dist.all_gather_object(lines, f"rank {rank}: {', '.join(meshes)}: " + ("; ".join(wrong) or "ok"))
    ok = all(line.endswith(": ok") for line in lines)  # type: ignore[union-attr]
    if rank == 0:
        print("\n".join(str(line) for line in lines), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return ok


if __name__ == "__main__":
    sys.exit(0 if check_groups(sys.argv[1:]) else 1)
