"""The one runtime: any module graph, each module under its own layout, trained step by step.

``Runtime(graph, meshes)`` builds, on every rank and in one order, the modules this rank holds, every
edge's boundary and each module's stage links, and checks its schedules (``schedule.check_schedule``).
``train_step(batch)`` runs this rank's actions for a global batch (every rank gets the same one), then
ends the step the same way on every rank: a world-wide check for non-finite losses and gradients (a
skipped step everywhere, with the modules and ranks named), each module's replica sync (DP gradients,
compressed or not, or DiLoCo), one gradient-norm clip over every module, and each module's optimizer step.
``evaluate(batch)`` runs the forwards only (fp32 edges) and returns each module's losses and metrics.

Losses are sums over rows divided by global counts (``Kind.loss_count``), so gradients summed over each
module's replicas are exact whatever the modules' DP degrees; the combined loss weighs each module's loss
by its ``loss_weight``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hetero.graph.graph import Graph
from hetero.parallel.compression.collective import Collective
from hetero.parallel.mesh import ModuleMesh
from hetero.runtime.executor import Executor, RuntimeEdge
from hetero.runtime.routed_edge import RoutedEdge
from hetero.runtime.links import StageLinks
from hetero.runtime.module import ModuleState
from hetero.kinds.batch_rows import batch_size, held_key, held_rows, is_compact
from hetero.runtime.rows import RankReads, StepRows, rank_reads
from hetero.runtime.schedule import check_schedule
from hetero.runtime.timing import ModuleTimer
from hetero.runtime.trace import StepTrace


class Runtime:
    def __init__(
        self,
        graph: Graph,
        meshes: dict[str, ModuleMesh],
        *,
        microbatches: int,
        seed: int = 0,
        grad_clip: float = 0.0,
        timeout_s: float = 300.0,
        sample_reuse: int = 1,
        device: torch.device | str | None = None,
        outer_comms: dict[str, Collective] | None = None,
    ):
        """``outer_comms``: per module, where DiLoCo's outer rounds run instead of its dp group."""
        self.graph, self.seed, self.grad_clip, self.sample_reuse = graph, seed, grad_clip, sample_reuse
        self.microbatches = microbatches
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(device) if device is not None else _default_device()
        outer_comms = outer_comms or {}
        self.modules = {name: ModuleState(graph.nodes[name], meshes[name], seed, self.device, outer_comms.get(name))
                        for name in graph.nodes if name in meshes}
        async_sends = graph.schedule == "graph_1f1b"
        # Built on every rank, in the same order, whether or not this rank takes part.
        self.edges = {e.name: (RoutedEdge if e.routed else RuntimeEdge)(e, graph, timeout_s, async_sends, self.device)
                      for e in graph.edges}
        self.links = {name: StageLinks(module.mesh, module.node.settings.compression.pipeline, self.device)
                      for name, module in self.modules.items()}
        self.actions = {training: check_schedule(graph, microbatches, training)[self.rank] for training in (True, False)}
        # each module's last backward on this rank in a training step (its gradients are final after it)
        self.final_backward = {a.target: a.microbatch for a in self.actions[True] if a.op == "B"}
        # a forward-only encoder on ranks of its own: the next step's first microbatches it computes at
        # the end of a step, and how many of this step's it sent so (``train_step``'s ``upcoming``)
        self.ahead = max((m.node.options.forward_ahead for m in self.modules.values()), default=0)
        self.sent_ahead = 0
        self.step = 0
        self.nonfinite: dict[str, list[int]] = {}  # the last step's, when it was skipped
        self.timer = ModuleTimer(graph.nodes, self.device)  # this rank's compute time per module
        self.trace: StepTrace | None = None

    def start_trace(self) -> StepTrace:
        """Record a timeline of every training step from now on (``trace.py``); ``stop_trace`` ends it."""
        self.trace = StepTrace(self.rank)
        return self.trace

    def stop_trace(self) -> StepTrace | None:
        trace, self.trace = self.trace, None
        return trace

    def _span(self, name: str):
        return self.trace.span(name, "step_end") if self.trace is not None else contextlib.nullcontext()

    def rank_reads(self) -> RankReads:
        """Which rows and items of a batch this rank's modules read (``RankReads``): what a loader must
        tokenize and decode here."""
        return rank_reads(self.graph, self.microbatches, self.rank)

    # ----------------------------------------------------------------------------------- a step

    def train_step(self, batch: dict[str, torch.Tensor],
                   upcoming: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
        """One optimizer step on the global batch: the combined loss, each module's loss and parts
        (``<module>.loss``, ``<module>.<part>``), the gradient norm before clipping and ``stepped``.
        ``upcoming``: the next step's batch (every rank gets the same one), when a training step follows
        this one directly: a module with ``parallel.forward_ahead`` then computes and sends its first
        microbatches at the end of this step, while the modules it feeds finish this one."""
        with self.trace.step(self.step) if self.trace is not None else contextlib.nullcontext():
            return self._train_step(batch, upcoming)

    def _train_step(self, batch: dict[str, torch.Tensor], upcoming: dict[str, torch.Tensor] | None) -> dict[str, float]:
        self.check(batch)
        rows = StepRows(self.graph, batch, self.microbatches)
        for module in self.modules.values():
            module.zero_grad()
        edge_states = {key: end.state_dict() for key, end in self.edge_ends().items()}
        self._begin(rows, batch, training=True)
        executor = Executor(self, batch, rows, True, self.step)
        sent, self.sent_ahead = self.sent_ahead, 0
        executor.run([a for a in self.actions[True] if a.microbatch >= sent])  # the rest went a step ago
        if upcoming is not None and self.ahead:
            self._forward_ahead(upcoming)
        with self._span("loss and non-finite check"):
            for module in self.modules.values():
                module.settle_grads()
            squares = {name: module.local_squares() for name, module in self.modules.items()}
            metrics, statistics, self.nonfinite = self._losses_and_nonfinite(executor, squares)
        if self.nonfinite:
            for key, end in self.edge_ends().items():
                end.load_state_dict(edge_states[key])
            for module in self.modules.values():
                module.replica_sync.discard()
                module.zero_grad()
            self.step += 1
            return metrics | {"grad_norm": math.nan, "stepped": 0.0}
        for name, module in self.modules.items():
            with self._span(f"{name} replica sync"):
                module.replica_sync.before_step()
                if module.syncs_gradients:  # the squares before the sync no longer describe the gradients
                    squares[name] = module.local_squares()
        with self._span("clip"):
            grad_norm = self._clip(squares)
        if math.isfinite(grad_norm):
            for name, module in self.modules.items():
                with self._span(f"{name} optimizer"):
                    module.step(self.step)
                    node = self.graph.nodes[name]
                    if node.kind.step_statistics(node.config):
                        decay = node.settings.optim.decay_at(self.step)
                        node.kind.after_step(module.model, node.config, statistics[name], decay)
        self.step += 1
        return metrics | {"grad_norm": grad_norm, "stepped": float(math.isfinite(grad_norm))}

    def _forward_ahead(self, upcoming: dict[str, torch.Tensor]) -> None:
        """This rank's forward-only encoder (``parallel.forward_ahead``, alone on its ranks): the next step's
        first microbatches' forwards and edge sends, in the order its list gives them, left in flight (the
        receivers post their receives in the next step, as for the microbatches that follow)."""
        self.check(upcoming)
        executor = Executor(self, upcoming, StepRows(self.graph, upcoming, self.microbatches), True, self.step + 1)
        executor.run([a for a in self.actions[True] if a.microbatch < self.ahead], wait=False)
        self.sent_ahead = self.ahead

    def evaluate(self, batches: Iterable[dict[str, torch.Tensor]]) -> dict[str, float]:
        """Losses and each module's metrics (``<module>.<metric>``) over held-out batches, forwards only,
        without changing anything; losses are sums over every batch over the global counts."""
        if self.sent_ahead:
            raise RuntimeError("evaluate() after a training step that computed the next one's first microbatches "
                               "ahead: pass train_step no upcoming batch before an evaluation")
        losses = counts = metric_sums = lows = keys = None
        for batch in batches:
            self.check(batch)
            rows = StepRows(self.graph, batch, self.microbatches)
            self._begin(rows, batch, training=False)
            executor = Executor(self, batch, rows, False, self.step)
            executor.run(self.actions[False])
            parts = (self._loss_sums(executor), self._loss_counts(executor), *self._metric_sums(executor))
            if losses is None:
                losses, counts, metric_sums, lows = parts
                keys = self._metric_keys(batch)
            else:
                losses, counts = losses + parts[0], [a + b for a, b in zip(counts, parts[1])]
                metric_sums, lows = metric_sums + parts[2], torch.minimum(lows, parts[3])
        if losses is None:
            raise ValueError("evaluate() got no batches")
        return self._reduced_losses(losses, counts) | self._reduced_metrics(keys, metric_sums, lows)

    def check(self, batch: dict[str, torch.Tensor]) -> None:
        """Refuse a batch some module cannot take (its kind's ``batch_errors``: its columns' shapes, dtypes
        and id ranges), a declared per-row column of another row count, or an image outside its row: a
        ``ValueError`` naming each. Host-side (shapes and dtypes, and one min/max of bounded ids). On a
        global batch every rank finds the same errors, whichever modules it holds, so none waits on
        another. A compact batch (``hetero.kinds.batch_rows``) holds each rank's own rows, whose values
        only that rank sees: the training job checks it inside its data agreement
        (``hetero.train.data_agreement``), so that a bad row stops every rank before the step's first
        message."""
        errors = [error for name, node in self.graph.nodes.items()
                  for error in node.kind.batch_errors(name, node.config, batch)]
        if not errors:
            errors = [f"{name}: the batch's {column.name} hold {len(batch[column.name])} rows but "
                      + (f"its {held_key(column.name)} flags {held_rows(batch, column.name)}"
                         if is_compact(batch, column.name) else f"the batch has {batch_size(batch)}")
                      + "; give every per-row column one entry per row"
                      for name, node in self.graph.nodes.items() for column in node.kind.columns(node.config)
                      if column.rows and column.name in batch and len(batch[column.name]) != held_rows(batch, column.name)]
        if not errors:
            errors = [error for edge in self.edges.values() if isinstance(edge, RoutedEdge)
                      for error in edge.batch_errors(batch)]
        if errors:
            raise ValueError("\n".join(errors))

    def _begin(self, rows: StepRows, batch: dict[str, torch.Tensor], training: bool) -> None:
        """Tell compressed edges and stage links whether this pass uses their codecs, and its row keys."""
        fresh = self.step % self.sample_reuse == 0
        ids = batch.get("index")
        def keys(edge, name: str) -> list[torch.Tensor]:
            dp = self.modules[name].mesh.coord.dp if name in self.modules else 0
            return [rows.carried(edge, m, name, dp) for m in range(self.microbatches)]

        for edge in self.edges.values():
            e = edge.edge
            compressed = training and edge.codec is not None
            edge.begin(compressed, keys(e, e.src) if compressed else [], keys(e, e.dst) if compressed else [], fresh, ids)
        for name, links in self.links.items():
            compressed = training and bool(links.ends)
            local = ([rows.local(name, m, self.modules[name].mesh.coord.dp) for m in range(self.microbatches)]
                     if compressed else [])
            links.begin(compressed, local, fresh, ids)

    # -------------------------------------------------------------------------- the step's end

    def _reporting(self, name: str) -> bool:
        """One rank per set of ranks holding the same rows and tokens reports a module's sums: TP rank 0
        of its last stage."""
        mesh = self.modules[name].mesh
        return mesh.is_last_stage and mesh.coord.tp == 0

    def _loss_keys(self) -> list[tuple[str, str]]:
        """Every module's loss, loss parts and step statistics: sums over rows, reduced together."""
        return [(name, part) for name, node in self.graph.nodes.items() if node.kind.has_loss(node.config)
                for part in ("loss", *node.kind.loss_parts(node.config), *node.kind.step_statistics(node.config))]

    def _loss_sums(self, executor: Executor) -> torch.Tensor:
        """This rank's share of every module's loss and loss parts (sums over rows): the loss from the
        reporting ranks, parts from TP rank 0 of every stage that holds some."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        sums = []
        for name, part in self._loss_keys():
            terms = []
            if name in self.modules and self.modules[name].mesh.coord.tp == 0:
                for result in executor.results[name]:
                    if part == "loss" and self._reporting(name):
                        terms.append(_local(result.loss).double())
                    elif part != "loss" and part in result.parts:
                        terms.append(_local(result.parts[part]).double())
            sums.append(sum(terms, zero))
        return torch.stack(sums) if sums else zero.reshape(0)

    def _loss_counts(self, executor: Executor) -> list[float]:
        return [float(executor.counts[name]) for name, _ in self._loss_keys()]

    def _reduced_losses(self, sums: torch.Tensor, counts: list[float]) -> dict[str, float]:
        """Every module's loss and parts over the global batch(es), and the loss-weighted sum, on every rank."""
        self._reduce(sums)
        return self._losses_from(sums.tolist(), counts)[0]

    def _losses_from(self, sums: list[float], counts: list[float]) -> tuple[dict[str, float], dict[str, dict]]:
        """The losses and parts (``<module>.<part>``, and the loss-weighted sum ``loss``), and each module's
        step statistics ({module: {name: value}}), all per row of the global batch."""
        out, statistics = {}, {}
        for (name, part), value, count in zip(self._loss_keys(), sums, counts):
            node = self.graph.nodes[name]
            if part in node.kind.step_statistics(node.config):
                statistics.setdefault(name, {})[part] = value / count
            else:
                out[f"{name}.{part}"] = value / count
        combined = sum(self.graph.nodes[name].settings.loss_weight * out[f"{name}.loss"] for name, part in self._loss_keys()
                       if part == "loss")
        return {"loss": combined} | out, statistics

    def _metric_keys(self, batch) -> list[tuple[str, str, str]]:
        return [(name, metric, reduce) for name, node in self.graph.nodes.items()
                for metric, reduce in node.kind.metric_names(node.config, batch)]

    def _metric_sums(self, executor: Executor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of every metric: (value, count) sums, and the lows of ``min`` metrics."""
        keys = self._metric_keys(executor.batch)
        sums = torch.zeros(len(keys), 2, dtype=torch.float64, device=self.device)
        lows = torch.full((len(keys),), math.inf, dtype=torch.float64, device=self.device)
        for i, (name, metric, reduce) in enumerate(keys):
            if name not in self.modules or not self._reporting(name):
                continue
            for result in executor.results[name]:
                part = result.metrics[metric]
                if reduce == "min":
                    lows[i] = torch.minimum(lows[i], part.value.double())
                else:
                    sums[i] += torch.stack([part.value.double(), part.count.double()])
        return sums, lows

    def _reduced_metrics(self, keys, sums: torch.Tensor, lows: torch.Tensor) -> dict[str, float]:
        self._reduce(sums)
        self._reduce(lows, dist.ReduceOp.MIN)
        return {f"{name}.{metric}": float(lows[i]) if reduce == "min" else float(sums[i, 0] / sums[i, 1].clamp(min=1))
                for i, (name, metric, reduce) in enumerate(keys)}

    def _reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        """An all-reduce over the world; a world of one has nothing to reduce."""
        if self.world > 1:
            dist.all_reduce(tensor, op=op)

    def _losses_and_nonfinite(self, executor: Executor, squares: dict):
        """The step's losses and step statistics (``_losses_from``) and the modules with a NaN or infinite loss or gradient
        on some rank, with those ranks (the same on every rank), in one all-reduce. Checked before the
        gradient sync, which would spread the values."""
        names, world = list(self.graph.nodes), self.world
        # Per module, the sum of this rank's gradient squares and losses: non-finite exactly when one of the
        # terms is. Each rank fills its own column; the check stays on the device until the one read below.
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        mine = torch.stack([sum((*squares.get(name, ()), *(_local(r.loss).double().sum() for r in
                                 executor.results.get(name, ()) if r.loss is not None)), zero) for name in names])
        held = torch.zeros(len(names), world, dtype=torch.float64, device=self.device)
        held[:, self.rank] = mine
        sums = self._loss_sums(executor)
        both = torch.cat([sums, held.flatten()])
        self._reduce(both)
        values = both.tolist()
        losses, held = values[: len(sums)], values[len(sums):]
        ranks = {name: [r for r in range(world) if not math.isfinite(held[i * world + r])] for i, name in enumerate(names)}
        return *self._losses_from(losses, self._loss_counts(executor)), {name: r for name, r in ranks.items() if r}

    def _clip(self, local: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> float:
        """The global gradient norm over every module (from each module's ``local`` squares), agreed by
        every rank; clipped when it exceeds ``grad_clip`` (> 0). Infinite when any gradient is not finite."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        squares = torch.stack([self.modules[name].squared_grad_norm(local[name])
                               if name in self.modules and node.trains else zero  # a frozen module has no gradient
                               for name, node in self.graph.nodes.items()])
        if self.world > 1:
            # Every rank of a module holds the same value and the others hold 0: MAX agrees world-wide. (Under
            # DiLoCo a module's replicas hold different local gradients; MAX then takes the largest norm.) A
            # NaN does not survive a MAX, so non-finite values travel as flags.
            flags = (~torch.isfinite(squares)).to(torch.float64)
            both = torch.cat([torch.nan_to_num(squares, nan=0.0, posinf=0.0), flags])
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
            values = both.tolist()
            values, finite = values[: len(squares)], not any(values[len(squares):])
        else:
            values = squares.tolist()
            finite = all(map(math.isfinite, values))
        if not finite:
            return math.inf
        norm = math.sqrt(sum(values))
        if self.grad_clip > 0 and norm > self.grad_clip:
            for module in self.modules.values():
                module.scale_grads(self.grad_clip / (norm + 1e-6))
        return norm

    # ------------------------------------------------------------------------------ checkpoints

    def edge_ends(self) -> dict:
        """This rank's compressed edge ends (graph edges and stage edges), each with compensation state."""
        ends = {f"{name}.{side}": end for name, links in self.links.items() for side, end in links.ends.items()}
        for edge in self.edges.values():
            ends |= edge.ends()
        return ends

    def checkpoint_modules(self) -> dict:
        return {name: (module.model, module.optimizer) for name, module in self.modules.items()}

    def local_state(self) -> dict:
        return {"modules": {name: module.local_state() for name, module in self.modules.items()},
                "edges": {key: end.state_dict() for key, end in self.edge_ends().items()}}

    def load_local_state(self, state: dict) -> None:
        for name, module in self.modules.items():
            module.load_local_state(state["modules"][name])
        for key, end in self.edge_ends().items():
            end.load_state_dict(state["edges"][key])

    def reset_local_state(self) -> None:
        for module in self.modules.values():
            module.reset_replica_sync()


def _default_device() -> torch.device:
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
