"""Train an experiment's video generator on the revisit-clip shards: the job for a ``video`` module.

    hetero train video            (torchrun -m hetero.train.run experiment=video)

The generator runs under its module's layout (TP over heads, DP over clips; ``video_parallelize``) and
learns by flow matching under its configured memory policy (``model.memory``). Under ``learned`` the
generator trains on random keeps while the importance router trains by distillation from the same
generator with the full context (L2M). Rank 0 logs progress to stdout and wandb and, at every
evaluation, the held-out next-frame error on revisited and on all frames.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from hetero.config import ExperimentConfig
from hetero.data.digits import dp_slice
from hetero.data.video_clips import ClipOptions, VideoClips, ensure_video_shards
from hetero.kinds.video.model import VideoGenerator
from hetero.kinds.video.objectives import distillation_loss, flow_matching_loss, next_frame_errors, to_model
from hetero.kinds.video.plan import parallelize_video
from hetero.kinds.video.router import ImportanceRouter
from hetero.parallel.data import AllReduceGradSync
from hetero.train.job import Job, SingleModule, run_job
from hetero.train.optim import build_adamw

CLIPS = {"train": 512, "heldout": 64}
ROUTER_SPARSITY = 0.002


def train_video(experiment: ExperimentConfig) -> dict[str, float]:
    return run_job(experiment, _train)


def _train(job: Job) -> dict[str, float]:
    experiment, rank = job.experiment, job.rank
    (name,) = experiment.modules
    mesh = job.meshes[name]
    module, config, cfg = experiment.modules[name], experiment.model_config(name), experiment.train
    memory = config.memory
    if rank == 0:
        ensure_video_shards(cfg.data_dir, CLIPS["train"], CLIPS["heldout"], ClipOptions(size=config.frame_size),
                            seed=experiment.seed)
    dist.barrier()
    batch_size = experiment.batch.global_batch_size
    train = VideoClips(cfg.data_dir, "train", batch_size, experiment.seed)
    heldout = VideoClips(cfg.data_dir, "heldout", CLIPS["heldout"], experiment.seed).batch(0)
    if cfg.eval_batches:  # the first eval_batches global batches of the held-out clips
        heldout = {key: value[: cfg.eval_batches * batch_size] for key, value in heldout.items()}

    torch.manual_seed(experiment.seed)
    model = parallelize_video(VideoGenerator(config), mesh, module.parallel)
    router = ImportanceRouter(config.hidden_size) if memory.policy == "learned" else None
    params = list(model.named_parameters()) + ([(f"router.{n}", p) for n, p in router.named_parameters()]
                                               if router else [])
    optimizer = build_adamw(torch.nn.ModuleList([model] + ([router] if router else [])), module.optim)
    sync = AllReduceGradSync(params, mesh.group("dp")) if mesh.layout.dp > 1 else None
    state = SingleModule(name, torch.nn.ModuleList([model] + ([router] if router else [])), optimizer)
    start = job.resume(state)
    started, errors, metrics = time.perf_counter(), {}, {"loss": math.nan}
    for step in range(start + 1, cfg.steps + 1):
        tick = time.perf_counter()
        with job.guard.step(f"step {step}"):
            rows = dp_slice(train.batch(step - 1), mesh.coord.dp, mesh.layout.dp)
            frames = to_model(rows["frames"])
            share = frames.shape[0] / batch_size  # the DP sum of the ranks' losses is the batch mean
            generator = torch.Generator().manual_seed(experiment.seed * 1_000_003 + step * 1009 + mesh.coord.dp)
            loss = flow_matching_loss(model, frames, memory, generator)
            total = loss
            if router is not None:  # the generator with the full context is the teacher of its soft-memory self
                distill, penalty = distillation_loss(model, model, frames, memory, router, generator)
                total = total + distill + ROUTER_SPARSITY * penalty
            for group in optimizer.param_groups:
                group["lr"] = module.optim.lr_at(step - 1)
            optimizer.zero_grad()
            (total * share).backward()
            grad_norm = job.apply_gradients(step, name, optimizer, [p for _, p in params], sync)
        state.step = step
        seconds = time.perf_counter() - tick
        if step % cfg.log_every == 0 or step == cfg.steps:
            reduced = torch.tensor([loss.item() * share])
            dist.all_reduce(reduced, group=mesh.group("dp"))
            metrics = {"loss": reduced.item(), "grad_norm": float(grad_norm), "step_s": seconds,
                       "tokens_per_s": batch_size * frames.shape[1] * config.patches_per_frame / seconds}
            job.log.progress(step, metrics, {f"grad_sync.{name}": sync.bytes_sent if sync else 0})
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
            with job.guard.step(f"evaluation at step {step}"):
                errors = evaluate(model, router, heldout, memory)
            if rank == 0:
                print(f"step {step:5d} | held-out next-frame MSE: revisited {errors['revisit_mse']:.5f}, "
                      f"all {errors['all_mse']:.5f} | {time.perf_counter() - started:.0f} s", flush=True)
        if job.checkpoints.due(step, cfg.steps):
            job.checkpoints.save(state, step)
    job.checkpoints.close()
    return {"steps": float(cfg.steps), "final_loss": metrics["loss"], **errors, "seconds": time.perf_counter() - started}


def evaluate(model, router, heldout: dict[str, torch.Tensor], memory) -> dict[str, float]:
    """Held-out next-frame MSE (pixels in [0, 1]) on revisited and on all frames, each frame denoised
    from half noise given the true earlier frames the memory keeps."""
    with torch.no_grad():
        errors = next_frame_errors(model, to_model(heldout["frames"]), memory, router,
                                   torch.Generator().manual_seed(0), start=0.5) / 4
    revisit = heldout["revisit"][:, 1:]
    return {"revisit_mse": errors[revisit].mean().item(), "all_mse": errors.mean().item()}
