"""Train an experiment's GeneZip DNA compressor on the genome shards: the job for a lone ``genezip`` module.

    hetero train genezip            (torchrun -m hetero.train.run experiment=genezip)

The compressor runs under its module's layout (TP over heads, DP over windows; ``genezip_parallelize``)
and learns next-base prediction plus the ratio loss toward its bases-per-token targets (per region under
the Region-Aware Ratio, from the windows' gene annotations). Rank 0 logs progress to stdout and wandb and,
at every evaluation, held-out bits per base and the achieved bases per token per region.
"""

from __future__ import annotations

import itertools
import math
import time

import torch
import torch.distributed as dist

from hetero.config import ExperimentConfig
from hetero.data.digits import dp_slice
from hetero.data.genome import GenomeOptions, GenomeWindows, ensure_genome_shards, genome_shards
from hetero.kinds.genezip.model import GeneZip
from hetero.kinds.genezip.objectives import genezip_loss, heldout_metrics
from hetero.kinds.genezip.plan import parallelize_genezip
from hetero.parallel.data import AllReduceGradSync
from hetero.train.job import Job, SingleModule, run_job
from hetero.train.optim import build_adamw

HELDOUT_BATCH = 64


def train_genezip(experiment: ExperimentConfig) -> dict[str, float]:
    return run_job(experiment, _train)


def _train(job: Job) -> dict[str, float]:
    experiment, rank = job.experiment, job.rank
    (name,) = experiment.modules
    mesh = job.meshes[name]
    module, config, cfg = experiment.modules[name], experiment.model_config(name), experiment.train
    data_dir = genome_shards(cfg.genome_dir, config.seq_len)
    if rank == 0:
        ensure_genome_shards(data_dir, GenomeOptions(window=config.seq_len))
    dist.barrier()
    batch_size = experiment.batch.global_batch_size
    train = GenomeWindows(data_dir, "train", batch_size, experiment.seed)
    heldout = GenomeWindows(data_dir, "heldout", HELDOUT_BATCH, experiment.seed)

    torch.manual_seed(experiment.seed)
    model = parallelize_genezip(GeneZip(config), mesh, module.parallel)
    params = list(model.named_parameters())
    optimizer = build_adamw(model, module.optim)
    sync = AllReduceGradSync(params, mesh.group("dp")) if mesh.layout.dp > 1 else None
    state = SingleModule(name, model, optimizer)
    start = job.resume(state)
    started, scores, metrics = time.perf_counter(), {}, {"loss": math.nan}
    for step in range(start + 1, cfg.steps + 1):
        tick = time.perf_counter()
        with job.guard.step(f"step {step}"):
            rows = dp_slice(train.batch(step - 1), mesh.coord.dp, mesh.layout.dp)
            loss = genezip_loss(config, model(rows["bases"]), rows["bases"], rows["regions"])
            for group in optimizer.param_groups:
                group["lr"] = module.optim.lr_at(step - 1)
            optimizer.zero_grad()
            (loss.total(config).sum() / batch_size).backward()  # the DP sum of the ranks' parts: the batch mean
            grad_norm = job.apply_gradients(step, name, optimizer, [p for _, p in params], sync)
        state.step = step
        seconds = time.perf_counter() - tick
        if step % cfg.log_every == 0 or step == cfg.steps:
            reduced = torch.stack([loss.prediction.detach().sum(), loss.ratio.detach().sum()]) / batch_size
            dist.all_reduce(reduced, group=mesh.group("dp"))
            metrics = {"loss": float(reduced[0] + config.ratio_weight * reduced[1]), "prediction": float(reduced[0]),
                       "ratio_loss": float(reduced[1]), "grad_norm": grad_norm, "step_s": seconds,
                       "tokens_per_s": batch_size * config.seq_len / seconds}
            job.log.progress(step, metrics, {f"grad_sync.{name}": sync.bytes_sent if sync else 0})
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
            with job.guard.step(f"evaluation at step {step}"):
                scores = heldout_metrics(model, itertools.islice(heldout.ordered_batches(), cfg.eval_batches or None))
            if rank == 0:
                per_region = ", ".join(f"{k[4:]} {v:.2f}" for k, v in scores.items() if k.startswith("bpt."))
                print(f"step {step:5d} | held-out {scores['bits_per_base']:.4f} bits/base | bases per token: "
                      f"{per_region} (all {scores['bpt']:.2f}) | {time.perf_counter() - started:.0f} s", flush=True)
        if job.checkpoints.due(step, cfg.steps):
            job.checkpoints.save(state, step)
    job.checkpoints.close()
    return {"steps": float(cfg.steps), "final_loss": metrics["loss"], **scores, "seconds": time.perf_counter() - started}
