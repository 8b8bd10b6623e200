"""Counting DTensor's own collectives (tensor and loss parallelism, sharded norms), which hetero's
communicator counters do not see: a dispatch mode that tallies the functional collectives DTensor
desugars into, per process group and collective, as ring-algorithm wire bytes."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from hetero.config import ExperimentConfig
from hetero.parallel.compression.collective import all_gather_wire_bytes, all_reduce_wire_bytes, all_to_all_wire_bytes
from hetero.parallel.layout import format_ranks


class DTensorCollectives(TorchDispatchMode):
    """Counts the functional collectives DTensor issues (per communicator and collective: calls and this
    rank's wire bytes); everything else runs untouched. ``owners`` labels communicators by rank set."""

    def __init__(self, owners: dict[frozenset[int], str]):
        super().__init__()
        self.supports_higher_order_operators = True
        self.owners = owners
        self.groups: dict[str, tuple[str, int]] = {}
        self.counts: dict[str, dict[str, dict[str, int]]] = {}
        funcol = torch.ops._c10d_functional
        self.ops = {
            funcol.all_reduce: ("all_reduce", all_reduce_wire_bytes),
            funcol.all_reduce_coalesced: ("all_reduce", all_reduce_wire_bytes),
            funcol.all_gather_into_tensor: ("all_gather", all_gather_wire_bytes),
            funcol.all_gather_into_tensor_coalesced: ("all_gather", all_gather_wire_bytes),
            funcol.reduce_scatter_tensor: ("reduce_scatter", all_to_all_wire_bytes),
            funcol.reduce_scatter_tensor_coalesced: ("reduce_scatter", all_to_all_wire_bytes),
            funcol.all_to_all_single: ("all_to_all", all_to_all_wire_bytes),
            funcol.broadcast: ("broadcast", all_to_all_wire_bytes),  # (n-1)/n: every rank but the root receives
            torch.ops._dtensor.shard_dim_alltoall: ("all_to_all", all_to_all_wire_bytes),
        }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into collectives on plain tensors first
        known = self.ops.get(func._overloadpacket)
        if known is not None:
            kind, wire = known
            label, size = self._group(args[-1])  # every one of these takes the group (name) last
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            entry = self.counts.setdefault(label, {}).setdefault(kind, {"calls": 0, "bytes": 0})
            entry["calls"] += 1
            entry["bytes"] += wire(nbytes, size)
        return func(*args, **kwargs)

    def _group(self, group: Any) -> tuple[str, int]:
        if isinstance(group, dist.ProcessGroup):
            group = group.group_name
        if group not in self.groups:
            from torch.distributed.distributed_c10d import _resolve_process_group

            process_group = _resolve_process_group(group)
            ranks = frozenset(dist.get_process_group_ranks(process_group))
            label = self.owners.get(ranks, f"dtensor.ranks{format_ranks(sorted(ranks))}")
            self.groups[group] = label, process_group.size()
        return self.groups[group]


def dtensor_owners(experiment: ExperimentConfig, meshes: dict) -> dict[frozenset[int], str]:
    """Labels of this rank's communicators that DTensor uses, by rank set: ``dtensor.<module>.<axis>`` for
    each module and axis that shards over it (tp, cp; dp or dp_cp under FSDP), joined by ``+`` where
    modules on the same ranks share the group."""
    owners: dict[frozenset[int], list[str]] = {}
    for name, mesh in meshes.items():
        layout, fsdp = mesh.layout, experiment.modules[name].parallel.fsdp
        kinds = {"tp": layout.tp > 1, "cp": layout.cp > 1, "dp": fsdp and layout.cp == 1, "dp_cp": fsdp and layout.cp > 1}
        for kind, used in kinds.items():
            ranks = mesh.group_ranks[kind]
            if used and len(ranks) > 1:
                owners.setdefault(frozenset(ranks), []).append(f"{name}.{kind}")
    return {ranks: "dtensor." + "+".join(who) for ranks, who in owners.items()}
