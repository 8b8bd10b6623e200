"""Three steps of an imported Qwen-VL trained by hetero (tower dp2 on ranks 0-1, LLM tp2 on ranks 2-3, the
conversations' rows as ``qwen_vl_sft`` makes them) against the same model trained the same three steps in
transformers with ``torch.optim.AdamW``: the loss of every step, the pre-clip gradient norm and every
weight's step-1 gradient on every replica (``check_parity``, 1e-5), for Qwen2.5-VL and Qwen3-VL."""

import pytest
import torch
import transformers

from hetero.config import load_experiment
from hetero.data.example import write_llava
from hetero.data.splits import load
from hetero.models.gpt.hf import gpt_name
from hetero.models.vit.qwen_tower_hf import tower_state
from hetero.interop.tiny_vlm import write_tiny_vlm
from hetero.testing.kinds import build_graph, build_runtime
from hetero.testing.multiprocess import run_ranks
from hetero.testing.parity import Record, check_parity, record_run
from hetero.testing.qwen_vl import transformers_loss

STEPS, LR, BETAS, EPS = 3, 2e-3, (0.9, 0.95), 1e-8
MODELS = {"qwen2.5-vl": transformers.Qwen2_5_VLForConditionalGeneration,
          "qwen3-vl": transformers.Qwen3VLForConditionalGeneration}
OVERRIDES = ["batch.global_batch_size=8", "train.data.per_rank=false", "train.grad_clip=0"] + [
    f"{m}.optim.{k}={v}" for m in ("vision", "llm")
    for k, v in (("lr", LR), ("warmup_steps", 0), ("decay_steps", 0), ("weight_decay", 0.0), ("beta1", BETAS[0]),
                 ("beta2", BETAS[1]), ("eps", EPS))]


def hetero_grads(grads: dict, vision) -> dict:
    """transformers' Qwen-VL gradients under hetero's ``<module>.<parameter>`` names (the fused qkv in thirds)."""
    tower = {name.removeprefix("model.visual."): g for name, g in grads.items() if name.startswith("model.visual.")}
    return {f"vision.{name}": g for name, g in tower_state(tower, vision).items()} | {
        "llm." + gpt_name(name.replace("model.language_model.", "model.")): g
        for name, g in grads.items() if not name.startswith("model.visual.")}


def transformers_run(path, family, batches, vision) -> Record:
    model = MODELS[family].from_pretrained(path, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    record = Record()
    for step, batch in enumerate(batches):
        loss = transformers_loss(model, batch)
        loss.backward()
        record.losses.append([loss.item()])
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        record.grad_norms.append(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item())
        if step == 0:
            record.grads = {name: g.detach().clone() for name, g in hetero_grads(grads, vision).items()}
        optimizer.step()
        optimizer.zero_grad()
    return record


def hetero_run(rank, world_size, experiment, batches):
    return record_run(build_runtime(experiment), batches)


@pytest.mark.parametrize("family", list(MODELS))
def test_three_steps_equal_transformers_with_adamw(family, tmp_path):
    path = write_tiny_vlm(tmp_path / family, family)
    data = write_llava(tmp_path / "example", 48, seed=1)
    experiment = load_experiment("qwen_vl_sft", [f"vision.init.hf={path}", f"train.data.path={data}", *OVERRIDES])
    graph = build_graph(experiment)
    train = load(experiment, graph, "train")
    batches = [train.batch(step) for step in range(STEPS)]
    assert sum(len(b["image_grid"]) for b in batches) >= 6
    ours = run_ranks(hetero_run, 4, experiment, batches, timeout_s=400)
    theirs = transformers_run(path, family, batches, graph.nodes["vision"].config)
    print("\n" + check_parity(ours, theirs, f"{family}: hetero against transformers, {STEPS} AdamW steps"))
