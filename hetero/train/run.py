"""Train an experiment: the job ``torchrun`` launches. A vision-language model trains on the digits shards
(here); an experiment of one ``video`` module trains in ``hetero.train.video_run``.

    torchrun --nproc_per_node 4 -m hetero.train.run experiment=colocated_vlm [overrides]

Rank 0 prints a progress line (step, loss, tokens/s, step time, bytes per communicator) and, at every
evaluation, the held-out digit accuracy; it logs the same to wandb (offline unless disabled) and prints
a summary at the end.
"""

from __future__ import annotations

import itertools
import math
import sys
import time

import torch
import torch.distributed as dist

from hetero.config import ExperimentConfig, load_experiment
from hetero.data.digit_dna import DigitDnaBatches
from hetero.data.digits import DigitBatches, ensure_digit_shards
from hetero.data.genome import GenomeOptions, ensure_genome_shards, genome_shards
from hetero.errors import ConfigError
from hetero.parallel.mesh import ModuleMesh
from hetero.parallel.placement import Placement
from hetero.train.faults import describe_rank
from hetero.train.job import Job, run_job
from hetero.train.vlm import ModuleSetup, VLMTrainer


def evaluate(trainer: VLMTrainer, heldout: DigitBatches, max_batches: int = 0) -> dict[str, float]:
    """Held-out accuracy of the digit (and, with a DNA encoder, of the window's GC-content bin), over the
    first ``max_batches`` held-out batches (0: all)."""
    hits: dict[str, float] = {}
    total = 0.0
    for batch in itertools.islice(heldout.ordered_batches(), max_batches or None):
        if batch["images"].shape[0] != heldout.global_batch_size:
            continue  # a short last batch would not split into the microbatches
        metrics = trainer.evaluate(batch)
        for key in ("accuracy", "gc_accuracy"):
            if key in metrics:
                hits[key] = hits.get(key, 0.0) + metrics[key] * metrics["evaluated"]
        total += metrics["evaluated"]
    return {key: value / max(total, 1.0) for key, value in hits.items()}


def communicator_bytes(trainer: VLMTrainer) -> dict[str, int]:
    """Bytes every rank handed to each communicator so far, summed over the world: per edge and
    direction (the boundary's wire bytes, cross-module plus within replica groups; the LLM's stage
    edges' payloads) and per gradient sync. Counts include held-out evaluation passes."""
    local, names = [], []
    for encoder, boundary in trainer.boundaries.items():
        counters = dict.fromkeys(boundary.counters(), 0)
        compressed = trainer.compressed_boundary if encoder == "vision" else None
        for edge in (boundary, compressed):
            for key, value in (edge.counters() if edge is not None else {}).items():
                counters[key] += value
        for direction in ("forward", "backward"):
            names.append(f"boundary.{encoder}->llm.{direction}")
            local.append(counters[f"{direction}.cross_sent_bytes"] + counters[f"{direction}.intra_sent_bytes"])
    for direction in ("forward", "backward"):
        names.append(f"pipeline.llm.{direction}")
        local.append(trainer.pipeline_bytes[direction])
    for name in trainer.placement.layouts:
        names.append(f"grad_sync.{name}")
        module = trainer.modules.get(name)
        local.append(module.replica_sync.bytes_sent if module else 0)
    totals = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(totals)
    return {name: int(value) for name, value in zip(names, totals.tolist())}


def compensation_memory(trainer: VLMTrainer) -> dict[str, float]:
    """Bytes held for activation-compression error compensation, the largest on any rank."""
    ends = list(trainer.llm_edges.values())
    edge = trainer.compressed_boundary
    local = sum(e.memory_bytes() for e in ends) + (edge.memory_bytes() if edge is not None else 0)
    total = torch.tensor([float(local)], dtype=torch.float64)
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    return {"ec_memory_bytes": float(total)}


