"""One module on this rank: its parallelized model, optimizer and replica sync, and what the step's end
asks of it (gradient norm, non-finite check, clip, local checkpoint state). Frozen parameters
(``hetero.graph.frozen``) take no gradient, no optimizer state and no place in the sync; a module with
none to train has no optimizer (``optimizer`` None)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from hetero.config import OptimizerConfig
from hetero.graph.frozen import freeze
from hetero.graph.graph import Node
from hetero.parallel.compression.collective import Collective
from hetero.parallel.data import local_data, local_grad
from hetero.parallel.expert_parallel import is_expert_weight
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.replica_sync import ReplicaSync


def build_adamw(model: nn.Module, config: OptimizerConfig, fused: bool = False) -> torch.optim.AdamW:
    """``fused``: one kernel for every parameter's update (the runtime's choice on CUDA; on the CPU the
    default multi-tensor update keeps the numbers the references are measured against). Parameters go in
    one group per mesh they are DTensors on (TP's, the experts' EP mesh) and one of plain ones: a fused or
    multi-tensor update takes one kind at a time."""
    groups: dict[object, list[nn.Parameter]] = {}
    for param in trained(model):
        groups.setdefault(param.device_mesh.mesh_dim_names if isinstance(param, DTensor) else None, []).append(param)
    return torch.optim.AdamW(
        [{"params": params} for params in groups.values()], lr=config.lr, betas=(config.beta1, config.beta2), weight_decay=config.weight_decay,
        eps=config.eps, fused=fused or None,
    )


def trained(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model`` that train (not frozen)."""
    return [param for param in model.parameters() if param.requires_grad]


def materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` (on the meta device) allocated, uninitialized, on ``device``, with the parameters that
    several of its modules share (tied embeddings) still shared: ``to_empty`` gives each its own copy."""
    shared: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(param), []).append(name)
    model.to_empty(device=device)
    for first, *others in shared.values():
        for name in others:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, model.get_parameter(first))
    return model


class ModuleState:
    """Module ``node`` on this rank, built from seed + its declaration index on every rank of it."""

    def __init__(self, node: Node, mesh: ModuleMesh, seed: int, device: torch.device, outer_comm: Collective | None = None):
        """``outer_comm``: where DiLoCo's outer rounds run instead of the module's dp group (e.g. torchft's
        fault-tolerant replica groups)."""
        self.node, self.name, self.mesh, self.seed, self.device = node, node.name, mesh, seed, device
        self.outer_comm = outer_comm
        torch.manual_seed(seed + node.index)  # every rank builds the whole model, then keeps its part
        pretrained = node.settings.init.hf
        self.pretrained_bytes = 0  # read from init.hf by this rank
        if pretrained is None:
            with torch.device(device):  # on a GPU built there: no host-side init and copy of every weight
                built = node.kind.build(node.config).to(device)  # .to: anything a kind placed explicitly
            self.model = node.kind.parallelize(built, mesh, node.options)
        else:  # only this rank's part is ever allocated, then read from the checkpoint
            with torch.device("meta"):
                built = node.kind.build(node.config)
            self.model = materialize(node.kind.parallelize(built, mesh, node.options), device)
            if node.settings.init.checkpoint is None:  # else the weights come from that checkpoint
                self.pretrained_bytes = node.kind.load_pretrained(self.model, pretrained)
        freeze(self.model, node.settings)
        self.trained = trained(self.model)  # fixed from here on: walked every step, listed once
        self._norm_groups: list[int] | None = None  # local_squares' group of each trained parameter
        self._summed_over_tp: set[int] = set()  # ids of ``partial_over_tp`` gradients summed in this backward
        self.optimizer = (build_adamw(self.model, node.settings.optim, fused=device.type == "cuda")
                          if self.trained else None)
        self.replica_sync = self._replica_sync()

    def _replica_sync(self) -> ReplicaSync:
        return ReplicaSync(self.model, self.mesh, self.node.options, self.node.settings.compression, self.seed,
                           self.outer_comm, before_launch=self._settle_before_launch,
                           expert_weights=self.node.kind.expert_weights(self.model))

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def _settle_before_launch(self, param: nn.Parameter) -> None:
        """A gradient's partial sum over TP reduced before an overlapped DP sync takes it into a bucket
        (whose result is copied back over the gradient at the sync's end)."""
        if getattr(param, "partial_over_tp", False):
            dist.all_reduce(param.grad, group=self.mesh.group("tp"))
            self._summed_over_tp.add(id(param))
        else:
            settle_partial(param)

    def settle_grads(self) -> None:
        """After the step's backwards: zeros where a parameter got no gradient (a replica that saw no rows
        still takes part in the sync), and partial sums reduced over TP (sequence parallelism leaves the
        norms' weights with a ``Partial`` gradient, whose local part is not the gradient; a plain
        parameter says so with ``partial_over_tp``), where an overlapped sync has not done so already."""
        partial, summed, self._summed_over_tp = [], self._summed_over_tp, set()
        for param in self.trained:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            elif getattr(param, "partial_over_tp", False):
                if id(param) not in summed:
                    partial.append(param.grad)
            else:
                settle_partial(param)
        if partial:
            flat = torch.cat([grad.flatten() for grad in partial])
            dist.all_reduce(flat, group=self.mesh.group("tp"))
            torch._foreach_copy_(partial, [part.view_as(grad) for part, grad in zip(flat.split([g.numel() for g in partial]), partial)])

    def local_squares(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sums of squared gradients this rank holds (no collectives): of TP-sharded parameters, of
        EP-sharded ones (experts), and of the others, summed in float64. A NaN or an infinity in any
        gradient makes them non-finite."""
        if self._norm_groups is None:  # by the settled gradients' placements, which stay from step to step
            self._norm_groups = [_norm_group(param) for param in self.trained]
        groups: tuple[dict, dict, dict] = ({}, {}, {})  # tp-sharded, ep-sharded, replicated; each by dtype
        for param, group in zip(self.trained, self._norm_groups):
            if (grad := local_grad(param)) is not None:
                groups[group].setdefault(grad.dtype, []).append(grad)
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        sums = [sum((sum_of_squares(grads) for grads in group.values()), zero) for group in groups]
        return sums[0], sums[1], sums[2]

    @property
    def syncs_gradients(self) -> bool:
        """Whether the replica sync changes this rank's gradients before the optimizer step."""
        sync = self.replica_sync
        return sync.grad_sync is not None or (sync.diloco is not None and sync.replicas > 1)

    def squared_grad_norm(self, squares: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Sum of squared gradients of the whole module, each element counted once, on every rank of it,
        from this rank's ``local_squares``."""
        sharded, experts, replicated = squares
        layout = self.mesh.layout
        if layout.tp > 1:
            dist.all_reduce(sharded, group=self.mesh.group("tp"))
        if layout.ep > 1:
            dist.all_reduce(experts, group=self.mesh.group("ep"))
        total = sharded + experts + replicated
        if self.node.options.fsdp and layout.dp * layout.cp > 1:
            dist.all_reduce(total, group=self.mesh.group("dp_cp"))  # FSDP shards over dp×cp
        if layout.pp > 1:
            dist.all_reduce(total, group=self.mesh.group("pp"))
        return total

    def scale_grads(self, factor: float) -> None:
        grads = [grad for param in self.trained if (grad := local_grad(param)) is not None]
        if grads:  # a frozen module has none
            torch._foreach_mul_(grads, factor)

    def step(self, step: int) -> None:
        if self.optimizer is None:
            return
        for group in self.optimizer.param_groups:
            group["lr"] = self.node.settings.optim.lr_at(step)
        self.optimizer.step()
        self.replica_sync.after_step()

    def local_state(self) -> dict:
        """The replica sync's buffers; under DiLoCo also this replica's own weights and optimizer state,
        which drift apart from the other replicas' between outer rounds."""
        state: dict = {"replica_sync": self.replica_sync.state_dict()}
        if self.replica_sync.diloco is not None:
            params = dict(self.model.named_parameters())
            state["weights"] = {n: local_data(p).clone() for n, p in params.items()}
            state["optimizer"] = {
                n: {k: _local(v).clone() for k, v in self.optimizer.state[p].items()}
                for n, p in params.items() if p in self.optimizer.state
            }
        return state

    def load_local_state(self, state: dict) -> None:
        self.replica_sync.load_state_dict(state["replica_sync"])
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if name in state.get("weights", {}):
                    local_data(param).copy_(state["weights"][name])
                for key, value in state.get("optimizer", {}).get(name, {}).items():
                    _local(self.optimizer.state[param][key]).copy_(value)

    def reset_replica_sync(self) -> None:
        """Start the replica sync afresh from the current weights (DiLoCo's anchor included)."""
        self.replica_sync.close()
        self.replica_sync = self._replica_sync()


def sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the squares of ``grads`` (one device, one dtype) in float64: each tensor's norm by torch's
    multi-tensor kernel in fp32 (as ``clip_grad_norm_`` takes it; bf16 gradients are widened first), the
    squares summed in float64. Widening every element to float64 instead cost 0.45 ms a step on the
    overhead bench's 0.6M parameters (1% of its step) for a norm that moves by ~5e-8."""
    widen = torch.float32 if grads[0].dtype in (torch.bfloat16, torch.float16) else None
    return torch.stack(torch._foreach_norm(grads, 2, dtype=widen)).double().square().sum()


def _norm_group(param: nn.Parameter) -> int:
    """Which of ``local_squares``' sums a settled gradient goes to: 0 TP-sharded (a DTensor's ``Shard`` or
    megatron-core's ``tensor_model_parallel`` mark), 1 EP-sharded (the megatron backend marks its experts
    ``expert_shard``), 2 replicated."""
    if getattr(param, "expert_shard", False):
        return 1
    if getattr(param, "tensor_model_parallel", False):
        return 0
    placements = param.grad.placements if isinstance(param.grad, DTensor) else ()
    if not any(isinstance(p, Shard) for p in placements):
        return 2
    return 1 if is_expert_weight(param) else 0


def settle_partial(param: nn.Parameter) -> None:
    """A ``Partial`` gradient (a sum still spread over TP ranks) reduced to the gradient it stands for."""
    grad = param.grad
    if isinstance(grad, DTensor) and any(isinstance(p, Partial) for p in grad.placements):
        placements = [Replicate() if isinstance(p, Partial) else p for p in grad.placements]
        param.grad = grad.redistribute(grad.device_mesh, placements)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
