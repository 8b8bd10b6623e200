"""Train the four-module graph: the job for an experiment with ``vit``, ``genezip``, ``gpt`` and ``video``
modules named vision, dna, llm and video (``configs/experiment/full_graph.yaml``).

    hetero train full_graph        (torchrun --nproc_per_node 8 -m hetero.train.run experiment=full_graph)

Samples are ``hetero.data.multimodal``'s: text, and with probabilities ``train.presence`` a digit image,
a genome window and a short clip. Rank 0 logs the combined loss and each module's loss (text, DNA,
video), the bytes of every edge, stage link and gradient sync, and at each evaluation the held-out digit
and GC-bin accuracies and losses.
"""

from __future__ import annotations

import itertools
import math
import time

import torch
import torch.distributed as dist

from hetero.config import ExperimentConfig
from hetero.data.digits import ensure_digit_shards
from hetero.data.genome import GenomeOptions, ensure_genome_shards, genome_shards
from hetero.data.multimodal import MultimodalBatches
from hetero.data.video_clips import ClipOptions, ensure_video_shards
from hetero.errors import ConfigError
from hetero.testing.full_graph import LOSSES, GraphConfigs
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.placement import Placement
from hetero.train.faults import describe_rank
from hetero.train.graph import EDGES, LOSS_MODULE, MODULES, GraphTrainer
from hetero.train.job import Job, run_job
from hetero.train.module_runtime import ModuleSetup

KINDS = {"vision": "vit", "dna": "genezip", "llm": "gpt", "video": "video"}
CLIP_COUNTS = {"train": 512, "heldout": 64}


def clip_options(frame_size: int) -> ClipOptions:
    """Short clips (8 frames: the digit's scene, two others, the digit's scene again)."""
    return ClipOptions(frames=8, size=frame_size, gap=3, a_len=3)


def is_graph(experiment: ExperimentConfig) -> bool:
    return {name: module.kind for name, module in experiment.modules.items()} == KINDS


def check_graph(experiment: ExperimentConfig) -> None:
    """The graph job's own checks, before any process group: its edges, exactly."""
    edges = {(edge.src, edge.dst) for edge in experiment.edges}
    if edges != set(EDGES) or len(experiment.edges) != len(EDGES):
        wanted = ", ".join(f"{s}->{d}" for s, d in EDGES)
        got = ", ".join(f"{e.src}->{e.dst}" for e in experiment.edges) or "none"
        raise ConfigError(f"edges: the graph job runs exactly the edges {wanted}; the config lists {got}")


def graph_configs(experiment: ExperimentConfig) -> GraphConfigs:
    return GraphConfigs(**{name: experiment.model_config(name) for name in MODULES})


def graph_batches(experiment: ExperimentConfig, split: str) -> MultimodalBatches:
    configs, cfg = graph_configs(experiment), experiment.train
    return MultimodalBatches(
        cfg.data_dir, genome_shards(cfg.genome_dir, configs.dna.seq_len), cfg.clip_dir, split,
        experiment.batch.global_batch_size, configs.vision.num_patches, configs.dna.max_tokens(), configs.llm.seq_len,
        experiment.seed, cfg.presence, cfg.bad_shards,
    )


def build_graph(
    experiment: ExperimentConfig, meshes: dict[str, ModuleMesh], placement: Placement,
    splits: tuple[str, ...] = ("train", "heldout"),
) -> tuple[GraphTrainer, dict[str, MultimodalBatches]]:
    """The trainer and each split's batches; rank 0 writes missing shards first (every rank calls this)."""
    configs, cfg = graph_configs(experiment), experiment.train
    if dist.get_rank() == 0:
        ensure_digit_shards(cfg.data_dir)
        ensure_genome_shards(genome_shards(cfg.genome_dir, configs.dna.seq_len), GenomeOptions(window=configs.dna.seq_len))
        ensure_video_shards(cfg.clip_dir, CLIP_COUNTS["train"], CLIP_COUNTS["heldout"],
                            clip_options(configs.video.frame_size), seed=experiment.seed)
    dist.barrier()
    data = {split: graph_batches(experiment, split) for split in splits}
    modules = experiment.modules
    trainer = GraphTrainer(
        placement, meshes, configs,
        num_microbatches=experiment.num_microbatches("llm", placement.layouts["llm"].dp),
        setups={name: ModuleSetup(m.parallel, m.optim, m.compression) for name, m in modules.items()},
        loss_weights={loss: modules[module].loss_weight for loss, module in LOSS_MODULE.items()},
        edge_compression={(edge.src, edge.dst): edge.compression for edge in experiment.edges},
        grad_clip=cfg.grad_clip, seed=experiment.seed, timeout_s=experiment.timeout_s, sample_reuse=cfg.sample_reuse,
    )
    return trainer, data


