"""The one training job, for every graph: checks, process groups, the runtime, the loop, checkpoints.

``train(experiment, registry)`` checks the experiment and builds its graph (of the registry's kinds),
finds and verifies the checkpoint to resume from (all before any process group exists), joins the
launcher's world, builds the runtime, and runs the loop under the fault guard: a training step per batch
(once every rank has built its own), a progress line every ``log_every`` steps (every module's loss, the
gradient norm, each communicator's bytes), held-out evaluations every ``eval_every`` steps and at the
end (every module's losses and metrics), checkpoints every ``checkpoint.every`` steps, and a summary.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hetero.config import ExperimentConfig
from hetero.data import splits
from hetero.data.loader import StepLoader
from hetero.errors import ConfigError
from hetero.graph import Graph, build_graph
from hetero.interop.hf_source import imported_sources
from hetero.kinds.registry import KindRegistry
from hetero.parallel.mesh import init_distributed
from hetero.kinds.batch_rows import batch_size
from hetero.runtime import Runtime, build_runtime
from hetero.runtime.rows import RankReads
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
    graph, checkpoints, run_dir = _prepare(experiment, registry)
    check_trains(experiment, graph)
    resume_from = resolve_resume(experiment.train.checkpoint, checkpoints.root)
    manifest, same_local = ({}, True) if resume_from is None else check_resumable(resume_from, checkpoints.identity)
    starts = {name: Path(node.settings.init.checkpoint) for name, node in graph.nodes.items()
              if node.settings.init.checkpoint is not None}  # next-stage weights, unless resuming this run
    check_module_sources(checkpoints.identity.as_json()["models"], starts)
    job = _start(experiment, graph, checkpoints, run_dir)
    with job.guard.running():
        start = 0
        if resume_from is None and starts:
            load_module_weights(job.runtime.checkpoint_modules(), starts)
        if resume_from is not None:
            start = checkpoints.load(job.runtime, resume_from, same_local)
            job.log.resumed(resume_from, start, same_local, checkpoints.fresh_optimizers)
        summary = _loop(job, start, _saved_losses(manifest, run_dir))
    job.log.finish(summary)
    return summary


def check_trains(experiment: ExperimentConfig, graph: Graph) -> None:
    """Refuse a training job in which no parameter trains (before any process starts), pointing at
    ``hetero eval`` for measuring the weights."""
    if any(node.trains for node in graph.nodes.values()):
        return
    why = ", ".join(f"{name}.trainable=false" if not node.settings.trainable
                    else f"{name}.frozen={list(node.settings.frozen)}" for name, node in graph.nodes.items())
    raise ConfigError(
        f"every module is frozen ({why}): there is nothing to train; to measure held-out figures of these "
        f"weights run `hetero eval {experiment.name} ...` with the same overrides (it evaluates the run's last "
        f"checkpoint, else each <module>.init.checkpoint)"
    )


@dataclass(frozen=True)
class Weights:
    """What ``hetero eval`` evaluates: each module's checkpoint (a module absent: its ``init.hf`` weights),
    the step they end, and whether rank-local state carries over (one checkpoint, saved under these layouts
    and compression settings)."""

    sources: dict[str, Path]
    step: int
    same_local: bool


def weights_to_evaluate(experiment: ExperimentConfig, graph: Graph,
                        checkpoints: Checkpointer | None = None) -> Weights:
    """The checkpoints ``hetero eval`` loads, checked before any process group exists: as a training job
    would start, the run's newest complete checkpoint (or ``train.checkpoint.resume``'s step_* directory)
    for every module, else each module's ``init.checkpoint``. ``ConfigError`` when there is none."""
    checkpoints = checkpoints or _checkpointer(experiment, graph)
    found = resolve_resume(experiment.train.checkpoint, checkpoints.root)
    if found is not None:
        sources = {name: found for name in graph.nodes}
    else:
        sources = {name: Path(node.settings.init.checkpoint) for name, node in graph.nodes.items()
                   if node.settings.init.checkpoint is not None}
    if not sources:
        where = ("train.checkpoint.resume=never" if experiment.train.checkpoint.resume == "never"
                 else f"no complete checkpoint under {checkpoints.root}")
        raise ConfigError(
            f"nothing to evaluate: {where} and no module has init.checkpoint; set each module's init.checkpoint="
            f"<a step_* directory> ({', '.join(f'{name}.init.checkpoint=...' for name in graph.nodes)}), "
            f"train.checkpoint.resume=<a step_* directory>, or train.run_dir (train.checkpoint.dir) to a run that "
            f"saved checkpoints (train.checkpoint.every=N)"
        )
    missing = [name for name, node in graph.nodes.items() if name not in sources and node.settings.init.hf is None]
    if missing:
        raise ConfigError(
            f"{', '.join(missing)}: no weights to evaluate (other modules start from init.checkpoint); set "
            f"{', '.join(f'{name}.init.checkpoint=<a step_* directory>' for name in missing)}"
        )
    try:
        manifests = check_module_sources(checkpoints.identity.as_json()["models"], sources)
    except ConfigError as err:
        if found is None:
            raise
        raise ConfigError(f"{err} (the checkpoint this run resumes from)") from None
    steps = {int(manifest["step"]) for manifest in manifests.values()}
    local = checkpoints.identity.as_json()["local"]
    same_local = (len(manifests) == 1 and len(sources) == len(graph.nodes)
                  and next(iter(manifests.values()))["identity"]["local"] == local)
    return Weights(sources, steps.pop() if len(steps) == 1 else 0, same_local)


