"""How a module's data-parallel replicas agree: a gradient sync every step, or DiLoCo's outer rounds.

The runtime calls ``final_backward_begins()`` and ``final_backward_ends()`` around this rank's last
backward of a step (the plain all-reduce overlaps it), ``before_step()`` after every microbatch's backward and ``after_step()`` after its
optimizer step. With a per-step sync the first sums the replicas' gradients (compressed or not) and the
second does nothing; with DiLoCo the first turns this replica's share of the global-mean gradient into its
own mean gradient (the losses are normalized by the global token count) and the second counts the inner
step and runs the outer round when one is due.

DiLoCo's outer rounds run over the module's dp group, or over ``outer_comm`` when one is given: a
``TorchftCollective`` makes each job (or process) one replica group of a fault-tolerant torchft job.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from hetero.parallel.compression.build import build_diloco, build_grad_sync
from hetero.parallel.compression.collective import Collective, GroupCollective
from hetero.parallel.compression.config import CompressionConfig
from hetero.parallel.compression.diloco import DiLoCo
from hetero.parallel.compression.link import SimulatedLink
from hetero.parallel.data import AllReduceGradSync, GradSync, GradSyncs
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.options import REDUCE_DTYPES, ParallelOptions


class ReplicaSync:
    def __init__(
        self,
        model: nn.Module,
        mesh: ModuleMesh | None,
        options: ParallelOptions,
        compression: CompressionConfig | None = None,
        seed: int = 0,
        outer_comm: Collective | None = None,
        before_launch: Callable[[nn.Parameter], None] | None = None,
        expert_weights: set[str] = frozenset(),
    ):
        """``before_launch``: run on a parameter whose gradient is final before an overlapped all-reduce
        takes it (``AllReduceGradSync``). ``expert_weights``: the parameters summed over the mesh's
        ``expert_sync`` group instead (uncompressed)."""
        self.compression = compression or CompressionConfig()
        self.model = model
        self.replicas = 1 if mesh is None else mesh.layout.dp * mesh.layout.cp
        self.grad_sync: GradSync | None = None
        self.diloco: DiLoCo | None = None
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # frozen ones never change
        if not named:
            return
        link = SimulatedLink(options.simulated_link) if options.simulated_link.enabled else None
        if self.compression.diloco.enabled:
            if outer_comm is None and self.replicas == 1:
                return  # one replica: nothing to average, DiLoCo would only add outer steps
            # The gradient sync's own group: no other collective uses it under DiLoCo, so a round may run
            # on a thread of its own (diloco.overlap_steps) while the step's other collectives go on.
            comm = outer_comm or GroupCollective(mesh.group("grad_sync"), link)  # type: ignore[union-attr]
            self.diloco = build_diloco(self.compression, named, comm, seed)
        elif not options.fsdp:
            bucket_bytes = int(options.grad_bucket_mb * 2**20)
            reduce_dtype = REDUCE_DTYPES[options.reduce_precision]
            syncs = []
            if self.replicas > 1:
                comm = GroupCollective(mesh.group("grad_sync"), link)  # type: ignore[union-attr]
                dense = [(n, p) for n, p in named if n not in expert_weights]
                syncs.append(build_grad_sync(self.compression.grad, dense, comm, bucket_bytes, seed, reduce_dtype,
                                             before_launch))
            if expert_weights and len(mesh.group_ranks["expert_sync"]) > 1:  # type: ignore[union-attr]
                # Experts' gradients sum over the ranks holding the same experts, in buckets of their own.
                experts = [(n, p) for n, p in named if n in expert_weights]
                syncs.append(AllReduceGradSync(experts, GroupCollective(mesh.group("expert_sync"), link),  # type: ignore[union-attr]
                                               bucket_bytes, reduce_dtype, before_launch))
            if syncs:
                self.grad_sync = syncs[0] if len(syncs) == 1 else GradSyncs(syncs)

    @property
    def bytes_sent(self) -> int:
        engine = self.diloco or self.grad_sync
        return engine.bytes_sent if engine is not None else 0

    def final_backward_begins(self) -> None:
        """This rank's final backward of the step is next: an overlapped sync starts from its hooks."""
        if self.grad_sync is not None:
            self.grad_sync.arm()

    def final_backward_ends(self) -> None:
        """It is over, or skipped on this replica (no rows): whatever the hooks did not start, starts."""
        if self.grad_sync is not None:
            self.grad_sync.flush()

    def discard(self) -> None:
        """The step is skipped: the sync's collectives complete (every replica posts them), nothing changes."""
        if self.grad_sync is not None:
            self.grad_sync.discard()

    def before_step(self) -> None:
        if self.grad_sync is not None:
            self.grad_sync.sync()
        elif self.diloco is not None and self.replicas > 1:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.replicas)

    def close(self) -> None:
        """Detach from the model (a fresh sync replaces this one)."""
        if isinstance(self.grad_sync, (AllReduceGradSync, GradSyncs)):
            self.grad_sync.remove_hooks()
        if self.diloco is not None:
            self.diloco.close()

    def after_step(self) -> None:
        if self.diloco is not None:
            self.diloco.after_inner_step()

    def residual_norm(self) -> float:
        """Error-feedback residual norm on this replica (0 when nothing keeps one)."""
        engine = self.diloco or self.grad_sync
        norm = getattr(engine, "residual_norm", None)
        return norm() if norm is not None else 0.0

    def state_dict(self) -> dict:
        return {
            "grad_sync": self.grad_sync.state_dict() if self.grad_sync is not None else None,
            "diloco": self.diloco.state_dict() if self.diloco is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        if self.grad_sync is not None:
            self.grad_sync.load_state_dict(state["grad_sync"])
        if self.diloco is not None:
            self.diloco.load_state_dict(state["diloco"])
