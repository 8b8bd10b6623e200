"""Every module's tp, cp, dp, pp and dp×cp groups, built on real gloo ranks, hold the right members.

Each rank contributes its global rank to an all-reduce on each of its groups; the expected sums are
computed here from the layout definition with plain loops (Megatron order), not with hetero's Layout.
"""

import pytest
import torch
import torch.distributed as dist
import yaml

from hetero.config import CONFIG_DIR, load_experiment
from hetero.parallel.mesh import build_module_meshes
from hetero.parallel.placement import place
from hetero.testing.multiprocess import run_ranks
from layout_oracle import grid_coords, modules_of_yaml

SHIPPED = ["homogeneous_vlm", "colocated_vlm", "non_colocated_vlm", "mixed_vlm"]

# Three modules on 8 ranks: a fully colocated module with every axis > 1 except pp, a module whose
# rank list is explicit and unsorted, and one that shares only half the world.
MIXED_8 = {
    "name": "mixed8",
    "world_size": 8,
    "batch": {"global_batch_size": 8, "micro_batch_size": 1},
    "llm": {
        "kind": "gpt",
        "model": {"hidden_size": 32, "num_heads": 4, "num_layers": 2, "seq_len": 32},
        "layout": {"tp": 2, "cp": 2, "dp": 2},
    },
    "encoder": {
        "kind": "gpt",
        "model": {"hidden_size": 32, "num_heads": 2, "num_layers": 2, "seq_len": 32},
        "layout": {"tp": 2, "pp": 2, "ranks": [7, 3, 6, 2]},
        "micro_batch_size": 2,
    },
    "decoder": {
        "kind": "gpt",
        "model": {"hidden_size": 32, "num_heads": 4, "num_layers": 4, "seq_len": 32},
        "layout": {"pp": 2, "dp": 2, "offset": 0},
    },
}

AXES = {"tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",), "dp_cp": ("dp", "cp")}


def expected_sums(layout: dict, world_size: int) -> dict:
    """{(rank, group kind): sum of global ranks in that group} for one module's layout spec."""
    coords = grid_coords(layout, world_size)
    sums = {}
    for rank, coord in coords.items():
        for kind, axes in AXES.items():
            peers = [
                other
                for other, other_coord in coords.items()
                if all(other_coord[a] == coord[a] for a in coord if a not in axes)
            ]
            sums[(rank, kind)] = sum(peers)
    return sums


def placement_of(experiment):
    """The placement alone (groups need no graph: the modules here need not be joined by edges)."""
    return place({n: m.layout for n, m in experiment.modules.items()}, experiment.world_size, experiment.placement)


def all_reduce_every_group(rank, world_size, config, overrides):
    meshes = build_module_meshes(placement_of(load_experiment(config, overrides)))
    out = {}
    for name, module in meshes.items():
        for kind, group in module.groups.items():
            value = torch.tensor([float(rank)])
            dist.all_reduce(value, group=group)
            out[(name, kind)] = value.item()
        out[(name, "mesh_coordinate")] = tuple(module.mesh.get_coordinate())
        out[(name, "coord")] = (module.coord.pp, module.coord.dp, module.coord.cp, module.coord.tp)
    return out


def check(results, raw_modules, world_size):
    for name, module in raw_modules.items():
        expected = expected_sums(module["layout"], world_size)
        members = {rank for rank, _ in expected}
        for rank, result in enumerate(results):
            if rank not in members:
                assert not any(key[0] == name for key in result), f"{name} has no groups on rank {rank}"
                continue
            for kind in AXES:
                assert result[(name, kind)] == expected[(rank, kind)], (name, kind, rank)
            assert result[(name, "mesh_coordinate")] == result[(name, "coord")]


@pytest.mark.parametrize("config", SHIPPED)
def test_groups_of_shipped_configs(config):
    modules, world_size = modules_of_yaml(CONFIG_DIR / "experiment" / f"{config}.yaml")
    results = run_ranks(all_reduce_every_group, world_size, config, [], timeout_s=120)
    check(results, modules, world_size)


def test_groups_of_an_8_rank_mixed_placement(tmp_path):
    path = tmp_path / "mixed8.yaml"
    path.write_text(yaml.safe_dump(MIXED_8, sort_keys=False))
    placement = placement_of(load_experiment(str(path)))
    assert placement.mode == "mixed"
    results = run_ranks(all_reduce_every_group, 8, str(path), [], timeout_s=120)
    modules = {k: v for k, v in MIXED_8.items() if isinstance(v, dict) and "kind" in v}
    check(results, modules, 8)


def test_groups_follow_a_hydra_override():
    """`llm.layout.tp=1 llm.layout.dp=4` changes the groups the ranks build."""
    results = run_ranks(
        all_reduce_every_group, 4, "colocated_vlm", ["llm.layout.tp=1", "llm.layout.dp=4", "llm.micro_batch_size=11"], timeout_s=120
    )
    check(results, {"llm": {"layout": {"tp": 1, "dp": 4}}}, 4)
