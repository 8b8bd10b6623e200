"""The four-module graph (vision and DNA encoders -> LLM -> video generator conditioned on the LLM's hidden
states), each module under its own layout on 8 ranks, matches one process running the whole graph
(``FullGraphModel``): 5 AdamW steps, fp32, samples with optional image, DNA and clip (so each module's
row count varies per microbatch). Per step the combined loss, each module's loss and the gradient norm
before the one global clip within 1e-5 relative; every copy of every gradient of the four modules equal to
the others and within 1e-5 relative at the first step (``hetero.testing.parity``)."""

import functools

import pytest
import torch

from hetero.testing.full_graph import SEED_OFFSETS, FullGraphModel, GraphConfigs, combined_loss
from hetero.models.genezip.config import GeneZipConfig
from hetero.models.gpt.config import GPTConfig
from hetero.testing.references import IMAGE_TOKEN
from hetero.models.video.config import VideoConfig
from hetero.models.video.memory import MemoryConfig
from hetero.models.vit.config import ViTConfig
from hetero.config import OptimizerConfig
from hetero.parallel.options import ParallelOptions
from hetero.testing.kinds import build_runtime
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks
from hetero.testing.parity import check_parity, record_reference, record_run

from edge_traffic import check_edge_bytes

VISION = ViTConfig(image_size=16, patch_size=8, hidden_size=32, num_layers=1, num_heads=4, out_size=32)
# One ratio target (H-Net): the DNA here is random, with random region labels, which leave the region
# budget's classifier calling bases at its threshold, where float noise flips calls between layouts. The
# budget's parity is tested on real annotated DNA (test_genezip_parity, test_dna_vlm_parity).
DNA = GeneZipConfig(seq_len=64, hidden_size=32, num_heads=4, main_layers=1, local_window=8, routing_window=16,
                    min_boundaries=1, max_boundaries=4, out_size=32)
PLACEHOLDERS = VISION.num_patches + DNA.max_tokens()
LLM = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64,
                seq_len=PLACEHOLDERS + 8)
VIDEO = VideoConfig(frame_size=8, patch_size=4, hidden_size=32, num_layers=1, num_heads=4,
                    memory=MemoryConfig(policy="sliding", budget=3), condition_size=LLM.hidden_size)
CONFIGS = GraphConfigs(vision=VISION, dna=DNA, llm=LLM, video=VIDEO)
FRAMES = 5
STEPS = 5  # past the LLM's 3 warmup steps: steps 4-5 train on weights its full learning rate updated
CLIP = 0.5
SEED = 3
WEIGHTS = {"text": 1.0, "dna": 0.5, "video": 2.0}
OPTIM = {"vision": OptimizerConfig(lr=3e-3), "dna": OptimizerConfig(lr=3e-3),
         "llm": OptimizerConfig(lr=1e-2, warmup_steps=3), "video": OptimizerConfig(lr=3e-3)}


