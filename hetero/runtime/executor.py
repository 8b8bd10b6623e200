"""Run one rank's actions of a step: a handler per action type (``F``, ``B``, ``EF``, ``EB``).

``F`` runs this rank's stage of a module on a microbatch: its replica's rows of the batch columns the
kind reads and, on a first stage, what the incoming edges delivered (``EF`` before it), or the previous
stage's activation; it sends a later stage's input on, or keeps a last stage's outputs and loss. ``B``
backpropagates the loss (scaled by the module's ``loss_weight`` over the global count) and the gradients
the outgoing edges returned (``EB`` before it), then hands the input's gradient to the previous stage or
keeps the incoming edges' for their ``EB``. A replica with no rows in a microbatch skips its stage there
(all its stages agree), unless its module runs FSDP2, whose collectives need every replica.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import TYPE_CHECKING

import torch

from hetero.kinds.registry import Arrival, StageResult, StageStep
from hetero.runtime.rows import StepRows
from hetero.runtime.schedule import Action

if TYPE_CHECKING:
    from hetero.runtime.runtime import Runtime


class Executor:
    def __init__(self, runtime: Runtime, batch: dict[str, torch.Tensor], rows: StepRows, training: bool, step: int):
        self.runtime, self.batch, self.rows, self.training, self.step = runtime, batch, rows, training, step
        self.graph = runtime.graph
        self.counts = {name: max(node.kind.loss_count(self._columns(name)), 1)  # the loss divisors, global
                       for name, node in runtime.graph.nodes.items() if node.kind.has_loss(node.config)}
        self.arrivals: dict[tuple[str, int], list[Arrival]] = defaultdict(list)
        self.delivered: dict[tuple[str, int], torch.Tensor] = {}  # (edge, m) -> the destination's input leaf
        self.saved: dict[tuple[str, int], tuple[torch.Tensor | None, StageResult]] = {}  # for B (training)
        self.outputs: dict[tuple[str, int], StageResult] = {}  # last stages' results, until their edges sent them
        self.output_grads: dict[tuple[str, int], dict[str, torch.Tensor]] = defaultdict(dict)
        self.results: dict[str, list[StageResult]] = defaultdict(list)  # last stages' results, for the step's end
        self.handlers = {"F": self.forward, "B": self.backward, "EF": self.edge_forward, "EB": self.edge_backward}

    def run(self, actions: list[Action]) -> None:
        for action in actions:
            self.handlers[action.op](action.target, action.microbatch)
        for edge in self.runtime.edges.values():
            edge.wait_sends()
        for links in self.runtime.links.values():
            links.finish()

    def _columns(self, name: str) -> dict[str, torch.Tensor]:
        """Module ``name``'s rows of the global batch's columns it reads (for its loss's divisor)."""
        node = self.graph.nodes[name]
        present = self.rows.present[name]
        return {key: self.batch[key][present] for key in node.kind.data_keys(node.config) if key in self.batch}

    def _local(self, name: str, m: int) -> torch.Tensor:
        return self.rows.local(name, m, self.runtime.modules[name].mesh.coord.dp)

    def _skips(self, name: str, local: torch.Tensor) -> bool:
        return len(local) == 0 and not self.graph.nodes[name].options.fsdp

    @contextlib.contextmanager
    def _timed(self, name: str):
        tick = time.perf_counter()
        yield
        self.runtime.module_seconds[name] += time.perf_counter() - tick

    # ------------------------------------------------------------------------------------ modules

    def forward(self, name: str, m: int) -> None:
        module = self.runtime.modules[name]
        node, mesh = module.node, module.mesh
        local = self._local(name, m)
        if self._skips(name, local):
            return
        keys = node.kind.data_keys(node.config)
        keys += tuple(k for k in node.kind.evaluation_keys(self.batch) if not self.training)
        missing = [k for k in keys if k not in self.batch]
        if missing:
            raise KeyError(f"{name} ({node.kind.name}) reads batch columns {missing}, which this batch lacks "
                           f"(it has {', '.join(self.batch)})")
        host = {k: self.batch[k][local] for k in keys}
        received = None
        if not mesh.is_first_stage:
            received = self.runtime.links[name].recv_activation(m, self.runtime.stage_shape(name, len(local)))
            received = received.detach().requires_grad_(self.training)
        step = StageStep(node.config, mesh, node.options, module.device, {k: v.to(module.device) for k, v in host.items()},
                         host, local, self.arrivals.pop((name, m), []) if mesh.is_first_stage else [], received,
                         self.training, self.step, self.runtime.seed)
        bf16 = node.options.precision == "bf16"
        with self._timed(name), node.kind.compute(mesh), torch.set_grad_enabled(self.training), \
                torch.autocast(module.device.type, dtype=torch.bfloat16, enabled=bf16):
            result = node.kind.stage(module.model, step)
        if not mesh.is_last_stage:
            self.runtime.links[name].send_activation(m, result.activation.detach())
        else:
            self.results[name].append(result)
            if self.graph.out_edges(name):
                self.outputs[(name, m)] = result
        if self.training:
            self.saved[(name, m)] = (received, result)

    def backward(self, name: str, m: int) -> None:
        module = self.runtime.modules[name]
        node, mesh = module.node, module.mesh
        if (name, m) not in self.saved:  # skipped in forward
            return
        received, result = self.saved.pop((name, m))
        with self._timed(name), node.kind.compute(mesh):
            if mesh.is_last_stage:
                tensors, grads = [], []
                if result.loss is not None and node.kind.has_loss(node.config):
                    tensors.append(result.loss / self.counts[name] * node.settings.loss_weight)
                    grads.append(None)
                returned = self.output_grads.pop((name, m), {})
                for port in {e.output for e in self.graph.out_edges(name)}:
                    output = result.outputs[port]
                    tensors.append(output)
                    grads.append(returned.get(port, torch.zeros_like(output)))
                if tensors:
                    torch.autograd.backward(tensors, grads)
            else:
                activation = result.activation
                activation.backward(self.runtime.links[name].recv_grad(m, tuple(activation.shape)))
        if received is not None:
            grad = received.grad if received.grad is not None else torch.zeros_like(received)
            self.runtime.links[name].send_grad(m, grad)

    # -------------------------------------------------------------------------------------- edges

    def edge_forward(self, edge_name: str, m: int) -> None:
        runtime_edge = self.runtime.edges[edge_name]
        edge = runtime_edge.edge
        if len(self.rows.edge(edge, m)) == 0:
            return
        split = self.rows.split(edge, m)
        x = None
        if runtime_edge.is_source:
            src = self.runtime.modules[edge.src]
            dp = src.mesh.coord.dp
            result = self.outputs.get((edge.src, m))
            if result is None:  # this replica holds none of the microbatch's rows
                x = torch.zeros(runtime_edge.shape(0), device=src.device)
            else:
                x = result.outputs[edge.output][self.rows.positions(edge, m, edge.src, dp).to(src.device)]
                x = x.detach().float()
        out = runtime_edge.forward(m, x, split)
        if runtime_edge.is_destination:
            dst = self.runtime.modules[edge.dst]
            leaf = out.detach().requires_grad_(self.training)
            self.delivered[(edge_name, m)] = leaf
            positions = self.rows.positions(edge, m, edge.dst, dst.mesh.coord.dp).to(dst.device)
            self.arrivals[(edge.dst, m)].append(Arrival(edge.input, leaf, positions, edge.offset))

    def edge_backward(self, edge_name: str, m: int) -> None:
        runtime_edge = self.runtime.edges[edge_name]
        edge = runtime_edge.edge
        if len(self.rows.edge(edge, m)) == 0:
            return
        split = self.rows.split(edge, m)
        grad = None
        leaf = self.delivered.pop((edge_name, m), None)
        if leaf is not None:
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        returned = runtime_edge.backward(m, grad, split)
        if runtime_edge.is_source and (edge.src, m) in self.saved:
            src = self.runtime.modules[edge.src]
            output = self.saved[(edge.src, m)][1].outputs[edge.output]
            grads = self.output_grads[(edge.src, m)]
            positions = self.rows.positions(edge, m, edge.src, src.mesh.coord.dp).to(src.device)
            total = grads.get(edge.output, torch.zeros_like(output))
            grads[edge.output] = total.index_add(0, positions, returned.to(total.dtype))
