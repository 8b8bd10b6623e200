"""The two training tasks of ``bench compression``, each runnable by hetero's runtime or by a peer.

- ``text``: a small byte-level GPT on Python's standard-library sources (global batch 16, seq 64); the
  score is the mean held-out token loss (nats) at the end.
- ``vlm``: the digits vision-language model of ``colocated_vlm``, both modules at dp=world on the same
  ranks (global batch 16, one microbatch per rank); the score is the held-out loss, with the accuracy of
  the caption's digit token beside it.

A rank function returns ``{"loss", "accuracy", "bytes", "residual", "params"}``: the held-out score, the
bytes this rank put on the wire for data-parallel sync over the run, (hetero only) the error-feedback
residual norm every ``log_every`` steps, and the parameters the sync covers; hetero's text task also
``step_s``, this rank's mean wall time per step after the first ``WARMUP_STEPS``. hetero runs through the
runtime with the method's ``compression`` block (and ``link`` under it); the peers train the same model
from the same seed on the same rows in a plain loop under DDP with torch's PowerSGD hook, or under
torchft's DiLoCo.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from hetero.bench.ddp_powersgd_peer import AllReduceCounter, ddp_with_powersgd
from hetero.config import OptimizerConfig, load_experiment
from hetero.data.digits import DigitBatches, ensure_digit_shards
from hetero.parallel.sharding import dp_rows
from hetero.data.text import VOCAB_SIZE, heldout_batches, load_stdlib_corpus, sample_batch
from hetero.models import default_registry
from hetero.models.gpt.model import GPT, token_loss_sum
from hetero.models.gpt.config import GPTConfig
from hetero.testing.references import VisionLanguageModel
from hetero.parallel.compression.config import CompressionConfig
from hetero.parallel.compression.link import LinkConfig
from hetero.runtime import build_runtime
from hetero.testing.experiments import experiment, module

WARMUP_STEPS = 8  # not timed (allocations, first collectives)
TEXT_MODEL = GPTConfig(vocab_size=VOCAB_SIZE, hidden_size=64, num_layers=2, num_heads=4, seq_len=64)
GLOBAL_BATCH = 16
HELDOUT_BATCHES = 8


@dataclass(frozen=True)
class Method:
    name: str
    engine: str = "hetero"  # hetero | ddp_powersgd | torchft_diloco
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    rank: int = 0  # ddp_powersgd: approximation rank
    inner_steps: int = 0  # torchft_diloco: H
    link: LinkConfig = field(default_factory=LinkConfig)  # hetero: a simulated link under the DP sync


def text_optim(steps: int) -> OptimizerConfig:
    return OptimizerConfig(lr=2e-3, warmup_steps=20, decay_steps=steps, weight_decay=0.1)


def run_text(rank: int, world_size: int, method: Method, seed: int, steps: int, log_every: int) -> dict:
    corpus = load_stdlib_corpus()
    optim = text_optim(steps)
    heldout = heldout_batches(corpus.heldout, GLOBAL_BATCH, TEXT_MODEL.seq_len, HELDOUT_BATCHES)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return sample_batch(corpus.train, GLOBAL_BATCH, TEXT_MODEL.seq_len, step, seed)

    if method.engine == "hetero":
        blocks = {"llm": module("gpt", TEXT_MODEL, {"dp": world_size}, optim, {"simulated_link": method.link},
                                compression=method.compression)}
        runtime = build_runtime(experiment(world_size, blocks, global_batch=GLOBAL_BATCH, microbatches=1, seed=seed),
                                default_registry())
        sync = runtime.modules["llm"].replica_sync
        residual, started = [], 0.0
        for step in range(steps):
            if step == WARMUP_STEPS:
                started = time.perf_counter()
            tokens, labels = batch(step)
            runtime.train_step({"tokens": tokens, "labels": labels})
            if (step + 1) % log_every == 0:
                residual.append((step + 1, sync.residual_norm()))
        step_s = (time.perf_counter() - started) / (steps - WARMUP_STEPS)
        loss = runtime.evaluate({"tokens": x, "labels": y} for x, y in heldout)["llm.loss"]
        return {"loss": loss, "accuracy": None, "bytes": sync.bytes_sent, "residual": residual,
                "params": _params(runtime.modules["llm"].model), "step_s": step_s}

    torch.manual_seed(seed)
    model = GPT(TEXT_MODEL)
    rows = dp_rows(GLOBAL_BATCH, rank, world_size)

    def local_loss(net: nn.Module, step: int) -> torch.Tensor:
        tokens, labels = batch(step)
        return token_loss_sum(net(tokens[rows]), labels[rows]) / labels[rows].numel()

    sent = _run_peer(method, model, local_loss, [(optim, list(model.parameters()))], steps, seed, 0.0)
    with torch.no_grad():
        loss = sum(float(token_loss_sum(model(x), y) / y.numel()) for x, y in heldout) / len(heldout)
    return {"loss": loss, "accuracy": None, "bytes": sent, "residual": [], "params": _params(model)}


def vlm_experiment(world_size: int, method: Method, steps: int):
    overrides = [
        f"world_size={world_size}", f"vision.layout.dp={world_size}", "llm.layout.tp=1",
        f"llm.layout.dp={world_size}", f"vision.micro_batch_size={GLOBAL_BATCH // world_size}",
        f"batch.micro_batch_size={GLOBAL_BATCH // world_size}", f"batch.global_batch_size={GLOBAL_BATCH}",
        f"vision.optim.decay_steps={steps}", f"llm.optim.decay_steps={steps}",
    ]
    config = load_experiment("colocated_vlm", overrides)
    for block in config.modules.values():
        block.compression = method.compression
    return config


def run_vlm(rank: int, world_size: int, method: Method, seed: int, steps: int, log_every: int) -> dict:
    config = replace(vlm_experiment(world_size, method, steps), seed=seed)
    kinds = default_registry()
    vision, llm = config.model_config("vision", kinds), config.model_config("llm", kinds)
    data_dir = config.train.data_dir
    train = DigitBatches(data_dir, "train", GLOBAL_BATCH, vision.num_patches, llm.seq_len, seed)
    heldout = DigitBatches(data_dir, "heldout", GLOBAL_BATCH, vision.num_patches, llm.seq_len, seed).ordered_batches()
    clip = config.train.grad_clip

    if method.engine == "hetero":
        runtime = build_runtime(config, default_registry())
        residual = []
        for step in range(steps):
            runtime.train_step(train.batch(step))
            if (step + 1) % log_every == 0:
                norms = [m.replica_sync.residual_norm() for m in runtime.modules.values()]
                residual.append((step + 1, sum(n * n for n in norms) ** 0.5))
        scores = runtime.evaluate(heldout)
        sent = sum(m.replica_sync.bytes_sent for m in runtime.modules.values())
        return {"loss": scores["llm.loss"], "accuracy": scores["llm.digit_accuracy"], "bytes": sent, "residual": residual,
                "params": sum(_params(m.model) for m in runtime.modules.values())}

    model = VisionLanguageModel(vision, llm, seed)
    rows = dp_rows(GLOBAL_BATCH, rank, world_size)

    def local_loss(net: nn.Module, step: int) -> torch.Tensor:
        b = train.batch(step)
        labels = b["labels"]
        # The trainers normalize by the global supervised-token count; DDP averages, so scale by world.
        supervised = int((labels != -100).sum())
        return token_loss_sum(net(b["images"][rows], b["tokens"][rows]), labels[rows]) * world_size / supervised

    groups = [(config.modules["vision"].optim, list(model.vision.parameters())),
              (config.modules["llm"].optim, list(model.llm.parameters()))]
    sent = _run_peer(method, model, local_loss, groups, steps, seed, clip)
    with torch.no_grad():
        losses, accuracies = [], []
        for b in heldout:
            logits = model(b["images"], b["tokens"])
            losses.append(float(token_loss_sum(logits, b["labels"]) / (b["labels"] != -100).sum()))
            picked = logits[torch.arange(len(logits)), b["digit_position"]].argmax(-1)
            truth = b["labels"][torch.arange(len(logits)), b["digit_position"]]
            accuracies.append(float((picked == truth).float().mean()))
    return {"loss": _mean(losses), "accuracy": _mean(accuracies), "bytes": sent, "residual": [], "params": _params(model)}


def _params(model: nn.Module) -> int:
    """The parameters a replica's sync covers (every DP replica holds them all here)."""
    return sum(p.numel() for p in model.parameters())


