"""Process groups and DeviceMeshes for every module, built explicitly and passed around.

No global parallel state: each module gets a ``ModuleMesh`` holding its own groups, so modules with
different layouts coexist in one process. Every group of every module is created on every rank, in
one deterministic order (torch requires it: a group created on only some ranks hangs the others), and
identical rank sets share one group, except each module's own gradient-sync and stage-link groups.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hetero.errors import ConfigError
from hetero.parallel.layout import GROUP_AXES, MESH_AXES, Coord, Layout
from hetero.parallel.placement import Placement


@dataclass
class ModuleMesh:
    """One module's view of the parallel world from the current rank."""

    name: str
    layout: Layout
    coord: Coord
    mesh: DeviceMesh  # dims named ("pp", "dp", "cp", "tp"), tp innermost
    groups: dict[str, dist.ProcessGroup]  # "tp", "cp", "dp", "pp", "dp_cp"; "grad_sync" (dp·cp > 1); STAGE_GROUPS (pp > 1); EXPERT_GROUPS (experts)
    group_ranks: dict[str, tuple[int, ...]]  # global ranks of each group, in group-rank order
    expert_mesh: DeviceMesh | None = None  # the EP group as a 1-D mesh named "ep" (ep > 1): experts' DTensors

    def group(self, kind: str) -> dist.ProcessGroup:
        return self.groups[kind]

    @property
    def is_first_stage(self) -> bool:
        return self.coord.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord.pp == self.layout.pp - 1


STAGE_GROUPS = ("stage_activations", "stage_gradients")  # the pipeline's traffic, one group per direction
# A module with experts gets groups of its own: "ep" (ep > 1), the tokens' all-to-all
# (``Layout.expert_groups``); "expert_sync", the sum of expert gradients over the ranks that hold the same
# experts and route other tokens (``expert_data_groups``); "rows" (cp·tp > 1), the ranks holding parts of
# the same rows, where the balance loss counts whole rows; "expert_tp", each rank alone: the experts' TP
# group (experts are not split over TP), which megatron-core's MoE layer reads.
EXPERT_GROUPS = ("ep", "expert_sync", "rows", "expert_tp")


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def init_distributed(placement: Placement, backend: str = "auto", timeout_s: float = 300.0) -> int:
    """Join the launcher's world (torchrun / SLURM environment) after checking its size; return rank."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != placement.world_size:
        raise ConfigError(
            f"the experiment needs world_size={placement.world_size} ranks but the launcher started "
            f"{launched} (WORLD_SIZE={launched}); launch with --nproc_per_node={placement.world_size} "
            f"(times nodes) or change the layouts"
        )
    backend = resolve_backend(backend)
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = timedelta(seconds=timeout_s)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            dist.init_process_group(
                backend=backend, store=_attempt_store(timeout), rank=int(os.environ["RANK"]),
                world_size=launched, timeout=timeout,
            )
        else:
            dist.init_process_group(backend=backend, timeout=timeout)
    return dist.get_rank()


def init_single_process(timeout_s: float = 300.0) -> None:
    """A world of this process alone (gloo over a file store), for single-process runs of the runtime."""
    if not dist.is_initialized():
        handle, path = tempfile.mkstemp(prefix="hetero-world-")
        os.close(handle)
        os.unlink(path)  # the store creates it
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1,
                                timeout=timedelta(seconds=timeout_s))


def _attempt_store(timeout: timedelta) -> dist.Store:
    """torchrun's agent store, under a prefix per restart. torch 2.13 hands restarted ranks the store of
    the failed attempt with its keys still in it, and gloo then connects to the dead ranks' addresses
    (measured: every ``--max-restarts`` restart failed in ``connectFullMesh``)."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"hetero/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


@dataclass(frozen=True)
class GroupSpec:
    """One process group the meshes create: its module, its kind in ``ModuleMesh.groups`` and its ranks
    in group-rank order. ``shared``: a mesh axis's group, which every module with the same rank list
    shares; otherwise a group of its own (stage links, gradient syncs, experts)."""

    module: str
    kind: str
    members: tuple[int, ...]
    shared: bool


