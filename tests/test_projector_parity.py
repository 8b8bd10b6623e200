"""A vision tower without its projector, a projector module with a layout of its own, and an LLM: the
LLaVA-style chain (``vision -> projector -> llm``) trains with parity against one process, images in
only some rows, on three placements: colocated (tower dp2, projector tp2, LLM tp2 on the same two ranks;
and the tower pipelined, tp2·pp2, beside projector and LLM at tp2·dp2 on four) and each on its own ranks
(tower 0, projector 1, LLM pp2 on 2-3: one pipeline through the chain). Per
step the loss and the gradient norm; every replica's gradients at the first step."""

import pytest
import torch

from hetero.config import OptimizerConfig
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.model import GPT, token_loss_sum
from hetero.models.projector.config import ProjectorConfig
from hetero.models.projector.model import MLPProjector
from hetero.models.vit.config import ViTConfig
from hetero.models.vit.model import VisionEncoder
from hetero.testing.kinds import build_runtime
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks
from hetero.testing.parity import check_parity, record_reference, record_run

# A SigLIP-shaped tower, but without the key bias: its gradient is zero up to rounding (softmax cancels
# it), which no relative tolerance compares.
VISION = ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_layers=2, num_heads=4, out_size=32,
                   class_token=False, activation="gelu_tanh", norm_eps=1e-6, projector=False)
PROJECTOR = ProjectorConfig(in_size=32, out_size=48, tokens=VISION.num_patches)
LLM = GPTConfig(vocab_size=64, hidden_size=48, num_layers=2, num_heads=4, ffn_hidden_size=64,
                seq_len=VISION.num_patches + 8)
OPTIM = {"vision": OptimizerConfig(lr=3e-3), "projector": OptimizerConfig(lr=3e-3), "llm": OptimizerConfig(lr=1e-2)}
STEPS, BATCH, CLIP = 4, 8, 0.5


def batches():
    gen = torch.Generator().manual_seed(4)
    out, patches = [], VISION.num_patches
    for _ in range(STEPS):
        text = torch.randint(1, LLM.vocab_size, (BATCH, LLM.seq_len - patches + 1), generator=gen)
        out.append({
            "images": torch.rand(BATCH, 1, 16, 16, generator=gen),
            "has_image": torch.rand(BATCH, generator=gen) < 0.7,
            "tokens": torch.cat([torch.zeros(BATCH, patches, dtype=torch.long), text[:, :-1]], dim=1),
            "labels": torch.cat([torch.full((BATCH, patches - 1), -100), text], dim=1),
        })
    return out


def reference():
    modules = {}
    for index, (name, build) in enumerate((("vision", lambda: VisionEncoder(VISION)),
                                           ("projector", lambda: _projector()), ("llm", lambda: GPT(LLM)))):
        torch.manual_seed(index)
        modules[name] = build()

    def loss(batch, step):
        h = modules["llm"].tok_embeddings(batch["tokens"]).clone()
        rows = torch.nonzero(batch["has_image"]).flatten()
        h[rows, : VISION.num_patches] = modules["projector"](modules["vision"](batch["images"][rows]))
        return [token_loss_sum(modules["llm"](h), batch["labels"]) / int((batch["labels"] != -100).sum())]

    return record_reference(modules, OPTIM, batches(), loss, CLIP)


def _projector() -> MLPProjector:
    model = MLPProjector(PROJECTOR.in_size, PROJECTOR.out_size)
    model.reset_parameters()
    return model


def train(rank, world_size, layouts, microbatches):
    kinds = {"vision": ("vit", VISION), "projector": ("projector", PROJECTOR), "llm": ("gpt", LLM)}
    modules = {name: module(kind, config, layouts[name], OPTIM[name]) for name, (kind, config) in kinds.items()}
    config = experiment(world_size, modules, edges=[("vision", "projector"), ("projector", "llm")],
                        global_batch=BATCH, microbatches=microbatches, grad_clip=CLIP)
    runtime = build_runtime(config)
    return record_run(runtime, batches()), runtime.graph.schedule


CASES = {
    "colocated on 2 ranks: vision dp2, projector tp2, llm tp2": (
        {"vision": {"dp": 2}, "projector": {"tp": 2}, "llm": {"tp": 2}}, 2, 2, "phased"),
    "colocated on 4 ranks: vision tp2·pp2, projector tp2·dp2, llm tp2·dp2": (
        {"vision": {"tp": 2, "pp": 2}, "projector": {"tp": 2, "dp": 2}, "llm": {"tp": 2, "dp": 2}}, 4, 2, "phased"),
    "each on its own ranks: vision (0), projector (1), llm pp2 (2-3)": (
        {"vision": {"dp": 1}, "projector": {"dp": 1, "offset": 1}, "llm": {"pp": 2, "dp": 1, "offset": 2}}, 4, 4,
        "graph_1f1b"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_projector_module_between_tower_and_llm_trains_with_parity(case):
    layouts, world_size, microbatches, schedule = CASES[case]
    results = run_ranks(train, world_size, layouts, microbatches, timeout_s=300)
    assert {s for _, s in results} == {schedule}
    print("\n" + check_parity([r for r, _ in results], reference(), f"projector {case}"))