def evaluate_checkpoint(experiment: ExperimentConfig, registry: KindRegistry) -> dict[str, float]:
    """``hetero eval`` on this rank of a launched world: the training job's setup under this experiment's
    layouts, the weights of ``weights_to_evaluate`` (resharded from whatever layouts saved them), one
    held-out evaluation as a training run makes it (printed, in ``<run dir>/eval/metrics.jsonl`` and
    wandb), and a summary; no optimizer step, no checkpoint written."""
    graph, checkpoints, run_dir = _prepare(experiment, registry)
    weights = weights_to_evaluate(experiment, graph, checkpoints)
    job = _start(experiment, graph, checkpoints, run_dir / "eval", saves=False)
    with job.guard.running():
        load_module_weights(job.runtime.checkpoint_modules(), weights.sources)
        if weights.same_local:  # e.g. edge compensation, DiLoCo's inner weights: as the training run held them
            checkpoints.load_rank_local(job.runtime, next(iter(weights.sources.values())))
        job.runtime.step = weights.step
        job.log.evaluating(weights.sources, weights.step)
        data = splits.load_splits(experiment, graph)
        started = time.perf_counter()
        with job.guard.step(f"evaluation of step {weights.step}"):
            evaluated = evaluate(job.runtime, data["heldout"], experiment.train.eval_batches, _reads(job))
        seconds = time.perf_counter() - started
        job.log.evaluation(weights.step, evaluated, seconds)
    summary = {"step": float(weights.step), **{f"heldout_{k}": v for k, v in evaluated.items()},
               "seconds": seconds}
    job.log.finish(summary)
    return summary


def _checkpointer(experiment: ExperimentConfig, graph: Graph) -> Checkpointer:
    cfg = experiment.train
    root = Path(cfg.checkpoint.dir or Path(cfg.run_dir) / experiment.name / "checkpoints")
    return Checkpointer(cfg.checkpoint, root, run_identity(experiment, graph), imported_sources(graph))


def _prepare(experiment: ExperimentConfig, registry: KindRegistry) -> tuple[Graph, Checkpointer, Path]:
    """Before any process group: the graph (every check), the data's checks, the run's checkpoints and
    folder."""
    graph = build_graph(experiment, registry)
    splits.check(experiment, graph)
    return graph, _checkpointer(experiment, graph), Path(experiment.train.run_dir) / experiment.name


def _start(experiment: ExperimentConfig, graph: Graph, checkpoints: Checkpointer, log_dir: Path,
           saves: bool = True) -> Job:
    """Join the launcher's world and build this rank's runtime, fault guard and run log."""
    rank = init_distributed(graph.placement, experiment.backend, experiment.timeout_s)
    runtime = build_runtime(experiment, graph=graph)
    if saves:
        checkpoints.attach()
    return Job(experiment, graph, runtime, checkpoints, FaultGuard(graph.placement, experiment.timeout_s),
               RunLog(experiment, log_dir, enabled=rank == 0, job_type="train" if saves else "eval"))