def group_specs(placement: Placement, expert_modules: frozenset[str] = frozenset()) -> list[GroupSpec]:
    """Every group of every module, in the one order every rank creates them (pure: no processes)."""
    specs = []
    for name, layout in placement.layouts.items():
        for kind, axes in GROUP_AXES.items():
            specs += [GroupSpec(name, kind, members, True) for members in layout.groups(axes)]
        if layout.pp > 1:
            # The stage links' own groups, one per direction and never shared: on NCCL a link's
            # operations on one communicator run in order, so an activation send queued ahead of a
            # gradient receive (and its mirror on the neighbour) would wait for each other.
            specs += [GroupSpec(name, kind, members, False) for members in layout.groups(GROUP_AXES["pp"])
                      for kind in STAGE_GROUPS]
        if layout.dp * layout.cp > 1:
            # The gradient sync's own groups: its buckets leave during the backward, while CP attention
            # still exchanges K/V on the cp group (the same ranks when dp=1) and other modules' syncs run
            # on groups of the same ranks; sharing one, two ranks could post them in different orders.
            specs += [GroupSpec(name, "grad_sync", members, False) for members in layout.groups(GROUP_AXES["dp_cp"])]
        if name in expert_modules:
            experts = {"ep": layout.expert_groups() if layout.ep > 1 else [],
                       "expert_sync": layout.expert_data_groups(),
                       "rows": layout.groups(("cp", "tp")) if layout.cp * layout.tp > 1 else []}
            specs += [GroupSpec(name, kind, members, False) for kind, groups in experts.items() for members in groups]
            specs += [GroupSpec(name, "expert_tp", (rank,), True) for rank in layout.ranks]
    return specs


def build_module_meshes(
    placement: Placement, timeout_s: float = 300.0, expert_modules: frozenset[str] = frozenset()
) -> dict[str, ModuleMesh]:
    """Create every module's groups on every rank (``group_specs``); return the meshes of modules on
    this rank. ``expert_modules``: the modules with experts, which get ``EXPERT_GROUPS``."""
    rank = dist.get_rank()
    if dist.get_world_size() != placement.world_size:
        raise ConfigError(
            f"the process group has {dist.get_world_size()} ranks but the placement needs "
            f"{placement.world_size}"
        )
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    timeout = timedelta(seconds=timeout_s)
    pool: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    mine: dict[str, dict[str, dist.ProcessGroup]] = {name: {} for name in placement.layouts}
    mine_ranks: dict[str, dict[str, tuple[int, ...]]] = {name: {} for name in placement.layouts}
    # Same order on every rank, so creation order matches. Ranks stay in mesh order (not sorted) so that
    # a rank's position in the group is its coordinate along the axes.
    for spec in group_specs(placement, expert_modules):
        if not spec.shared:
            group = dist.new_group(list(spec.members), timeout=timeout, sort_ranks=False)
        else:
            if spec.members not in pool:
                pool[spec.members] = dist.new_group(list(spec.members), timeout=timeout, sort_ranks=False)
            group = pool[spec.members]
        if rank in spec.members:
            assert group is not None
            mine[spec.module][spec.kind], mine_ranks[spec.module][spec.kind] = group, spec.members
    meshes = {}
    for name, layout in placement.layouts.items():
        coord = layout.coord(rank)
        if coord is None:
            continue
        groups, ranks = mine[name], mine_ranks[name]
        mesh = DeviceMesh.from_group(
            [groups[axis] for axis in MESH_AXES],
            device_type,
            mesh=torch.tensor(layout.ranks, device="cpu").reshape(layout.shape),
            mesh_dim_names=MESH_AXES,
        )
        expert_mesh = (DeviceMesh.from_group(groups["ep"], device_type, mesh=list(ranks["ep"]), mesh_dim_names=("ep",))
                       if "ep" in groups else None)
        meshes[name] = ModuleMesh(name, layout, coord, mesh, groups, ranks, expert_mesh)
    return meshes
