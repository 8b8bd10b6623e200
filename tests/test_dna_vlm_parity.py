"""Vision and GeneZip DNA encoders feeding one LLM, each under its own layout, match one process running
the whole model: 5 AdamW steps, fp32. Per step the LLM's loss and GeneZip's own loss (next-base plus
Region-Aware Ratio) within 1e-5 relative, the gradient norm before the one global clip too, and every copy
of every gradient of the three modules equal to the others and within 1e-5 relative at the first step
(``hetero.testing.parity``)."""

import functools

import pytest
import torch

from hetero.data.genome import annotated_genome
from hetero.models.genezip.config import GeneZipConfig
from hetero.models.genezip.objectives import genezip_loss
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.model import token_loss_sum
from hetero.testing.references import IMAGE_TOKEN, RegionBudgetSteps, VisionDnaLanguageModel
from hetero.models.vit.config import ViTConfig
from hetero.config import OptimizerConfig
from hetero.testing.kinds import build_runtime
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks
from hetero.testing.parity import check_parity, record_reference, record_run

from edge_traffic import check_edge_bytes

VISION = ViTConfig(image_size=16, patch_size=8, hidden_size=32, num_layers=1, num_heads=4, out_size=32)
DNA = GeneZipConfig(seq_len=64, hidden_size=32, num_heads=4, main_layers=1, local_window=8, routing_window=16,
                    min_boundaries=1, max_boundaries=4, region_bpt={"coding": 3.0, "intergenic": 6.0}, out_size=32)
PLACEHOLDERS = VISION.num_patches + DNA.max_tokens()
LLM = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64,
                seq_len=PLACEHOLDERS + 8)
STEPS = 5  # past the LLM's 3 warmup steps; GeneZip's region budget moves after every step
CLIP = 0.5
OPTIM = {"vision": OptimizerConfig(lr=3e-3), "dna": OptimizerConfig(lr=3e-3),
         "llm": OptimizerConfig(lr=1e-2, warmup_steps=3)}


@functools.cache
def batches(global_batch):
    bases, regions, _ = annotated_genome()
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        starts = torch.randint(0, 2_000_000, (global_batch,), generator=gen).tolist()
        text = torch.randint(1, LLM.vocab_size, (global_batch, LLM.seq_len - PLACEHOLDERS + 1), generator=gen)
        out.append({
            "images": torch.rand(global_batch, 1, 16, 16, generator=gen),
            "dna": torch.stack([torch.tensor(bases[s : s + DNA.seq_len], dtype=torch.long) for s in starts]),
            "dna_regions": torch.stack([torch.tensor(regions[s : s + DNA.seq_len], dtype=torch.long) for s in starts]),
            "tokens": torch.cat([torch.full((global_batch, PLACEHOLDERS), IMAGE_TOKEN), text[:, :-1]], dim=1),
            "labels": torch.cat([torch.full((global_batch, PLACEHOLDERS - 1), -100), text], dim=1),
        })
    return out


@functools.cache
def expected():
    return reference(batches(8))


def reference(data):
    model = VisionDnaLanguageModel(VISION, DNA, LLM, seed=0)
    budget_steps = RegionBudgetSteps(model.dna, OPTIM["dna"])

    def losses(batch, step):
        supervised = int((batch["labels"] != -100).sum())
        logits, dna = model(batch["images"], batch["dna"], batch["tokens"])
        text_loss = token_loss_sum(logits, batch["labels"]) / supervised
        dna_loss = genezip_loss(DNA, dna, batch["dna"], batch["dna_regions"]).total(DNA).mean()
        budget_steps.record(dna, batch["dna_regions"])
        return [text_loss + dna_loss, text_loss, dna_loss]

    return record_reference({name: getattr(model, name) for name in OPTIM}, OPTIM, data, losses, CLIP,
                            before_step=budget_steps)


def dna_vlm_experiment(world_size, layouts, microbatches):
    # Declared vision, llm, dna: each module's weights come from seed + its index, as in the reference.
    modules = {name: module(kind, config, layouts[name], OPTIM[name])
               for name, kind, config in (("vision", "vit", VISION), ("llm", "gpt", LLM), ("dna", "genezip", DNA))}
    return experiment(world_size, modules, edges=[("vision", "llm"), ("dna", "llm")], global_batch=8,
                      microbatches=microbatches, grad_clip=CLIP)


def train(rank, world_size, layouts, microbatches, data):
    config = dna_vlm_experiment(world_size, layouts, microbatches)
    return record_run(build_runtime(config), data, ("loss", "llm.loss", "dna.loss"))


CASES = {
    "colocated vision dp4, dna tp2·dp2, llm tp2·dp2": (
        {"vision": {"dp": 4}, "dna": {"tp": 2, "dp": 2}, "llm": {"tp": 2, "dp": 2}}, 4, 1),
    "mixed vision dp2 (ranks 0-1), dna dp2 (2-3), llm pp2·dp2 (0-3)": (
        {"vision": {"dp": 2}, "dna": {"dp": 2, "offset": 2}, "llm": {"pp": 2, "dp": 2}}, 4, 2),
    "colocated vision dp4, dna dp4, llm cp2·dp2": (
        {"vision": {"dp": 4}, "dna": {"dp": 4}, "llm": {"cp": 2, "dp": 2}}, 4, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dna_vlm_parity(case):
    layouts, world_size, microbatches = CASES[case]
    data = batches(8)
    results = run_ranks(train, world_size, layouts, microbatches, data, timeout_s=300)
    print("\n" + check_parity(results, expected(), f"dna+vision->llm parity {case}"))
    config = dna_vlm_experiment(world_size, layouts, microbatches)
    print("  edge bytes: " + check_edge_bytes(results, config, data[0], microbatches))