def _reads(job: Job) -> RankReads | None:
    """The rows and images this rank reads under ``train.data.per_rank`` (else None: the global batch)."""
    return job.runtime.rank_reads() if job.experiment.train.data.per_rank else None


def _losses(metrics: dict[str, float]) -> dict[str, float]:
    """A step's loss figures: the combined ``loss`` and each module's ``<module>.loss``."""
    return {key: value for key, value in metrics.items() if key == "loss" or key.endswith(".loss")}


def _saved_losses(manifest: dict, run_dir: Path) -> dict[str, float]:
    """The loss figures of the step a resumed checkpoint ends: kept in its manifest; for a checkpoint saved
    before they were kept, that step's record in the run's ``metrics.jsonl`` if there is one."""
    if not manifest:
        return {}
    if "losses" in manifest:
        return manifest["losses"]
    path, found = run_dir / "metrics.jsonl", {}
    for line in path.read_text().splitlines() if path.is_file() else ():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a killed run
            continue
        if row.get("step") == manifest["step"] and "loss" in row:
            found = _losses(row)
    return found


def _loop(job: Job, start: int, last: dict[str, float]) -> dict[str, float]:
    """Train steps ``start + 1`` to ``train.steps``; ``last``: the loss figures of step ``start`` (a resumed
    checkpoint's), the final ones when no step is left."""
    experiment, runtime, guard, log = job.experiment, job.runtime, job.guard, job.log
    cfg = experiment.train
    data = splits.load_splits(experiment, job.graph)
    train_batches, heldout = data["train"], data["heldout"]
    started = time.perf_counter()
    evaluated: dict[str, float] = {}
    metrics = dict(last) or {"loss": math.nan}
    reads = _reads(job)
    loader = StepLoader(train_batches, start + 1, cfg.steps, cfg.sample_reuse, cfg.data.workers, runtime.device,
                        experiment.timeout_s, reads)
    tick, waited = time.perf_counter(), []  # the first step's time includes starting the workers
    batches = iter(loader)
    # a module computing ahead (parallel.forward_ahead) takes the next step's batch during this one
    ahead = any(node.options.forward_ahead for node in job.graph.nodes.values())

    def fetch(after: int):
        return agreed(lambda: checked(runtime, next(batches, None)), runtime.device, f"its batch for step {after + 1}")

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
            job.checkpoints.save(runtime, step, _losses(metrics))
        tick = time.perf_counter()
        item = following if ahead and not evaluates else fetch(step)
    job.checkpoints.close()
    if not evaluated:  # resumed at the last step: nothing left to train
        with guard.step(f"evaluation at step {start}"):
            evaluated = evaluate(runtime, heldout, cfg.eval_batches, reads)
        log.evaluation(start, evaluated, time.perf_counter() - started)
    final = {f"final_{key}": value for key, value in _losses(metrics).items()}
    return {"steps": float(cfg.steps), **final, **{f"heldout_{k}": v for k, v in evaluated.items()},
            "seconds": time.perf_counter() - started}


def checked(runtime: Runtime, item):
    """``item`` (a loader's ``(step, batch, skipped)``, or None at the end) once its batch passed the
    runtime's checks: run inside the data agreement, a row only this rank holds that a module cannot
    take stops every rank."""
    if item is not None:
        runtime.check(item[1])
    return item


def evaluate(runtime: Runtime, heldout: splits.Batches, max_batches: int = 0,
             reads: RankReads | None = None) -> dict[str, float]:
    """Held-out losses and metrics over the first ``max_batches`` full held-out batches (0: all); ``reads``:
    the rows and images this rank reads (``hetero.data.rank_batches``; None: the global batches)."""
    def built() -> list[dict[str, torch.Tensor]]:
        full = [b for b in heldout.ordered_batches(reads) if batch_size(b) == heldout.global_batch_size]
        full = full[: max_batches or None]
        for batch in full:
            runtime.check(batch)
        return full

    return runtime.evaluate(agreed(built, runtime.device, "its held-out batches"))


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