def residual_norms(trainer: VLMTrainer) -> dict[str, float]:
    """Each module's error-feedback residual norm, the largest over its replicas (0 without one)."""
    names = list(trainer.placement.layouts)
    local = torch.tensor([trainer.modules[n].replica_sync.residual_norm() if n in trainer.modules else 0.0
                          for n in names], dtype=torch.float64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return {f"ef_residual.{n}": float(v) for n, v in zip(names, local.tolist())}


def train(experiment: ExperimentConfig) -> dict[str, float]:
    if [m.kind for m in experiment.modules.values()] == ["video"]:
        from hetero.train.video_run import train_video

        return train_video(experiment)
    if [m.kind for m in experiment.modules.values()] == ["genezip"]:
        from hetero.train.genezip_run import train_genezip

        return train_genezip(experiment)
    from hetero.train.graph_run import is_graph, train_graph

    if is_graph(experiment):
        return train_graph(experiment)
    check_vlm_edges(experiment)
    return run_job(experiment, _train_vlm)


def check_vlm_edges(experiment: ExperimentConfig) -> None:
    """A VLM job compresses only the vision->llm edge."""
    for edge in experiment.edges:
        if edge.compression.enabled and (edge.src, edge.dst) != ("vision", "llm"):
            raise ConfigError(
                f"edges {edge.src}->{edge.dst}: this job compresses only the vision->llm edge; remove the "
                f"compression block of {edge.src}->{edge.dst}"
            )


def vlm_batches(experiment: ExperimentConfig, split: str) -> DigitBatches:
    """A VLM experiment's batches of ``split`` (train | heldout): digits, with DNA windows when a ``dna``
    module exists. The shards must exist (``build_vlm`` writes them on first use)."""
    vision, llm = experiment.model_config("vision"), experiment.model_config("llm")
    cfg, size = experiment.train, experiment.batch.global_batch_size
    if "dna" not in experiment.modules:
        return DigitBatches(cfg.data_dir, split, size, vision.num_patches, llm.seq_len, experiment.seed, cfg.bad_shards)
    dna = experiment.model_config("dna")
    return DigitDnaBatches(
        cfg.data_dir, genome_shards(cfg.genome_dir, dna.seq_len), split, size, vision.num_patches, dna.max_tokens(),
        llm.seq_len, experiment.seed, cfg.bad_shards,
    )


def build_vlm(
    experiment: ExperimentConfig, meshes: dict[str, ModuleMesh], placement: Placement,
    splits: tuple[str, ...] = ("train", "heldout"),
) -> tuple[VLMTrainer, dict[str, DigitBatches]]:
    """A VLM experiment's trainer and its batches of each split; rank 0 writes missing shards first (every
    rank calls this: it has a barrier)."""
    vision, llm = experiment.model_config("vision"), experiment.model_config("llm")
    dna = experiment.model_config("dna") if "dna" in experiment.modules else None
    cfg = experiment.train
    if dist.get_rank() == 0:
        ensure_digit_shards(cfg.data_dir)
        if dna is not None:
            ensure_genome_shards(genome_shards(cfg.genome_dir, dna.seq_len), GenomeOptions(window=dna.seq_len))
    dist.barrier()
    data = {split: vlm_batches(experiment, split) for split in splits}
    setups = {
        name: ModuleSetup(module.parallel, module.optim, module.compression) for name, module in experiment.modules.items()
    }
    edges = {(edge.src, edge.dst): edge.compression for edge in experiment.edges}
    trainer = VLMTrainer(
        placement,
        meshes,
        vision,
        llm,
        num_microbatches=experiment.num_microbatches("llm", placement.layouts["llm"].dp),
        setups=setups,
        grad_clip=cfg.grad_clip,
        seed=experiment.seed,
        timeout_s=experiment.timeout_s,
        boundary_compression=edges.get(("vision", "llm")),
        sample_reuse=cfg.sample_reuse,
        dna_config=dna,
    )
    return trainer, data


def _train_vlm(job: Job) -> dict[str, float]:
    experiment, placement, guard, log = job.experiment, job.placement, job.guard, job.log
    llm = experiment.model_config("llm")
    cfg = experiment.train
    trainer, data = build_vlm(experiment, job.meshes, placement)
    start = job.resume(trainer)
    tokens_per_step = experiment.batch.global_batch_size * llm.seq_len
    started = time.perf_counter()
    accuracy: dict[str, float] = {}
    metrics = {"loss": math.nan}
    for step in range(start + 1, cfg.steps + 1):
        tick = time.perf_counter()
        with guard.step(f"step {step}"):
            metrics = trainer.train_step(data["train"].batch((step - 1) // cfg.sample_reuse))
        seconds = time.perf_counter() - tick
        if not metrics["stepped"]:
            job.check_finite(step, {m: [describe_rank(placement, r) for r in ranks] for m, ranks in trainer.nonfinite.items()})
        if step % cfg.log_every == 0 or step == cfg.steps:
            comm = communicator_bytes(trainer)
            speed = {"tokens_per_s": tokens_per_step / seconds, "step_s": seconds}
            log.progress(step, metrics | speed | residual_norms(trainer) | compensation_memory(trainer), comm)
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
            with guard.step(f"evaluation at step {step}"):
                accuracy = evaluate(trainer, data["heldout"], cfg.eval_batches)
            log.evaluation(step, accuracy, time.perf_counter() - started)
        if job.checkpoints.due(step, cfg.steps):
            job.checkpoints.save(trainer, step)
    job.checkpoints.close()
    if not accuracy:  # resumed at the last step: nothing left to train
        accuracy = evaluate(trainer, data["heldout"], cfg.eval_batches)
    return {
        "steps": float(cfg.steps),
        "final_loss": metrics["loss"],
        "heldout_digit_accuracy": accuracy["accuracy"],
        **({"heldout_gc_accuracy": accuracy["gc_accuracy"]} if "gc_accuracy" in accuracy else {}),
        "seconds": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> None:
    train(load_experiment("", sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