def batches(global_batch, steps=STEPS):
    """Random multimodal batches; each sample has an image with p=0.75, DNA with 0.5, a clip with 0.5."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for step in range(steps):
        text = torch.randint(1, LLM.vocab_size, (global_batch, LLM.seq_len - PLACEHOLDERS + 1), generator=gen)
        present = torch.rand(global_batch, 3, generator=gen) < torch.tensor([0.75, 0.5, 0.5])
        labels = torch.cat([torch.full((global_batch, PLACEHOLDERS - 1), -100), text], dim=1)
        out.append({
            "images": torch.rand(global_batch, 1, 16, 16, generator=gen),
            "dna": torch.randint(0, 4, (global_batch, DNA.seq_len), generator=gen),
            "dna_regions": torch.randint(0, 2, (global_batch, DNA.seq_len), generator=gen),
            "clips": torch.rand(global_batch, FRAMES, 1, 8, 8, generator=gen),
            "has_image": present[:, 0], "has_dna": present[:, 1], "has_clip": present[:, 2],
            "tokens": torch.cat([torch.full((global_batch, PLACEHOLDERS), IMAGE_TOKEN), text[:, :-1]], dim=1),
            "labels": labels,
            "index": torch.arange(global_batch) + step * global_batch,
        })
    return out


def reference(data):
    model = FullGraphModel(CONFIGS, seed=SEED)

    def losses(batch, step):
        parts = model.losses(batch, SEED, step)
        return [combined_loss(parts, WEIGHTS)] + [parts[k] for k in ("text", "dna", "video")]

    return record_reference({name: getattr(model, name) for name in OPTIM}, OPTIM, data, losses, CLIP)


KINDS = {"vision": ("vit", VISION), "llm": ("gpt", LLM), "dna": ("genezip", DNA), "video": ("video", VIDEO)}
EDGES = [("vision", "llm"), ("dna", "llm"), ("llm", "video")]
WEIGHT_OF = {"vision": None, "llm": "text", "dna": "dna", "video": "video"}


def graph_experiment(world_size, layouts, global_batch, microbatches, options, schedule="auto"):
    # Declared in SEED_OFFSETS' order: each module's weights come from seed + its index, as in the reference.
    modules = {}
    for name in SEED_OFFSETS:
        kind, config = KINDS[name]
        weight = {"loss_weight": WEIGHTS[WEIGHT_OF[name]]} if WEIGHT_OF[name] else {}
        modules[name] = module(kind, config, layouts[name], OPTIM[name], options.get(name), **weight)
    return experiment(world_size, modules, edges=EDGES, global_batch=global_batch, microbatches=microbatches,
                      grad_clip=CLIP, seed=SEED, schedule=schedule)


def train(rank, world_size, layouts, global_batch, microbatches, data, options, schedule="auto"):
    config = graph_experiment(world_size, layouts, global_batch, microbatches, options, schedule)
    return record_run(build_runtime(config), data, ("loss", "llm.loss", "dna.loss", "video.loss"))


MIXED = {"vision": {"dp": 2}, "dna": {"dp": 2}, "llm": {"tp": 2, "pp": 2, "dp": 1, "offset": 2},
         "video": {"dp": 2, "offset": 6}}
CASES = {
    "mixed: vision dp2 + dna dp2 (ranks 0-1), llm tp2·pp2 with sequence parallelism (2-5), video dp2 (6-7)": (
        MIXED, 8, 8, 4, {"llm": ParallelOptions(sequence_parallel=True)}),
    "mixed as above, one 1F1B over the graph": (
        MIXED, 8, 8, 4, {"llm": ParallelOptions(sequence_parallel=True)}, "graph_1f1b"),
    "colocated: vision dp8 (fsdp), dna tp2·dp4 (checkpointing), llm tp2·pp2·dp2, video dp8": (
        {"vision": {"dp": 8}, "dna": {"tp": 2, "dp": 4}, "llm": {"tp": 2, "pp": 2, "dp": 2},
         "video": {"dp": 8}}, 8, 16, 2,
        {"vision": ParallelOptions(fsdp=True), "dna": ParallelOptions(activation_checkpointing=True)}),
    "colocated as above, one 1F1B over the graph (encoders in the LLM's bubbles)": (
        {"vision": {"dp": 8}, "dna": {"tp": 2, "dp": 4}, "llm": {"tp": 2, "pp": 2, "dp": 2},
         "video": {"dp": 8}}, 8, 16, 2,
        {"vision": ParallelOptions(fsdp=True), "dna": ParallelOptions(activation_checkpointing=True)}, "graph_1f1b"),
    "mixed, long context: vision dp2 + dna dp2 (ranks 0-1), llm cp2·pp2 (2-5), video dp2 (6-7)": (
        {"vision": {"dp": 2}, "dna": {"dp": 2}, "llm": {"cp": 2, "pp": 2, "dp": 1, "offset": 2},
         "video": {"dp": 2, "offset": 6}}, 8, 8, 4, {}),
}


@functools.cache
def expected(global_batch):
    return reference(batches(global_batch))


@pytest.mark.parametrize("case", list(CASES))
def test_graph_parity(case):
    layouts, world_size, global_batch, microbatches, options, *schedule = CASES[case]
    results = run_ranks(train, world_size, layouts, global_batch, microbatches, batches(global_batch), options,
                        *schedule, timeout_s=400)
    print("\n" + check_parity(results, expected(global_batch), f"graph parity {case}"))
    config = graph_experiment(world_size, layouts, global_batch, microbatches, options, *schedule)
    print("  edge bytes: " + check_edge_bytes(results, config, batches(global_batch)[0], microbatches))
