"""DeepSeek-V3's routing in hetero's MoE layer (``selection_bias``, ``expert_groups`` / ``groups_per_token``,
``routed_scale``, sigmoid gates renormalized, a shared expert) against transformers' ``DeepseekV3MoE`` on the
same weights: equal outputs, and each feature changes them (so the comparison would catch one left out).
The router in fp32 under bf16 autocast (``router_fp32``), in one process and at ep2·tp2 with SP."""

import re
from dataclasses import replace

import pytest
import torch
import transformers
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.moe import MoEFeedForward

HIDDEN, EXPERT, EXPERTS = 32, 16, 8
OURS = GPTConfig(vocab_size=64, hidden_size=HIDDEN, num_layers=1, num_heads=4, seq_len=16, num_experts=EXPERTS, top_k=2,
                 expert_ffn_size=EXPERT, shared_experts=1, gate="sigmoid", normalize_gates=True, selection_bias=True,
                 expert_groups=4, groups_per_token=2, routed_scale=2.5)


def layers(ours: GPTConfig = OURS) -> tuple[DeepseekV3MoE, MoEFeedForward]:
    config = transformers.DeepseekV3Config(hidden_size=HIDDEN, moe_intermediate_size=EXPERT, n_routed_experts=EXPERTS,
                                           n_group=4, topk_group=2, num_experts_per_tok=2, n_shared_experts=1,
                                           routed_scaling_factor=2.5, norm_topk_prob=True)
    torch.manual_seed(0)
    theirs = DeepseekV3MoE(config)
    with torch.no_grad():
        for tensor in [*theirs.parameters(), *theirs.buffers()]:
            tensor.copy_(torch.randn_like(tensor) * 0.3)
    layer = MoEFeedForward(ours)
    gate_up = theirs.experts.gate_up_proj
    state = {"router.weight": theirs.gate.weight, "experts.w1": gate_up[:, :EXPERT], "experts.w3": gate_up[:, EXPERT:],
             "experts.w2": theirs.experts.down_proj, "shared.w1.weight": theirs.shared_experts.gate_proj.weight,
             "shared.w3.weight": theirs.shared_experts.up_proj.weight,
             "shared.w2.weight": theirs.shared_experts.down_proj.weight}
    if ours.selection_bias:
        state["selection_bias"] = theirs.gate.e_score_correction_bias
    layer.load_state_dict(state, strict=True)
    return theirs, layer


def test_deepseek_v3_routing_equals_transformers_and_each_feature_matters():
    theirs, ours = layers()
    x = torch.randn(3, 16, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(x)
        got = ours(x)
    error = ((got - expected).abs().max() / expected.abs().max()).item()
    print(f"\nDeepSeek-V3 routing: relative error {error:.1e}")
    assert error < 1e-6
    for change in (dict(selection_bias=False), dict(expert_groups=1, groups_per_token=1), dict(routed_scale=1.0)):
        _, without = layers(replace(OURS, **change))
        with torch.no_grad():
            assert not torch.allclose(without(x), expected, rtol=1e-3, atol=1e-3), change


def test_router_fp32_routes_under_bf16_autocast_as_in_fp32():
    """With ``router_fp32`` the router's logits under bf16 autocast are fp32's, bit for bit (so near-tied
    experts are chosen as in fp32); without it they are bf16's."""
    _, layer = layers(replace(OURS, router_fp32=True))
    x = torch.randn(3, 16, HIDDEN, generator=torch.Generator().manual_seed(1))
    seen = []
    layer.router.register_forward_hook(lambda module, inputs, output: seen.append(output))
    with torch.no_grad():
        layer(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(x)
            layer.config = replace(OURS, router_fp32=False)
            layer(x)
    fp32, autocast, plain = seen
    assert autocast.dtype == torch.float32 and torch.equal(autocast, fp32)
    assert plain.dtype == torch.bfloat16 and not torch.equal(plain.float(), fp32)


def bf16_router_logits(rank, world_size, config: GPTConfig, layout: dict) -> list[tuple[int, bool]]:
    """One bf16 evaluation of a MoE at ``layout``: for each router call on this rank, the bits of its logits
    in dtype and whether they equal the fp32 product of its input and weight bit for bit."""
    from torch.distributed.tensor import DTensor

    from hetero.parallel.options import ParallelOptions
    from hetero.testing.experiments import experiment, module
    from hetero.testing.kinds import build_runtime

    block = module("gpt", config, layout, parallel=ParallelOptions(precision="bf16", sequence_parallel=True))
    runtime = build_runtime(experiment(world_size, {"llm": block}, global_batch=4, microbatches=1))
    seen = []

    def local(tensor):  # under SP the router's input and weight arrive as DTensors: this rank's tokens
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    def check(router, inputs, output):
        weight = router.weight.full_tensor() if isinstance(router.weight, DTensor) else router.weight
        with torch.autocast("cpu", enabled=False):
            fp32 = torch.nn.functional.linear(local(inputs[0]).float(), weight.float())
        seen.append((torch.finfo(output.dtype).bits, torch.equal(local(output).float(), fp32)))

    for layer in runtime.modules["llm"].model.layers.values():
        layer.feed_forward.router.register_forward_hook(check)
    tokens = torch.randint(0, config.vocab_size, (4, config.seq_len), generator=torch.Generator().manual_seed(3))
    runtime.evaluate([{"tokens": tokens, "labels": tokens.roll(-1, 1)}])
    return seen


def test_router_fp32_routes_in_fp32_under_bf16_at_ep2_tp2():
    """At ep2·tp2 with SP under bf16 autocast, every rank's router logits are the fp32 product of the tokens it
    routes, bit for bit; without ``router_fp32`` they are bf16."""
    from hetero.testing.multiprocess import run_ranks

    config = replace(OURS, num_layers=2, router_fp32=True)
    for fp32 in (True, False):
        results = run_ranks(bf16_router_logits, 4, replace(config, router_fp32=fp32), {"tp": 2, "dp": 2, "ep": 2})
        calls = [call for rank in results for call in rank]
        assert len(calls) == 4 * config.num_layers
        assert all(call == ((32, True) if fp32 else (16, False)) for call in calls), calls


@pytest.mark.parametrize("fields,message", [
    (dict(expert_groups=3), r"expert_groups=3 must divide .*num_experts=8"),
    (dict(groups_per_token=5), r"groups_per_token=5 must be in 1\.\.4"),
])
def test_a_grouping_that_cannot_route_is_refused(fields, message):
    from hetero.parallel.layout import Layout

    errors = replace(OURS, **fields).errors("llm", Layout(tp=1, cp=1, dp=1, pp=1, ranks=(0,)))
    assert any(re.search(message, e) for e in errors), errors
