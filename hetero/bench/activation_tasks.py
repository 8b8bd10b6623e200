"""The two tasks of ``bench activation-compression``, run by hetero's runtime on 2 ranks.

- ``llm_pp2``: the byte-level GPT of ``bench compression`` (h64, 2 layers, seq 64) split into two pipeline
  stages on ranks 0 and 1 (1F1B, 4 microbatches of 4), trained on a finite set of fixed windows of
  Python's standard-library sources (``WindowSet``: sample ids for the per-sample cache). Compressed edge:
  the stage edge. Score: held-out token loss (nats).
- ``vlm``: the digits vision-language model with the encoder on rank 0 and the LLM on rank 1 (non-colocated:
  one pipeline over the module graph, 2 microbatches of 8). Compressed edge: the vision->llm boundary.
  Score: held-out loss, with the caption digit's accuracy beside it.

A method is an ``EdgeCompressionConfig`` (None: uncompressed) and a sampling reuse. A rank function
trains every method of one seed in turn (starting ranks costs seconds) and returns, per method, the
held-out score, the bytes every rank sent on the compressed edge during training (both directions), and
the largest error-compensation memory on a rank at the end. Evaluation sends fp32 (it measures weights).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from hetero.bench.compression_tasks import GLOBAL_BATCH, HELDOUT_BATCHES, TEXT_MODEL, text_optim
from hetero.config import load_experiment
from hetero.data.digits import DigitBatches
from hetero.data.text import WindowSet, heldout_batches, load_stdlib_corpus
from hetero.models import default_registry
from hetero.parallel.compression.config import CompressionConfig
from hetero.parallel.compression.edge_config import EdgeCompressionConfig
from hetero.runtime import build_runtime
from hetero.testing.experiments import experiment, module

LM_MICRO_BATCH = 4
VLM_MICROBATCHES = 2


@dataclass(frozen=True)
class Method:
    name: str
    edge: EdgeCompressionConfig | None = None  # None: the uncompressed path
    reuse: int = 1  # each batch serves this many consecutive steps


def run_llm_pp2(rank: int, world_size: int, methods: list[Method], seed: int, steps: int,
                train_samples: int = 1024) -> dict[str, dict]:
    corpus = load_stdlib_corpus()
    train = WindowSet(corpus.train, train_samples, TEXT_MODEL.seq_len, seed)
    heldout = heldout_batches(corpus.heldout, GLOBAL_BATCH, TEXT_MODEL.seq_len, HELDOUT_BATCHES)
    out = {}
    for method in methods:
        compression = CompressionConfig(pipeline=method.edge) if method.edge is not None else CompressionConfig()
        blocks = {"llm": module("gpt", TEXT_MODEL, {"pp": world_size}, text_optim(steps), compression=compression)}
        runtime = build_runtime(experiment(world_size, blocks, global_batch=GLOBAL_BATCH,
                                           microbatches=GLOBAL_BATCH // LM_MICRO_BATCH, seed=seed,
                                           train={"sample_reuse": method.reuse}), default_registry())
        for step in range(steps):
            tokens, labels, ids = train.batch(step // method.reuse, GLOBAL_BATCH)
            runtime.train_step({"tokens": tokens, "labels": labels, "index": ids})
        links = runtime.links["llm"]
        sent = sum(links.sent_bytes.values())
        memory = sum(end.memory_bytes() for end in links.ends.values())
        loss = runtime.evaluate({"tokens": x, "labels": y} for x, y in heldout)["llm.loss"]
        out[method.name] = {"loss": loss, "accuracy": None} | _world(sent, memory)
    return out


def vlm_experiment(steps: int):
    overrides = [
        "world_size=2", "placement=non_colocated", "vision.layout.dp=1", "llm.layout.tp=1", "llm.layout.dp=1",
        "llm.layout.offset=1", f"batch.global_batch_size={GLOBAL_BATCH}",
        f"batch.micro_batch_size={GLOBAL_BATCH // VLM_MICROBATCHES}",
        f"vision.optim.decay_steps={steps}", f"llm.optim.decay_steps={steps}",
    ]
    return load_experiment("non_colocated_vlm", overrides)


def run_vlm(rank: int, world_size: int, methods: list[Method], seed: int, steps: int) -> dict[str, dict]:
    base = vlm_experiment(steps)
    kinds = default_registry()
    vision, llm = base.model_config("vision", kinds), base.model_config("llm", kinds)
    data_dir = base.train.data_dir
    train = DigitBatches(data_dir, "train", GLOBAL_BATCH, vision.num_patches, llm.seq_len, seed)
    heldout = DigitBatches(data_dir, "heldout", GLOBAL_BATCH, vision.num_patches, llm.seq_len, seed).ordered_batches()
    heldout = [b for b in heldout if len(b["images"]) == GLOBAL_BATCH]
    out = {}
    for method in methods:
        edge = replace(base.edges[0], compression=method.edge or EdgeCompressionConfig())
        config = replace(base, seed=seed, edges=[edge], train=replace(base.train, sample_reuse=method.reuse))
        runtime = build_runtime(config, default_registry())
        for step in range(steps):
            runtime.train_step(train.batch(step // method.reuse))
        boundary = runtime.edges["vision->llm"]
        sent, memory = sum(boundary.sent_bytes().values()), boundary.memory_bytes()
        scores = runtime.evaluate(heldout)
        out[method.name] = {"loss": scores["llm.loss"], "accuracy": scores["llm.digit_accuracy"]} | _world(sent, memory)
    return out


def _world(sent: int, memory: int) -> dict:
    """Bytes summed over the ranks, compensation memory of the rank holding the most."""
    totals = torch.tensor([float(sent)], dtype=torch.float64)
    dist.all_reduce(totals)
    largest = torch.tensor([float(memory)], dtype=torch.float64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return {"bytes": float(totals), "memory": float(largest)}


TASKS = {"llm_pp2": run_llm_pp2, "vlm": run_vlm}
