"""The vision-language trainer matches one process running the whole model: 20 AdamW steps, fp32.

Per-step loss within 1e-5 relative and every vision, projector and LLM gradient within 1e-5 relative
(in norm) at the first step (after the global clip, which checks the world-wide norm too), for colocated, non-colocated, LLM-pipelined and DP-mismatched placements.
The reference is a plain loop over ``VisionLanguageModel`` with one global gradient-norm clip.
"""

import pytest
import torch

from hetero.models.gpt import GPTConfig, token_loss_sum
from hetero.models.multimodal import IMAGE_TOKEN, VisionLanguageModel
from hetero.models.vision import ViTConfig
from hetero.parallel.layout import LayoutSpec
from hetero.parallel.mesh import build_module_meshes
from hetero.parallel.options import ParallelOptions
from hetero.parallel.placement import place
from hetero.testing.multiprocess import run_ranks
from hetero.train.optim import OptimizerConfig
from hetero.train.vlm import ModuleSetup, VLMTrainer

VISION = ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_layers=2, num_heads=4, out_size=32)
LLM = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                seq_len=24)
STEPS = 20
CLIP = 0.5
OPTIM = {"vision": OptimizerConfig(lr=3e-3), "llm": OptimizerConfig(lr=1e-2, warmup_steps=3)}


def batches(global_batch):
    gen = torch.Generator().manual_seed(7)
    out = []
    patches = VISION.num_patches
    for _ in range(STEPS):
        images = torch.rand(global_batch, 1, 16, 16, generator=gen)
        text = torch.randint(1, LLM.vocab_size, (global_batch, LLM.seq_len - patches + 1), generator=gen)
        tokens = torch.cat([torch.full((global_batch, patches), IMAGE_TOKEN), text[:, :-1]], dim=1)
        labels = torch.cat([torch.full((global_batch, patches - 1), -100), text], dim=1)
        out.append({"images": images, "tokens": tokens, "labels": labels})
    return out


def reference(global_batch, model=None, data=None, before_step=None):
    """Losses of every step and gradients of the first; ``model``, ``data`` and a hook called with the
    step number before each step let other tests run variants (by default the plain VLM and batches)."""
    model = model or VisionLanguageModel(VISION, LLM, seed=0)
    optims = {
        name: torch.optim.AdamW(getattr(model, name).parameters(), lr=OPTIM[name].lr, betas=(0.9, 0.95),
                                weight_decay=0.0, eps=1e-8)
        for name in OPTIM
    }
    losses, grads = [], None
    for step, batch in enumerate(data if data is not None else batches(global_batch)):
        if before_step is not None:
            before_step(step)
        for opt in optims.values():
            opt.zero_grad()
        supervised = int((batch["labels"] != -100).sum())
        loss = token_loss_sum(model(batch["images"], batch["tokens"]), batch["labels"]) / supervised
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        if step == 0:  # after the clip, as the trainer's gradients are read after its step
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        for name, opt in optims.items():
            for group in opt.param_groups:
                group["lr"] = OPTIM[name].lr_at(step)
            opt.step()
        losses.append(loss.item())
    return losses, grads


def train(rank, world_size, layouts, global_batch, microbatches):
    placement = place({name: LayoutSpec(**spec) for name, spec in layouts.items()}, world_size)
    meshes = build_module_meshes(placement)
    setups = {name: ModuleSetup(ParallelOptions(), OPTIM[name]) for name in OPTIM}
    trainer = VLMTrainer(placement, meshes, VISION, LLM, num_microbatches=microbatches, setups=setups,
                         grad_clip=CLIP, seed=0)
    disjoint = not set(placement.layouts["vision"].ranks) & set(placement.layouts["llm"].ranks)
    assert trainer.graph_pipeline == disjoint  # non-colocated runs one pipeline over the graph
    losses, grads = [], {}
    for step, batch in enumerate(batches(global_batch)):
        losses.append(trainer.train_step(batch)["loss"])
        if step == 0:
            grads = module_grads(trainer)
    return losses, grads


def module_grads(trainer: VLMTrainer) -> dict[str, torch.Tensor]:
    """Every gradient of this rank's modules, whole, named ``<module>.<parameter>``."""
    grads = {}
    for name, module in trainer.modules.items():
        for pname, p in module.model.named_parameters():
            # full_tensor() is collective over TP: every rank of the module calls it
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[f"{name}.{pname}"] = g.detach().clone()
    return grads


CASES = {
    "colocated vision tp1·dp4, llm tp2·dp2": ({"vision": {"dp": 4}, "llm": {"tp": 2, "dp": 2}}, 4, 8, 2),
    "non-colocated vision dp2 (0-1), llm tp2·dp2 (2-5)": (
        {"vision": {"dp": 2}, "llm": {"tp": 2, "dp": 2, "offset": 2}}, 6, 8, 2),
    "mixed vision dp2 (0-1), llm pp2·dp2 (0-3)": ({"vision": {"dp": 2}, "llm": {"pp": 2, "dp": 2}}, 4, 8, 4),
    "non-colocated graph pipeline vision dp2 (0-1), llm pp2 (2-3)": (
        {"vision": {"dp": 2}, "llm": {"pp": 2, "offset": 2}}, 4, 8, 4),
    "non-colocated vision dp3 (0-2), llm dp2 (3-4)": (
        {"vision": {"dp": 3}, "llm": {"dp": 2, "offset": 3}}, 5, 12, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_vlm_parity(case):
    layouts, world_size, global_batch, microbatches = CASES[case]
    ref_losses, ref_grads = reference(global_batch)
    results = run_ranks(train, world_size, layouts, global_batch, microbatches, timeout_s=300)
    losses = results[0][0]
    for rank_losses, _ in results:
        assert rank_losses == losses
    errors = [abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)]
    grads = {}
    for _, rank_grads in results:
        grads.update(rank_grads)
    assert set(grads) == set(ref_grads)
    worst = max(((grads[k] - ref_grads[k]).norm() / ref_grads[k].norm()).item() for k in ref_grads)
    print(f"\nvlm parity {case}: worst loss rel error {max(errors):.1e}, worst gradient rel error {worst:.1e}")
    assert max(errors) <= 1e-5, f"losses {losses} vs {ref_losses}"
    assert worst <= 1e-5
