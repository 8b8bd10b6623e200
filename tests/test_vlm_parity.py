"""The vision-language trainer matches one process running the whole model: 5 AdamW steps, fp32.

Per step the loss and the world-wide gradient norm before clipping within 1e-5 relative; at the first step
every copy of every vision, projector and LLM gradient (each DP and TP replica's) equal to the others and
within 1e-5 relative (in norm) of the reference's, for colocated, non-colocated, LLM-pipelined and
DP-mismatched placements, with FSDP2, activation checkpointing, GPipe and small gradient buckets among
them. The runtime runs the graph (vision -> llm) phased where the modules share ranks and as one 1F1B pipeline
over the graph where they do not. The reference is a plain loop over ``VisionLanguageModel`` with one
global gradient-norm clip.
"""

import functools

import pytest
import torch

from hetero.models.gpt.config import GPTConfig
from hetero.config import OptimizerConfig
from hetero.models.gpt.model import token_loss_sum
from hetero.models.vit.config import ViTConfig
from hetero.parallel.options import ParallelOptions
from hetero.testing.kinds import build_runtime
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks
from hetero.testing.parity import check_bf16_parity, Record, check_parity, record_reference, record_run
from hetero.testing.references import IMAGE_TOKEN, VisionLanguageModel

from edge_traffic import check_edge_bytes

VISION = ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_layers=2, num_heads=4, out_size=32)
LLM = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                seq_len=24)
STEPS = 5  # past the LLM's 3 warmup steps: steps 4-5 train on weights its full learning rate updated
BATCHES = 20  # batches() makes this many; other tests (compressed edges, MoE, ...) take their own counts
CLIP = 0.5
OPTIM = {"vision": OptimizerConfig(lr=3e-3), "llm": OptimizerConfig(lr=1e-2, warmup_steps=3)}


def batches(global_batch):
    gen = torch.Generator().manual_seed(7)
    out = []
    patches = VISION.num_patches
    for _ in range(BATCHES):
        images = torch.rand(global_batch, 1, 16, 16, generator=gen)
        text = torch.randint(1, LLM.vocab_size, (global_batch, LLM.seq_len - patches + 1), generator=gen)
        tokens = torch.cat([torch.full((global_batch, patches), IMAGE_TOKEN), text[:, :-1]], dim=1)
        labels = torch.cat([torch.full((global_batch, patches - 1), -100), text], dim=1)
        out.append({"images": images, "tokens": tokens, "labels": labels})
    return out


def reference(global_batch, model=None, data=None, before_step=None, precision="fp32", steps=STEPS) -> Record:
    """Losses and pre-clip gradient norms of every step and the (clipped) gradients of the first;
    ``model``, ``data`` and a hook called with the step number before each step let other tests run
    variants (by default the plain VLM and batches)."""
    model = model or VisionLanguageModel(VISION, LLM, seed=0)

    def loss(batch, step):
        supervised = int((batch["labels"] != -100).sum())
        return [token_loss_sum(model(batch["images"], batch["tokens"]), batch["labels"]) / supervised]

    modules = {"vision": model.vision, "llm": model.llm}
    data = data if data is not None else batches(global_batch)[:steps]
    return record_reference(modules, OPTIM, data, loss, CLIP, before_step, precision)


def vlm_experiment(world_size, layouts, global_batch, microbatches, options=None, schedule="auto"):
    options = options or {}
    modules = {name: module(kind, config, layouts[name], OPTIM[name], options.get(name))
               for name, kind, config in (("vision", "vit", VISION), ("llm", "gpt", LLM))}
    return experiment(world_size, modules, edges=[("vision", "llm")], global_batch=global_batch,
                      microbatches=microbatches, grad_clip=CLIP, schedule=schedule)


def train(rank, world_size, layouts, global_batch, microbatches, options=None, steps=STEPS, schedule="auto"):
    runtime = build_runtime(vlm_experiment(world_size, layouts, global_batch, microbatches, options, schedule))
    vision, llm = (runtime.graph.nodes[name].layout for name in ("vision", "llm"))
    shared = set(vision.ranks) == set(llm.ranks)
    assert runtime.graph.schedule == ("phased" if shared else "graph_1f1b") if schedule == "auto" else schedule
    return record_run(runtime, batches(global_batch)[:steps])