def evaluate(trainer: GraphTrainer, heldout: MultimodalBatches, max_batches: int = 0) -> dict[str, float]:
    """Held-out losses (means over batches) and accuracies (over every evaluated position) of the first
    ``max_batches`` held-out batches (0: all)."""
    sums: dict[str, float] = {}
    batches = 0
    for batch in itertools.islice(heldout.ordered_batches(), max_batches or None):
        if batch["tokens"].shape[0] != heldout.global_batch_size:
            continue  # a short last batch would not split into the microbatches
        metrics = trainer.evaluate(batch)
        batches += 1
        for key in ["loss"] + [f"{name}_loss" for name in LOSSES]:
            sums[key] = sums.get(key, 0.0) + metrics[key]
        for key, count in (("accuracy", "evaluated"), ("gc_accuracy", "gc_evaluated")):
            sums[key] = sums.get(key, 0.0) + metrics[key] * metrics[count]
            sums[count] = sums.get(count, 0.0) + metrics[count]
    out = {key: value / max(batches, 1) for key, value in sums.items() if key.endswith("loss")}
    out["accuracy"] = sums.get("accuracy", 0.0) / max(sums.get("evaluated", 0.0), 1.0)
    out["gc_accuracy"] = sums.get("gc_accuracy", 0.0) / max(sums.get("gc_evaluated", 0.0), 1.0)
    return out


def communicator_bytes(trainer: GraphTrainer) -> dict[str, int]:
    """Bytes every rank handed to each communicator so far, summed over the world: each edge per
    direction, the LLM's stage links, each module's gradient sync (evaluation passes included)."""
    names, local = [], []
    for name, edge in trainer.edges.items():
        for direction, sent in edge.counters().items():
            names.append(f"edge.{name}.{direction}")
            local.append(sent)
    for direction, sent in trainer.pipeline_bytes.items():
        names.append(f"pipeline.llm.{direction}")
        local.append(sent)
    for name in trainer.placement.layouts:
        names.append(f"grad_sync.{name}")
        module = trainer.modules.get(name)
        local.append(module.replica_sync.bytes_sent if module else 0)
    totals = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(totals)
    return {name: int(value) for name, value in zip(names, totals.tolist())}


def module_seconds(trainer: GraphTrainer) -> dict[str, float]:
    """Each module's compute seconds so far, the largest over its ranks."""
    local = torch.tensor([trainer.module_seconds[name] for name in MODULES], dtype=torch.float64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return dict(zip(MODULES, local.tolist()))


def train_graph(experiment: ExperimentConfig) -> dict[str, float]:
    check_graph(experiment)
    return run_job(experiment, _train)


def _train(job: Job) -> dict[str, float]:
    experiment, placement, guard, log, cfg = job.experiment, job.placement, job.guard, job.log, job.experiment.train
    trainer, data = build_graph(experiment, job.meshes, placement)
    start = job.resume(trainer)
    tokens_per_step = experiment.batch.global_batch_size * experiment.model_config("llm").seq_len
    started = time.perf_counter()
    heldout: dict[str, float] = {}
    metrics = {"loss": math.nan}
    for step in range(start + 1, cfg.steps + 1):
        tick = time.perf_counter()
        with guard.step(f"step {step}"):
            metrics = trainer.train_step(data["train"].batch((step - 1) // cfg.sample_reuse))
        seconds = time.perf_counter() - tick
        if not metrics["stepped"]:
            job.check_finite(step, {m: [describe_rank(placement, r) for r in ranks] for m, ranks in trainer.nonfinite.items()})
        if step % cfg.log_every == 0 or step == cfg.steps:
            speed = {"tokens_per_s": tokens_per_step / seconds, "step_s": seconds}
            log.progress(step, metrics | speed, communicator_bytes(trainer))
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
            with guard.step(f"evaluation at step {step}"):
                heldout = evaluate(trainer, data["heldout"], cfg.eval_batches)
            log.evaluation(step, heldout, time.perf_counter() - started)
        if job.checkpoints.due(step, cfg.steps):
            job.checkpoints.save(trainer, step)
    job.checkpoints.close()
    if not heldout:  # resumed at the last step: nothing left to train
        heldout = evaluate(trainer, data["heldout"], cfg.eval_batches)
    return {
        "steps": float(cfg.steps),
        "final_loss": metrics["loss"],
        **{f"final_{name}_loss": metrics.get(f"{name}_loss", math.nan) for name in LOSSES},
        **{f"heldout_{key}": value for key, value in heldout.items()},
        "seconds": time.perf_counter() - started,
    }
