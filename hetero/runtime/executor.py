"""Run one rank's actions of a step: a handler per action type (``F``, ``B``, ``EF``, ``EB``).

``F`` runs this rank's stage of a module on a microbatch: its replica's rows of the batch columns the
kind reads and, on a first stage, what the incoming edges delivered (``EF`` before it), or the previous
stage's activation; it sends a later stage's input on, or keeps a last stage's outputs and loss. ``B``
backpropagates the loss (scaled by the module's ``loss_weight`` over the global count) and the gradients
the outgoing edges returned (``EB`` before it), then hands the input's gradient to the previous stage or
keeps the incoming edges' for their ``EB``. A replica with no rows in a microbatch skips its stage there
(all its stages agree), unless its module runs FSDP2 or expert parallelism, whose collectives need every
replica.

``EF``/``EB`` go through the edge's ``RuntimeEdge``: a ``Boundary`` from the source's last stage to the
destination's first, and a ``CompressedBoundary`` beside it when the edge has a ``compression:`` block
(training passes send through it; evaluation sends fp32, so it measures the weights). What crosses is
``(rows, tokens, width)``: the rows of a microbatch the edge carries, split over each side's DP replicas
as they own them (``StepRows.split``); the tokens whole, or where a module splits its sequence (CP, SP)
as it does (an LLM rank gets the placeholder positions it holds, ``Arrival.index``). Gradients: a plain boundary
sums what the destination's replicas of a shard hand in, and each replica (e.g. a TP rank) holds the full
gradient of its input, so each hands in its share (1/replicas). A compressed edge copies instead of
summing (payloads cannot be added): every replica hands in the full gradient and the source gets it once.
Build every edge on every rank, in the graph's edge order.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import replace
from typing import Protocol

import torch

from hetero.graph.graph import Edge, Graph
from hetero.kinds.registry import Arrival, StageResult, StageStep
from hetero.parallel.boundary import Boundary, Rows, Side, TensorSpec, Transfer
from hetero.parallel.sharding import sequence_spans
from hetero.parallel.compressed_boundary import CompressedBoundary
from hetero.parallel.layout import Layout
from hetero.runtime.rows import StepRows, to_device
from hetero.runtime.routed_edge import RoutedEdge
from hetero.runtime.links import StageLinks
from hetero.runtime.module import ModuleState
from hetero.runtime.schedule import Action
from hetero.runtime.timing import ModuleTimer
from hetero.runtime.trace import StepTrace


class StepParts(Protocol):
    """What an executor reads of its runtime (``hetero.runtime.runtime.Runtime``)."""

    graph: Graph
    seed: int
    modules: dict[str, ModuleState]
    edges: dict[str, RuntimeEdge | RoutedEdge]
    links: dict[str, StageLinks]
    timer: ModuleTimer
    trace: StepTrace | None
    final_backward: dict[str, int]


class Executor:
    def __init__(self, runtime: StepParts, batch: dict[str, torch.Tensor], rows: StepRows, training: bool, step: int):
        self.runtime, self.batch, self.rows, self.training, self.step = runtime, batch, rows, training, step
        self.graph = runtime.graph
        self.counts = {name: max(node.kind.loss_count(batch, rows.all(name)), 1)  # the loss divisors, global
                       for name, node in runtime.graph.nodes.items() if node.kind.has_loss(node.config)}
        self.arrivals: dict[tuple[str, int], list[Arrival]] = defaultdict(list)
        self.delivered: dict[tuple[str, int], torch.Tensor] = {}  # (edge, m) -> the destination's input leaf
        self.saved: dict[tuple[str, int], tuple[torch.Tensor | None, StageResult]] = {}  # for B (training)
        self.outputs: dict[tuple[str, int], StageResult] = {}  # last stages' results, until their edges sent them
        self.output_grads: dict[tuple[str, int], dict[str, torch.Tensor]] = defaultdict(dict)
        # last stages' results and earlier stages' loss parts, for the step's end
        self.results: dict[str, list[StageResult]] = defaultdict(list)
        self.handlers = {"F": self.forward, "B": self.backward, "EF": self.edge_forward, "EB": self.edge_backward}
        self.trace = runtime.trace if training else None

    def _traced(self, name: str | Action, category: str):
        return self.trace.span(str(name), category) if self.trace is not None else contextlib.nullcontext()

    def run(self, actions: list[Action], wait: bool = True) -> None:
        """Run ``actions``; then, unless ``wait`` is false (sends for the next step, received there), wait
        for every send they posted."""
        for action in actions:
            with self._traced(action, "action"):
                self.handlers[action.op](action.target, action.microbatch)
        if not wait:
            return
        for edge in self.runtime.edges.values():
            edge.wait_sends()
        for links in self.runtime.links.values():
            links.finish()

    def _local(self, name: str, m: int) -> torch.Tensor:
        return self.rows.local(name, m, self.runtime.modules[name].mesh.coord.dp)

    def _skips(self, name: str, local: torch.Tensor) -> bool:
        """A replica without rows sits the microbatch out, unless its collectives need every replica:
        FSDP2's gathers, expert parallelism's all-to-alls."""
        node = self.graph.nodes[name]
        return len(local) == 0 and not node.options.fsdp and node.layout.ep == 1

    # ------------------------------------------------------------------------------------ modules

    def forward(self, name: str, m: int) -> None:
        module = self.runtime.modules[name]
        node, mesh = module.node, module.mesh
        local = self._local(name, m)
        if self._skips(name, local):
            return
        keys = node.kind.data_keys(node.config) + node.kind.optional_keys(self.batch)
        keys += tuple(k for k in node.kind.evaluation_keys(self.batch) if not self.training)
        missing = [k for k in keys if k not in self.batch]
        if missing:
            raise KeyError(f"{name} ({node.kind.name}) reads batch columns {missing}, which this batch lacks "
                           f"(it has {', '.join(self.batch)})")
        host = node.kind.host_columns(node.config, self.batch, keys, local)
        data = {k: to_device(v, module.device) for k, v in host.items()}
        backward = self.training and self.graph.backward(name)  # else forward only: no autograd graph
        received = None
        if not mesh.is_first_stage:
            received = self.runtime.links[name].recv_activation(m, self._stage_shape(name, local))
            received = received.detach().requires_grad_(backward)
        step = StageStep(node.config, mesh, node.options, module.device, data,
                         host, local, self.arrivals.pop((name, m), []) if mesh.is_first_stage else [], received,
                         self.training, self.step, self.runtime.seed, self.counts.get(name, 1),
                         len(self.rows.all(name)))
        autocast = (torch.autocast(module.device.type, dtype=torch.bfloat16) if node.options.precision == "bf16"
                    else contextlib.nullcontext())
        with self._traced(name, "compute"), self.runtime.timer.timed(name), node.kind.compute(mesh), \
                torch.set_grad_enabled(backward), autocast:
            result = node.kind.stage(module.model, step)
        if backward:
            self.saved[(name, m)] = (received, result)
        if not mesh.is_last_stage:
            self.runtime.links[name].send_activation(m, result.activation.detach())
            if result.parts:
                self.results[name].append(StageResult(parts=result.parts))
        else:
            self.results[name].append(result)
            if self.graph.out_edges(name):
                self.outputs[(name, m)] = result

    def backward(self, name: str, m: int) -> None:
        module = self.runtime.modules[name]
        node, mesh = module.node, module.mesh
        final = self.runtime.final_backward.get(name) == m
        if (name, m) not in self.saved:  # skipped in forward
            if final:
                module.replica_sync.final_backward_ends()
            return
        received, result = self.saved.pop((name, m))
        if final:
            module.replica_sync.final_backward_begins()  # the DP all-reduce starts from its gradient hooks
        upstream = None  # a later stage's gradient, received before the timer starts (waiting is not compute)
        if not mesh.is_last_stage:
            upstream = self.runtime.links[name].recv_grad(m, tuple(result.activation.shape))
        with self._traced(name, "compute"), self.runtime.timer.timed(name), node.kind.compute(mesh):
            if mesh.is_last_stage:
                tensors, grads = [], []
                if result.loss is not None and node.kind.has_loss(node.config):
                    tensors.append(result.loss / self.counts[name] * node.settings.loss_weight)
                    grads.append(None)
                returned = self.output_grads.pop((name, m), {})
                for port in dict.fromkeys(e.output for e in self.graph.out_edges(name)):  # edge order, every rank alike
                    output = result.outputs[port]
                    tensors.append(output)
                    grads.append(returned.get(port, torch.zeros_like(output)))
                # A frozen module's microbatch that reads nothing trained (no image in it) has no graph; its
                # ranks that share rows (TP, CP) share the inputs, so all of them skip it alike.
                kept = [(t, g) for t, g in zip(tensors, grads) if t.requires_grad]
                if kept:
                    torch.autograd.backward(*map(list, zip(*kept)))
            elif result.activation.requires_grad:
                result.activation.backward(upstream)
        if final:
            module.replica_sync.final_backward_ends()
        if received is not None:
            grad = received.grad if received.grad is not None else torch.zeros_like(received)
            self.runtime.links[name].send_grad(m, grad)

    def _stage_shape(self, name: str, local: torch.Tensor) -> tuple[int, ...]:
        node, mesh = self.graph.nodes[name], self.runtime.modules[name].mesh
        return node.kind.stage_shape(node.config, len(local), mesh.layout, node.options)

    # -------------------------------------------------------------------------------------- edges

    def edge_forward(self, edge_name: str, m: int) -> None:
        runtime_edge = self.runtime.edges[edge_name]
        edge = runtime_edge.edge
        if edge.routed:
            return self._routed_forward(runtime_edge, m)
        if len(self.rows.edge(edge, m)) == 0:
            return
        split = self.rows.split(edge, m)
        x = None
        if runtime_edge.is_source:
            src = self.runtime.modules[edge.src]
            dp = src.mesh.coord.dp
            result = self.outputs.get((edge.src, m))
            if result is None:  # this replica holds none of the microbatch's rows
                x = torch.zeros(runtime_edge.source_shape(split), device=src.device)
            else:
                x = result.outputs[edge.output][self.rows.positions(edge, m, edge.src, dp).to(src.device)]
                x = x.detach().float()
        out = runtime_edge.forward(m, x, split)
        if runtime_edge.is_destination:
            dst = self.runtime.modules[edge.dst]
            leaf = out.detach().requires_grad_(self.training and self.graph.backward(edge.src))
            self.delivered[(edge_name, m)] = leaf
            positions = self.rows.positions(edge, m, edge.dst, dst.mesh.coord.dp).to(dst.device)
            self.arrivals[(edge.dst, m)].append(Arrival(edge.input, leaf, positions, runtime_edge.index))

    def _routed_forward(self, runtime_edge: RoutedEdge, m: int) -> None:
        edge = runtime_edge.edge
        if len(self.rows.module(edge.src, m)) == 0:
            return
        x = None
        if runtime_edge.is_source:
            result = self.outputs.get((edge.src, m))
            src = self.runtime.modules[edge.src]
            x = (result.outputs[edge.output].detach().float().reshape(-1, edge.width) if result is not None
                 else torch.zeros(0, edge.width, device=src.device))  # (items, tokens, width) of fixed-size items
        values, rows, positions = runtime_edge.forward(m, x, runtime_edge.request(self.rows, self.batch, m, self.graph))
        if runtime_edge.is_destination:
            leaf = values.detach().requires_grad_(self.training and self.graph.backward(edge.src))
            self.delivered[(edge.name, m)] = leaf
            self.arrivals[(edge.dst, m)].append(Arrival(edge.input, leaf, rows, positions))

    def edge_backward(self, edge_name: str, m: int) -> None:
        runtime_edge = self.runtime.edges[edge_name]
        edge = runtime_edge.edge
        if edge.routed:
            if len(self.rows.module(edge.src, m)) == 0:
                return
            leaf = self.delivered.pop((edge_name, m), None)
            grad = None if leaf is None else (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
            returned = runtime_edge.backward(m, grad)
            if runtime_edge.is_source and (edge.src, m) in self.saved:
                output = self.saved[(edge.src, m)][1].outputs[edge.output]
                grads = self.output_grads[(edge.src, m)]
                returned = returned.to(output.dtype).view(output.shape)
                grads[edge.output] = grads.get(edge.output, torch.zeros_like(output)) + returned
            return
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


class RuntimeEdge:
    def __init__(self, edge: Edge, graph: Graph, timeout_s: float, async_sends: bool, device: torch.device):
        self.edge = edge
        source, destination = Side(graph.nodes[edge.src].layout), Side(graph.nodes[edge.dst].layout)
        spec = TensorSpec(3, source=edge.source, destination=edge.destination)
        common = dict(timeout_s=timeout_s, async_sends=async_sends, device=device)
        self.plain = Boundary(edge.name, source, destination, spec, **common)
        self.codec = (CompressedBoundary(edge.name, source, destination, spec, edge.width, edge.compression, **common)
                      if edge.compression.enabled else None)
        self.use_codec = False
        self._transfers: dict[int, Transfer] = {}
        self.index = self._destination_index(graph.nodes[edge.dst].layout, device) if self.is_destination else None

    def _destination_index(self, layout: Layout, device: torch.device) -> torch.Tensor:
        """Where the tokens this destination rank receives sit in its local sequence (placeholders)."""
        coord, sharding, edge = layout.coord(self.plain.rank), self.edge.destination, self.edge
        if sharding.seq_dim is None:
            return torch.arange(edge.offset, edge.offset + edge.tokens, device=device)
        length = sharding.window[1]
        held = _positions(sequence_spans(length, replace(sharding, window=None), layout, coord))
        window = _positions(sequence_spans(edge.tokens, sharding, layout, coord)) + edge.offset
        where = torch.full((length,), -1, dtype=torch.long, device="cpu")
        where[held] = torch.arange(len(held), device="cpu")
        return where[window].to(device)

    @property
    def is_source(self) -> bool:
        return self.plain.is_source

    @property
    def is_destination(self) -> bool:
        return self.plain.is_destination

    def begin(self, compressed: bool, source_rows, destination_rows, fresh: bool, sample_ids) -> None:
        """A pass starts, through the codec or not (training passes of a compressed edge do); its
        compensation is keyed by each side's rows."""
        self.use_codec = compressed and self.codec is not None
        if self.use_codec:
            self.codec.begin_step(source_rows, destination_rows, fresh, sample_ids)

    def shape(self, rows: int) -> tuple[int, int, int]:
        return (rows, self.edge.tokens, self.edge.width)

    def source_shape(self, rows: Rows) -> tuple[int, ...]:
        """This source rank's local part of a call's tensor."""
        return next(iter(self.plain.plan(self.shape(sum(rows.source)), rows).src_shapes.values()))

    def forward(self, m: int, x: torch.Tensor | None, rows: Rows) -> torch.Tensor | None:
        shape = self.shape(sum(rows.source))
        if self.use_codec:
            return self.codec.forward(m, x, shape, rows)
        transfer = self.plain.forward(x, shape, rows)
        self._transfers[m] = transfer
        return transfer.output

    def backward(self, m: int, grad: torch.Tensor | None, rows: Rows) -> torch.Tensor | None:
        """``grad``: the full gradient of the destination rank's input (None elsewhere)."""
        shape = self.shape(sum(rows.source))
        if self.use_codec:
            return self.codec.backward(m, grad, shape, rows)
        if grad is not None:
            grad = grad / self.plain.replicas(shape, rows)
        return self.plain.backward(self._transfers.pop(m), grad)

    def wait_sends(self) -> None:
        for link in (self.plain, self.codec):
            if link is not None:
                link.wait_sends()

    def counters(self) -> dict[str, int]:
        """The plain boundary's byte and call counters on this rank."""
        return self.plain.counters()

    def sent_bytes(self) -> dict[str, int]:
        """Wire bytes this rank sent so far (cross-module and within replica groups), per direction."""
        totals = dict.fromkeys(("forward", "backward"), 0)
        for link in (self.plain, self.codec):
            for key, value in (link.counters() if link is not None else {}).items():
                direction, kind = key.split(".", 1)
                if kind in ("cross_sent_bytes", "intra_sent_bytes"):
                    totals[direction] += value
        return totals

    def ends(self) -> dict[str, object]:
        """This rank's compressed edge ends (their compensation state is checkpointed)."""
        if self.codec is None:
            return {}
        return {f"{self.edge.name}.upstream": self.codec.upstream, f"{self.edge.name}.downstream": self.codec.downstream}

    def memory_bytes(self) -> int:
        return self.codec.memory_bytes() if self.codec is not None else 0


def _positions(spans) -> torch.Tensor:
    return torch.cat([torch.arange(start, stop, device="cpu") for start, stop in spans])  # host-side indices
