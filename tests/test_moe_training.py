"""Three steps of an imported mixture of experts trained by hetero at ep2·tp2 against the same model trained
the same three steps in transformers with ``torch.optim.AdamW``: each step's loss, the pre-clip gradient
norm and every weight's step-1 gradient on every replica (``check_parity``, 1e-5). No auxiliary loss on
either side (hetero's ``balance_loss`` 0, transformers' ``output_router_logits`` off)."""

import pytest
import torch

from hetero.config import OptimizerConfig
from hetero.models.gpt.hf import gpt_name
from hetero.testing.experiments import experiment, module
from hetero.testing.kinds import build_runtime
from hetero.testing.multiprocess import run_ranks
from hetero.testing.parity import Record, check_parity, record_run

from test_moe_import import SIZES, saved

STEPS, ROWS, SEQ = 3, 8, 24
OPTIM = OptimizerConfig(lr=2e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)


def batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, SIZES["vocab_size"], (ROWS, SEQ + 1), generator=generator)
        labels = tokens[:, 1:].clone()
        labels[:, : SEQ // 4] = -100  # a prompt: not supervised
        out.append({"tokens": tokens[:, :-1].contiguous(), "labels": labels})
    return out


def hetero_names(name: str, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """hetero's ``llm.<parameter>`` gradients of a transformers parameter's (its fused experts split)."""
    prefix, _, leaf = name.rpartition(".")
    if leaf == "gate_up_proj":
        gate, up = grad.chunk(2, dim=1)
        return {f"llm.{gpt_name(prefix + '.w1')}": gate, f"llm.{gpt_name(prefix + '.w3')}": up}
    if leaf == "down_proj" and prefix.endswith(".experts"):
        return {f"llm.{gpt_name(prefix + '.w2')}": grad}
    return {f"llm.{gpt_name(name)}": grad}


def transformers_run(path) -> Record:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=OPTIM.lr, betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps,
                                  weight_decay=0.0)
    record = Record()
    for step, batch in enumerate(batches()):
        logits = model(batch["tokens"]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        loss.backward()
        record.losses.append([loss.item()])
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        record.grad_norms.append(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item())
        if step == 0:
            record.grads = {ours: g.detach().clone() for name, grad in grads.items()
                            for ours, g in hetero_names(name, grad).items()}
        optimizer.step()
        optimizer.zero_grad()
    return record


def hetero_run(rank, world_size, path):
    block = module("gpt", {"seq_len": SEQ}, {"tp": 2, "dp": 2, "ep": 2}, OPTIM, init={"hf": str(path)})
    runtime = build_runtime(experiment(world_size, {"llm": block}, global_batch=ROWS, microbatches=2))
    return record_run(runtime, batches())


@pytest.mark.parametrize("case", ["qwen3-moe renormalized", "qwen2-moe: a gated shared expert, q/k/v biases"])
def test_three_steps_of_an_imported_moe_at_ep2_tp2_equal_transformers_with_adamw(tmp_path, case):
    saved(tmp_path, case)
    ours = run_ranks(hetero_run, 4, tmp_path, timeout_s=300)
    theirs = transformers_run(tmp_path)
    print("\n" + check_parity(ours, theirs, f"{case}: hetero at ep2·tp2 against transformers, {STEPS} AdamW steps"))
