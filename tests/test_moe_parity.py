"""A mixture-of-experts GPT under expert parallelism (with DP, TP, SP, PP, CP and recomputation) matches one
process running every expert: losses, both auxiliary losses and gradient norms for 4 AdamW steps, every
replica's gradients at step 1 (``hetero.testing.parity``).

fp32, fixed seed and data, 4 microbatches per step, through the runtime. The reference is the plain model
over the whole global batch, its auxiliary losses means over its tokens.
"""

import functools
from dataclasses import replace

import pytest
import torch

from hetero.config import OptimizerConfig
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.model import GPT, token_loss_sum
from hetero.models.gpt.moe import MoEFeedForward
from hetero.parallel.options import ParallelOptions
from hetero.testing.kinds import build_runtime
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks
from hetero.testing.parity import Record, check_parity, record_reference, record_run

from test_gpt_parity import batches as gpt_batches

CONFIG = GPTConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, seq_len=16,
                   num_experts=4, top_k=2, expert_ffn_size=32, shared_experts=1, balance_loss=0.01, router_z_loss=0.001)
SIGMOID = replace(CONFIG, gate="sigmoid", normalize_gates=True, shared_experts=0, router_fp32=True)
GATED = replace(CONFIG, shared_expert_gate=True)  # Qwen2-MoE's sigmoid gate on the shared experts' output
DENSE = replace(CONFIG, dense_layers=[0, 2])  # a dense MLP in layers 0 and 2 (Qwen-MoE's mlp_only_layers)
DEEPSEEK = replace(GATED, gate="sigmoid", normalize_gates=True, selection_bias=True, expert_groups=2,
                   routed_scale=2.5, router_fp32=True)  # DeepSeek-V3's routing (two groups of two experts, its
# router outside autocast: the same in fp32, test_moe_routing checks it under bf16), a gated shared expert
GLOBAL_BATCH, MICROBATCHES, STEPS, LR, SEED = 8, 4, 4, 1e-2, 1234
KEYS = ("loss", "llm.balance_loss", "llm.z_loss")

# name: (layout, options, config); experts split over ep2 in every case
LAYOUTS = {
    "ep2": ({"dp": 2, "ep": 2}, ParallelOptions(), CONFIG),
    "ep2 sigmoid+checkpointing": ({"dp": 2, "ep": 2}, ParallelOptions(activation_checkpointing=True), SIGMOID),
    "ep2·tp2": ({"tp": 2, "dp": 2, "ep": 2}, ParallelOptions(), CONFIG),
    "ep2·tp2+sp": ({"tp": 2, "dp": 2, "ep": 2}, ParallelOptions(sequence_parallel=True), CONFIG),
    "ep2·tp2+sp dense layers 0 and 2": ({"tp": 2, "dp": 2, "ep": 2}, ParallelOptions(sequence_parallel=True), DENSE),
    "ep2·tp2 deepseek routing, gated shared expert": ({"tp": 2, "dp": 2, "ep": 2}, ParallelOptions(), DEEPSEEK),
    "ep2·pp2": ({"pp": 2, "dp": 2, "ep": 2}, ParallelOptions(), CONFIG),
    "tp2": ({"tp": 2}, ParallelOptions(), CONFIG),  # every expert on both ranks, each routing half the tokens
    "dp4 ep2": ({"dp": 4, "ep": 2}, ParallelOptions(), CONFIG),  # each expert's gradients summed over 2 replicas
    "ep2·cp2": ({"dp": 2, "cp": 2, "ep": 2}, ParallelOptions(), CONFIG),  # balance counted over whole rows
}


def batches(config=CONFIG):
    return gpt_batches(config, STEPS)


def reference(config: GPTConfig) -> Record:
    torch.manual_seed(SEED)
    model = GPT(config)
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]

    def losses(batch, step):
        tokens = batch["tokens"].numel()
        loss = token_loss_sum(model(batch["tokens"], aux_scale=1.0 / tokens), batch["labels"]) / tokens
        return [loss] + [sum(layer.last_aux[part] for layer in layers) / tokens for part in ("balance_loss", "z_loss")]

    return record_reference({"llm": model}, {"llm": OptimizerConfig(lr=LR)}, batches(config), losses)


CONFIGS = {"CONFIG": CONFIG, "SIGMOID": SIGMOID, "DENSE": DENSE, "DEEPSEEK": DEEPSEEK}


