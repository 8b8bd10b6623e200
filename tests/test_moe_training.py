"""Three steps of an imported mixture of experts trained by hetero at ep2·tp2 against the same model trained
the same three steps in transformers with ``torch.optim.AdamW``: each step's loss, the pre-clip gradient
norm and every weight's step-1 gradient on every replica (``check_parity``, 1e-5). Qwen3-MoE trains with
transformers' own pooled load-balancing loss (``router_aux_loss_coef``; hetero's ``balance_pooled``): each of
hetero's forwards (a microbatch of 2 rows on one DP rank) pools its own, as each device's forward does in
transformers under data parallelism and gradient accumulation, so the reference runs the model on those
rows, its ``aux_loss`` averaged; OLMoE likewise, its q and k norms over all heads (split over TP), with
sequence parallelism, on inputs that hold its pad token (whose embedding row only the output's gradient
reaches there, transformers' padding_idx). Qwen2-MoE trains without an auxiliary loss, and so does DeepSeek-V3
(multi-head latent attention, its heads split over TP, with sequence parallelism; and at ep2·cp2), as
transformers trains it."""

import json

import pytest
import torch

from hetero.config import OptimizerConfig
from hetero.models.gpt.hf import gpt_name
from hetero.parallel.options import ParallelOptions
from hetero.testing.experiments import experiment, module
from hetero.testing.kinds import build_runtime
from hetero.testing.multiprocess import run_ranks
from hetero.testing.parity import Record, check_parity, record_run

from test_moe_import import DEEPSEEK, OLMOE, SIZES, saved

STEPS, ROWS, SEQ = 3, 8, 24
DEVICE_BATCH = 2  # rows of one forward of hetero's at tp2·dp2 with 2 microbatches (rows 0-1, 2-3, ...)
CASES = {"qwen3-moe renormalized": 0.05, "qwen2-moe: a gated shared expert, q/k/v biases": 0.0,
         OLMOE: 0.01, DEEPSEEK: 0.0}  # the aux loss's coefficient (OLMoE's own); its q/k norms span the heads that TP splits
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


def transformers_run(path, coefficient: float) -> Record:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=OPTIM.lr, betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps,
                                  weight_decay=0.0)
    record = Record()
    for step, batch in enumerate(batches()):
        if coefficient:  # transformers' aux_loss: load_balancing_loss_func over one forward's rows
            outs = [model(tokens, output_router_logits=True) for tokens in batch["tokens"].split(DEVICE_BATCH)]
            logits, aux = torch.cat([out.logits for out in outs]), torch.stack([out.aux_loss for out in outs]).mean()
        else:
            logits, aux = model(batch["tokens"]).logits, torch.zeros(())
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        (loss + coefficient * aux).backward()
        record.losses.append([loss.item()] + ([coefficient * aux.item()] if coefficient else []))
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        record.grad_norms.append(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item())
        if step == 0:
            record.grads = {ours: g.detach().clone() for name, grad in grads.items()
                            for ours, g in hetero_names(name, grad).items()}
        optimizer.step()
        optimizer.zero_grad()
    return record


def hetero_run(rank, world_size, path, coefficient: float, sequence_parallel: bool, split: str = "tp"):
    pooled = {"balance_loss": coefficient, "balance_pooled": True} if coefficient else {}
    block = module("gpt", {"seq_len": SEQ} | pooled, {split: 2, "dp": 2, "ep": 2}, OPTIM,
                   ParallelOptions(sequence_parallel=sequence_parallel), init={"hf": str(path)})
    runtime = build_runtime(experiment(world_size, {"llm": block}, global_batch=ROWS, microbatches=ROWS // 2 // DEVICE_BATCH))
    return record_run(runtime, batches(), ("loss", "llm.balance_loss") if coefficient else ("loss",))


@pytest.mark.parametrize("case", list(CASES))
def test_three_steps_of_an_imported_moe_at_ep2_tp2_equal_transformers_with_adamw(tmp_path, case):
    saved(tmp_path, case)
    if case == OLMOE:  # its pad token among the inputs
        pad = json.loads((tmp_path / "config.json").read_text())["pad_token_id"]
        assert sum(int((batch["tokens"] == pad).sum()) for batch in batches()) >= 5
    sequence_parallel = case in (OLMOE, DEEPSEEK)
    ours = run_ranks(hetero_run, 4, tmp_path, CASES[case], sequence_parallel, timeout_s=300)
    theirs = transformers_run(tmp_path, CASES[case])
    where = "ep2·tp2" + (" with SP" if sequence_parallel else "")
    print("\n" + check_parity(ours, theirs, f"{case}: hetero at {where} against transformers, {STEPS} AdamW steps"))
    if case == DEEPSEEK:  # and its attention over a sequence split in two (the ring), narrower values padded
        ours = run_ranks(hetero_run, 4, tmp_path, 0.0, False, "cp", timeout_s=300)
        print(check_parity(ours, theirs, f"{case}: hetero at ep2·cp2 against transformers, {STEPS} AdamW steps"))