def ensure_data() -> None:
    ensure_digit_shards(load_experiment("colocated_vlm").train.data_dir)


def _run_peer(method, model, local_loss, groups, steps, seed, clip) -> int:
    """Train ``model`` in place with a peer's data-parallel method; return the bytes it sent."""
    optimizer = torch.optim.AdamW(
        [{"params": params, "lr": c.lr, "betas": (c.beta1, c.beta2), "weight_decay": c.weight_decay, "eps": c.eps}
         for c, params in groups]
    )

    def set_lr(step: int) -> None:
        for group, (config, _) in zip(optimizer.param_groups, groups):
            group["lr"] = config.lr_at(step)

    if method.engine == "ddp_powersgd":
        ddp = ddp_with_powersgd(model, method.rank, seed)
        counter = AllReduceCounter()
        with counter.counting():
            for step in range(steps):
                optimizer.zero_grad(set_to_none=True)
                local_loss(ddp, step).backward()
                if clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                set_lr(step)
                optimizer.step()
        return counter.bytes_sent
    if method.engine == "torchft_diloco":
        from hetero.bench.torchft_peer import run_torchft_diloco  # pulls in torchft only where it runs

        return run_torchft_diloco(model, optimizer, local_loss, set_lr, steps, method.inner_steps, clip).bytes_sent
    raise ValueError(f"unknown engine {method.engine!r}")


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)