@functools.cache
def references(config_name: str) -> Record:
    return reference(CONFIGS[config_name])


def config_name(config: GPTConfig) -> str:
    return next(name for name, known in CONFIGS.items() if config is known)


def train_cases(rank, world_size, cases):
    results = {}
    for name in cases:
        layout, options, config = LAYOUTS[name]
        blocks = {"llm": module("gpt", config, layout, OptimizerConfig(lr=LR), options)}
        runtime = build_runtime(experiment(world_size, blocks, global_batch=GLOBAL_BATCH, microbatches=MICROBATCHES,
                                           seed=SEED))
        results[name] = record_run(runtime, batches(config), KEYS)
    return results


def world_size_of(layout: dict) -> int:
    return layout.get("tp", 1) * layout.get("cp", 1) * layout.get("dp", 1) * layout.get("pp", 1)


@functools.cache
def results_for_world_size(world_size: int) -> dict | Exception:
    cases = [name for name, (layout, _, _) in LAYOUTS.items() if world_size_of(layout) == world_size]
    try:
        results = run_ranks(train_cases, world_size, cases, timeout_s=540, collective_timeout_s=300)
    except Exception as err:
        return err
    return {name: [by_name[name] for by_name in results] for name in cases}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_parity_with_one_process(name):
    layout, _, config = LAYOUTS[name]
    results = results_for_world_size(world_size_of(layout))
    if isinstance(results, Exception):
        raise results
    expected = references(config_name(config))
    assert all(value > 0 for value in expected.losses[0][1:]), "both auxiliary losses take part"
    print("\n" + check_parity(results[name], expected, f"moe parity {name}"))


# The same experts behind a dense vision encoder at dp4, on the LLM's ranks and on ranks of its own.
MOE_LLM = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=24,
                    num_experts=4, top_k=2, expert_ffn_size=32, shared_experts=1, balance_loss=0.01,
                    router_z_loss=0.001)
VLM_CASES = {
    "colocated vision dp4, llm tp2·dp2 ep2 (0-3)": ({"vision": {"dp": 4}, "llm": {"tp": 2, "dp": 2, "ep": 2}}, 4),
    "non-colocated vision dp4 (0-3), llm dp2 ep2 (4-5)": (
        {"vision": {"dp": 4}, "llm": {"dp": 2, "ep": 2, "offset": 4}}, 6),
}


def vlm_reference() -> Record:
    from test_vlm_parity import CLIP, OPTIM, VISION, batches as vlm_batches
    from hetero.testing.references import VisionLanguageModel, merge_image_embeddings

    model = VisionLanguageModel(VISION, MOE_LLM, seed=0)
    layers = [m for m in model.llm.modules() if isinstance(m, MoEFeedForward)]

    def losses(batch, step):
        supervised, tokens = int((batch["labels"] != -100).sum()), batch["tokens"].numel()
        embedded = merge_image_embeddings(model.llm.tok_embeddings(batch["tokens"]), model.vision(batch["images"]))
        loss = token_loss_sum(model.llm(embedded, aux_scale=1.0 / tokens), batch["labels"]) / supervised
        return [loss] + [sum(layer.last_aux[part] for layer in layers) / tokens for part in ("balance_loss", "z_loss")]

    return record_reference({"vision": model.vision, "llm": model.llm}, OPTIM, vlm_batches(8)[:STEPS], losses, CLIP)


def train_vlm(rank, world_size, layouts):
    from test_vlm_parity import CLIP, OPTIM, VISION, batches as vlm_batches

    modules = {name: module(kind, config, layouts[name], OPTIM[name])
               for name, kind, config in (("vision", "vit", VISION), ("llm", "gpt", MOE_LLM))}
    runtime = build_runtime(experiment(world_size, modules, edges=[("vision", "llm")], global_batch=8, microbatches=2,
                                       grad_clip=CLIP))
    return record_run(runtime, vlm_batches(8)[:STEPS], KEYS)


@pytest.mark.parametrize("case", list(VLM_CASES))
def test_moe_vlm_parity_with_one_process(case):
    layouts, world_size = VLM_CASES[case]
    results = run_ranks(train_vlm, world_size, layouts, timeout_s=300)
    print("\n" + check_parity(results, vlm_reference(), f"moe vlm parity {case}"))