# A bucket far smaller than one weight matrix (32x32 fp32 = 4 KB): every parameter gets a bucket of its own.
SMALL_BUCKETS = ParallelOptions(grad_bucket_mb=2 / 1024)

CASES = {
    "colocated vision tp1·dp4 (fsdp), llm tp2·dp2": (
        {"vision": {"dp": 4}, "llm": {"tp": 2, "dp": 2}}, 4, 8, 2, {"vision": ParallelOptions(fsdp=True)}),
    "non-colocated vision dp2 (0-1), llm tp2·dp2 (2-5, activation checkpointing)": (
        {"vision": {"dp": 2}, "llm": {"tp": 2, "dp": 2, "offset": 2}}, 6, 8, 2,
        {"llm": ParallelOptions(activation_checkpointing=True)}),
    "mixed vision dp2 (0-1), llm pp2·dp2 (0-3)": ({"vision": {"dp": 2}, "llm": {"pp": 2, "dp": 2}}, 4, 8, 4, {}),
    "non-colocated graph pipeline vision dp2 (0-1), llm pp2 (2-3, gpipe)": (
        {"vision": {"dp": 2}, "llm": {"pp": 2, "offset": 2}}, 4, 8, 4,
        {"llm": ParallelOptions(pipeline_schedule="gpipe")}),
    "colocated vision dp2, llm tp2·cp2": ({"vision": {"dp": 2}, "llm": {"tp": 2, "cp": 2}}, 4, 8, 2, {}),
    "colocated vision dp4, llm tp2·cp2 with sequence parallelism": (
        {"vision": {"dp": 4}, "llm": {"tp": 2, "cp": 2}}, 4, 8, 2, {"llm": ParallelOptions(sequence_parallel=True)}),
    "non-colocated vision (0), llm cp2 (1-2)": ({"vision": {"dp": 1}, "llm": {"cp": 2, "offset": 1}}, 3, 8, 2, {}),
    "colocated vision dp2, llm pp2 (0-1), one 1F1B over the graph (vision in the pipeline's bubbles)": (
        {"vision": {"dp": 2}, "llm": {"pp": 2}}, 2, 8, 4, {}, "graph_1f1b"),
    "non-colocated vision dp3 (0-2), llm dp2 (3-4), small gradient buckets": (
        {"vision": {"dp": 3}, "llm": {"dp": 2, "offset": 3}}, 5, 12, 2, {"vision": SMALL_BUCKETS, "llm": SMALL_BUCKETS}),
}


@functools.cache
def expected_of(global_batch):
    return reference(global_batch)


@pytest.mark.parametrize("case", list(CASES))
def test_vlm_parity(case):
    layouts, world_size, global_batch, microbatches, options, *schedule = CASES[case]
    expected = expected_of(global_batch)
    results = run_ranks(train, world_size, layouts, global_batch, microbatches, options, STEPS, *schedule,
                        timeout_s=300)
    print("\n" + check_parity(results, expected, f"vlm parity {case}"))
    config = vlm_experiment(world_size, layouts, global_batch, microbatches, options, *schedule)
    print("  edge bytes: " + check_edge_bytes(results, config, batches(global_batch)[0], microbatches))


BF16_CASES = {
    "colocated vision dp2, llm tp2": ({"vision": {"dp": 2}, "llm": {"tp": 2}}, {}),
    "colocated vision dp2, llm dp2, both fsdp": ({"vision": {"dp": 2}, "llm": {"dp": 2}}, {"fsdp": True}),
}


@pytest.mark.parametrize("case", list(BF16_CASES))
def test_bf16_parity_in_both_modules(case):
    """bf16 compute (autocast) with fp32 master weights in the vision encoder and the LLM on 2 ranks, 3
    steps, against one process under the same autocast (``check_bf16_parity``)."""
    layouts, extra = BF16_CASES[case]
    bf16 = ParallelOptions(precision="bf16", **extra)
    results = run_ranks(train, 2, layouts, 8, 2, {"vision": bf16, "llm": bf16}, 3, timeout_s=300)
    summary = check_bf16_parity(results, reference(8, precision="bf16", steps=3), reference(8, steps=3),
                                f"vlm bf16 {case}")
    print("\n" + summary)