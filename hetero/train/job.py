"""The one training job, for every graph: checks, process groups, the runtime, the loop, checkpoints.

``train(experiment, registry)`` checks the experiment and builds its graph (of the registry's kinds),
finds and verifies the checkpoint to resume from (all before any process group exists), joins the
launcher's world, builds the runtime, and runs the loop under the fault guard: a training step per batch
(once every rank has built its own), a progress line every ``log_every`` steps (every module's loss, the
gradient norm, each communicator's bytes), held-out evaluations every ``eval_every`` steps and at the
end (every module's losses and metrics), checkpoints every ``checkpoint.every`` steps, and a summary.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hetero.config import ExperimentConfig
from hetero.data import splits
from hetero.data.loader import StepLoader
from hetero.data.sample_batches import SampleBatches
from hetero.graph import Graph, build_graph
from hetero.interop.hf_source import imported_sources
from hetero.kinds.registry import KindRegistry
from hetero.parallel.mesh import init_distributed
from hetero.runtime import Runtime, build_runtime
from hetero.train.checkpoint import (Checkpointer, RunIdentity, check_module_sources, check_resumable,
                                     load_module_weights, resolve_resume)
from hetero.train.data_agreement import agreed
from hetero.train.faults import FaultGuard, NonFiniteError, describe_rank
from hetero.train.run_log import RunLog


def run_identity(experiment: ExperimentConfig, graph: Graph) -> RunIdentity:
    """What a checkpoint of this run records to be resumed safely (see ``check_resumable``)."""
    nodes = graph.nodes
    return RunIdentity(
        models={n: {"kind": node.kind.name, "model": asdict(node.config)} for n, node in nodes.items()},
        data={
            "seed": experiment.seed,
            "batch.global_batch_size": experiment.batch.global_batch_size,
            "train.sample_reuse": experiment.train.sample_reuse,
            "train.data.format": experiment.train.data.format,
            "train.data.path": experiment.train.data.path,
            "train.data.mixture": [asdict(source) for source in experiment.train.data.mixture],
            "train.stream_buffer": experiment.train.stream_buffer,
        },
        local={
            "layouts": {n: asdict(node.layout) for n, node in nodes.items()},
            "modules": {
                n: {"parallel": asdict(node.options), "compression": asdict(node.settings.compression),
                    "micro_batch_size": experiment.micro_batch_size(n)}
                for n, node in nodes.items()
            },
            "edges": [asdict(edge) for edge in experiment.edges],
        },
    )


@dataclass
class Job:
    experiment: ExperimentConfig
    graph: Graph
    runtime: Runtime
    checkpoints: Checkpointer
    guard: FaultGuard
    log: RunLog


def train(experiment: ExperimentConfig, registry: KindRegistry) -> dict[str, float]:
    """Run the experiment's job on this rank of a launched world, its modules of the kinds in ``registry``
    (assembled by the rank entry, ``hetero.train.run``); the summary (every rank returns it)."""
    graph = build_graph(experiment, registry)
    splits.check(experiment, graph)
    cfg = experiment.train
    run_dir = Path(cfg.run_dir) / experiment.name
    checkpoints = Checkpointer(cfg.checkpoint, Path(cfg.checkpoint.dir or run_dir / "checkpoints"),
                               run_identity(experiment, graph), imported_sources(graph))
    resume_from = resolve_resume(cfg.checkpoint, checkpoints.root)
    same_local = check_resumable(resume_from, checkpoints.identity)[1] if resume_from is not None else True
    starts = {name: Path(node.settings.init.checkpoint) for name, node in graph.nodes.items()
              if node.settings.init.checkpoint is not None}  # next-stage weights, unless resuming this run
    check_module_sources(checkpoints.identity.as_json()["models"], starts)
    rank = init_distributed(graph.placement, experiment.backend, experiment.timeout_s)
    runtime = build_runtime(experiment, graph=graph)
    checkpoints.attach()
    job = Job(experiment, graph, runtime, checkpoints, FaultGuard(graph.placement, experiment.timeout_s),
              RunLog(experiment, run_dir, enabled=rank == 0))
    with job.guard.running():
        start = 0
        if resume_from is None and starts:
            load_module_weights(runtime.checkpoint_modules(), starts)
        if resume_from is not None:
            start = checkpoints.load(runtime, resume_from, same_local)
            job.log.resumed(resume_from, start, same_local, checkpoints.fresh_optimizers)
        summary = _loop(job, start)
    job.log.finish(summary)
    return summary


def _loop(job: Job, start: int) -> dict[str, float]:
    experiment, runtime, guard, log = job.experiment, job.runtime, job.guard, job.log
    cfg = experiment.train
    data = splits.load_splits(experiment, job.graph)
    train_batches, heldout = data["train"], data["heldout"]
    started = time.perf_counter()
    evaluated: dict[str, float] = {}
    metrics = {"loss": math.nan}
    reads = runtime.rank_reads() if cfg.data.per_rank and isinstance(train_batches, SampleBatches) else None
    loader = StepLoader(train_batches, start + 1, cfg.steps, cfg.sample_reuse, cfg.data.workers, runtime.device,
                        experiment.timeout_s, reads)
    tick, waited = time.perf_counter(), []  # the first step's time includes starting the workers
    batches = iter(loader)
    # a module computing ahead (parallel.forward_ahead) takes the next step's batch during this one
    ahead = any(node.options.forward_ahead for node in job.graph.nodes.values())

    def fetch(after: int):
        return agreed(lambda: next(batches, None), runtime.device, f"its batch for step {after + 1}")

    item = fetch(start)
    while item is not None:
        step, batch, skipped = item
        waited.append(loader.wait_s)
        if skipped:  # by a worker, on its own copy of the batches
            train_batches.skip(skipped)
        evaluates = bool(cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps
        following = fetch(step) if ahead and not evaluates else None  # none before an evaluation: it sends too
        with guard.step(f"step {step}"):
            metrics = runtime.train_step(batch, following[1] if following is not None else None)
        if cfg.sample_log:
            log.samples(step, batch["index"])
        seconds = time.perf_counter() - tick  # waiting for the batch and training on it
        if not metrics["stepped"]:
            _skipped(job, step)
        if step % cfg.log_every == 0 or step == cfg.steps:
            speed = {"samples_per_s": experiment.batch.global_batch_size / seconds, "step_s": seconds,
                     "data_wait_ms": 1e3 * sum(waited) / len(waited)}
            waited.clear()
            if hasattr(train_batches, "skipped"):  # users' samples, under train.data.on_error=skip
                speed["data/skipped"] = float(train_batches.skipped)
            log.progress(step, metrics | speed | _residuals(runtime) | _compensation(runtime) | expert_routing(runtime),
                         communicator_bytes(runtime))
        if evaluates:
            with guard.step(f"evaluation at step {step}"):
                evaluated = evaluate(runtime, heldout, cfg.eval_batches, reads)
            log.evaluation(step, evaluated, time.perf_counter() - started)
        if job.checkpoints.due(step, cfg.steps):
            job.checkpoints.save(runtime, step)
        tick = time.perf_counter()
        item = following if ahead and not evaluates else fetch(step)
    job.checkpoints.close()
    if not evaluated:  # resumed at the last step: nothing left to train
        evaluated = evaluate(runtime, heldout, cfg.eval_batches, reads)
    final = {f"final_{key}": value for key, value in metrics.items() if key == "loss" or key.endswith(".loss")}
    return {"steps": float(cfg.steps), **final, **{f"heldout_{k}": v for k, v in evaluated.items()},
            "seconds": time.perf_counter() - started}


def evaluate(runtime: Runtime, heldout: splits.Batches, max_batches: int = 0, reads=None) -> dict[str, float]:
    """Held-out losses and metrics over the first ``max_batches`` full held-out batches (0: all); ``reads``:
    the rows and images this rank reads (users' formats, ``RankReads``)."""
    batches = agreed(lambda: heldout.ordered_batches() if reads is None else heldout.ordered_batches(reads),
                     runtime.device, "its held-out batches")
    full = (b for b in batches if len(next(iter(b.values()))) == heldout.global_batch_size)
    return runtime.evaluate(itertools.islice(full, max_batches or None))


def _skipped(job: Job, step: int) -> None:
    """Log a step skipped for non-finite values and apply ``train.nonfinite``."""
    where = {m: [describe_rank(job.graph.placement, r) for r in ranks] for m, ranks in job.runtime.nonfinite.items()}
    job.log.skipped(step, where)
    if job.experiment.train.nonfinite == "stop":
        raise NonFiniteError(
            f"step {step}: non-finite loss or gradients in {', '.join(where)}; train.nonfinite=stop ends the "
            f"job (train.nonfinite=skip skips such steps)"
        )


def communicator_bytes(runtime: Runtime) -> dict[str, int]:
    """Bytes every rank handed to each communicator so far, summed over the world: each edge per direction
    (wire bytes: across modules and within replica groups), each module's stage links per direction, each
    module's gradient sync. Held-out evaluations count too."""
    names, local = [], []
    for name, edge in runtime.edges.items():
        for direction, sent in edge.sent_bytes().items():
            names.append(f"boundary.{name}.{direction}")
            local.append(sent)
    for name, node in runtime.graph.nodes.items():
        if node.layout.pp > 1:
            links = runtime.links.get(name)
            for direction in ("forward", "backward"):
                names.append(f"pipeline.{name}.{direction}")
                local.append(links.sent_bytes[direction] if links is not None else 0)
    for name in runtime.graph.nodes:
        names.append(f"grad_sync.{name}")
        module = runtime.modules.get(name)
        local.append(module.replica_sync.bytes_sent if module is not None else 0)
    for name, node in runtime.graph.nodes.items():
        if node.kind.counts_dispatch(node.config, node.layout):  # tokens to other ranks' experts
            names.append(f"all_to_all.{name}")
            module = runtime.modules.get(name)
            local.append(node.kind.dispatch_bytes(module.model) if module is not None else 0)
    totals = torch.tensor(local, dtype=torch.float64, device=runtime.device)
    dist.all_reduce(totals)
    return {name: int(value) for name, value in zip(names, totals.tolist())}




def expert_routing(runtime: Runtime) -> dict[str, float]:
    """Per module with experts, over the training steps since the last call: the per-expert load (the
    tokens of the busiest expert over the mean, the worst layer's) and the fraction of top-k assignments
    dropped for capacity, counted over every rank (each routes its own tokens)."""
    shapes = {name: shape for name, node in runtime.graph.nodes.items()
              if (shape := node.kind.routing_shape(node.config)) is not None}  # (layers, experts)
    if not shapes:
        return {}
    tables = {name: torch.zeros(layers, experts + 2, dtype=torch.float64, device=runtime.device)
              for name, (layers, experts) in shapes.items()}
    for name, table in tables.items():
        module = runtime.modules.get(name)
        if module is None:
            continue
        for index, counts in runtime.graph.nodes[name].kind.take_routing(module.model).items():
            table[index] = counts.to(table.device)
    totals = torch.cat([table.flatten() for table in tables.values()])
    dist.all_reduce(totals)
    out = {}
    for (name, (layers, experts)), table in zip(shapes.items(), totals.split([t.numel() for t in tables.values()])):
        table = table.view(layers, experts + 2)
        load = table[:, :experts]
        busiest = (load.max(1).values / load.mean(1).clamp(min=1e-30)).max()
        out[f"expert_load.{name}"] = float(busiest)
        out[f"expert_dropped.{name}"] = float(table[:, -1].sum() / table[:, -2].sum().clamp(min=1))
    return out


def module_seconds(runtime: Runtime) -> dict[str, float]:
    """Each module's compute seconds so far (its forwards and backwards), the largest over its ranks."""
    names = list(runtime.graph.nodes)
    seconds = runtime.timer.seconds()
    local = torch.tensor([seconds[n] for n in names], dtype=torch.float64, device=runtime.device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return dict(zip(names, local.tolist()))


def _residuals(runtime: Runtime) -> dict[str, float]:
    """Each module's error-feedback residual norm, the largest over its replicas (0 without one)."""
    names = list(runtime.graph.nodes)
    local = torch.tensor([runtime.modules[n].replica_sync.residual_norm() if n in runtime.modules else 0.0
                          for n in names], dtype=torch.float64, device=runtime.device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return {f"ef_residual.{n}": float(v) for n, v in zip(names, local.tolist())}


def _compensation(runtime: Runtime) -> dict[str, float]:
    """Bytes held for activation-compression error compensation, the largest on any rank."""
    local = sum(end.memory_bytes() for end in runtime.edge_ends().values())
    total = torch.tensor([float(local)], dtype=torch.float64, device=runtime.device)
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    return {"ec_memory_bytes": float(total)}
