"""One module on one rank of a multi-module job: its parallelized model, optimizer and replica sync."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from hetero.data.digits import dp_rows
from hetero.parallel.compression.config import CompressionConfig
from hetero.parallel.data import local_data, local_grad
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.options import ParallelOptions
from hetero.parallel.replica_sync import ReplicaSync
from hetero.train.optim import OptimizerConfig, build_adamw


@dataclass
class ModuleSetup:
    """What the trainer needs to know about one module besides its mesh."""

    options: ParallelOptions
    optimizer: OptimizerConfig
    compression: CompressionConfig = field(default_factory=CompressionConfig)


class ModuleRuntime:
    """One module on this rank: its parallelized model, optimizer and replica sync."""

    def __init__(self, name: str, model: nn.Module, mesh: ModuleMesh, setup: ModuleSetup, seed: int):
        self.name, self.model, self.mesh, self.setup, self.seed = name, model, mesh, setup, seed
        self.optimizer = build_adamw(model, setup.optimizer)
        self.replica_sync = ReplicaSync(model, mesh, setup.options, setup.compression, seed)

    def local_state(self) -> dict:
        """The replica sync's buffers; under DiLoCo also this replica's own weights and optimizer state,
        which drift apart from the other replicas' between outer rounds."""
        state: dict = {"replica_sync": self.replica_sync.state_dict()}
        if self.replica_sync.diloco is not None:
            params = dict(self.model.named_parameters())
            state["weights"] = {n: local_data(p).clone() for n, p in params.items()}
            state["optimizer"] = {
                n: {k: local_tensor(v).clone() for k, v in self.optimizer.state[p].items()}
                for n, p in params.items()
                if p in self.optimizer.state
            }
        return state

    def load_local_state(self, state: dict) -> None:
        self.replica_sync.load_state_dict(state["replica_sync"])
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if name in state.get("weights", {}):
                    local_data(param).copy_(state["weights"][name])
                for key, value in state.get("optimizer", {}).get(name, {}).items():
                    local_tensor(self.optimizer.state[param][key]).copy_(value)

    def reset_replica_sync(self) -> None:
        """Start the replica sync afresh from the current weights (DiLoCo's anchor included)."""
        self.replica_sync = ReplicaSync(self.model, self.mesh, self.setup.options, self.setup.compression, self.seed)

    def nonfinite(self) -> bool:
        """Whether any gradient this rank holds has a NaN or an infinity."""
        return any(not bool(torch.isfinite(g).all()) for g in map(local_grad, self.model.parameters()) if g is not None)

    def rows(self, batch_size: int) -> slice:
        """This rank's contiguous rows of a microbatch (by the module's own DP coordinate)."""
        return dp_rows(batch_size, self.mesh.coord.dp, self.mesh.layout.dp)

    def squared_grad_norm(self) -> torch.Tensor:
        """Sum of squared gradients of the whole module, each element counted once, on every rank of it."""
        sharded = torch.zeros((), dtype=torch.float64)
        replicated = torch.zeros((), dtype=torch.float64)
        for param in self.model.parameters():
            grad = local_grad(param)
            if grad is None:
                continue
            value = grad.double().pow(2).sum()
            placements = param.grad.placements if isinstance(param.grad, DTensor) else ()
            if any(isinstance(p, Shard) for p in placements):
                sharded += value
            else:
                replicated += value
        if self.mesh.layout.tp > 1:
            dist.all_reduce(sharded, group=self.mesh.group("tp"))
        total = sharded + replicated
        if self.setup.options.fsdp and self.mesh.layout.dp * self.mesh.layout.cp > 1:
            dist.all_reduce(total, group=self.mesh.group("dp_cp"))  # FSDP shards over dp×cp
        if self.mesh.layout.pp > 1:
            dist.all_reduce(total, group=self.mesh.group("pp"))
        return total

    def scale_grads(self, factor: float) -> None:
        for param in self.model.parameters():
            if param.grad is not None:
                param.grad.mul_(factor)


class TrainerState:
    """What a multi-module trainer with ``modules`` (name -> ``ModuleRuntime``) and ``edge_ends()`` (this
    rank's compressed edge ends, each with its compensation state) checkpoints, restores and undoes."""

    modules: dict[str, ModuleRuntime]

    def edge_ends(self) -> dict:
        raise NotImplementedError

    def checkpoint_modules(self) -> dict[str, tuple[nn.Module, torch.optim.Optimizer]]:
        return {name: (module.model, module.optimizer) for name, module in self.modules.items()}

    def local_state(self) -> dict:
        return {
            "modules": {name: module.local_state() for name, module in self.modules.items()},
            "edges": {key: end.state_dict() for key, end in self.edge_ends().items()},
        }

    def load_local_state(self, state: dict) -> None:
        for name, module in self.modules.items():
            module.load_local_state(state["modules"][name])
        for key, end in self.edge_ends().items():
            end.load_state_dict(state["edges"][key])

    def reset_local_state(self) -> None:
        for module in self.modules.values():
            module.reset_replica_sync()

    def undo_step(self, edge_states: dict) -> None:
        """A step skipped on every rank: compression state back to ``edge_states`` (taken before the
        step), gradients dropped, so weights, optimizers and edges stay as they were."""
        for key, end in self.edge_ends().items():
            end.load_state_dict(edge_states[key])
        for module in self.modules.values():
            module.optimizer.zero_grad(set_to_none=True)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
