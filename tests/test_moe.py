"""The mixture-of-experts layer against a token-by-token formula, and split over an EP group against one
process, on a step where one expert takes every token and another none; capacity drops counted."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.moe import MoEFeedForward
from hetero.parallel.expert_parallel import ExpertAllToAll, shard_experts
from hetero.testing.multiprocess import run_ranks

CONFIG = GPTConfig(hidden_size=8, num_heads=2, num_experts=4, top_k=2, expert_ffn_size=16, shared_experts=1,
                   balance_loss=0.01, router_z_loss=0.001)
ROWS, SEQ = 4, 8


def skewed_layer(config=CONFIG) -> MoEFeedForward:
    """Expert e's router row reads feature e: with feature 0 large and feature 3 very negative, expert 0 is
    every token's first choice and expert 3 nobody's."""
    torch.manual_seed(0)
    layer = MoEFeedForward(config)
    for weight in (layer.experts.w1, layer.experts.w3, layer.experts.w2):
        torch.nn.init.normal_(weight, std=0.3)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[torch.arange(4), torch.arange(4)] = 4.0
    return layer


def skewed_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, SEQ, CONFIG.hidden_size, generator=gen)
    x[..., 0] += 3.0
    x[..., 3] = -5.0
    return x, torch.randn(ROWS, SEQ, CONFIG.hidden_size, generator=gen)  # tokens, the output's weights in the loss


def by_formula(layer: MoEFeedForward, x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Each token's output written out one assignment at a time (capacity in token order, per expert);
    and the fraction of assignments dropped."""
    config, tokens = layer.config, x.reshape(-1, x.shape[-1])
    scores = (tokens @ layer.router.weight.T).softmax(-1)
    gates, chosen = scores.topk(config.top_k, dim=-1)
    capacity = (-(-config.capacity_factor * len(tokens) * config.top_k // config.num_experts)
                if config.capacity_factor else len(tokens) * config.top_k)
    taken, dropped, out = [0] * config.num_experts, 0, []
    flat_order = sorted(range(len(tokens) * config.top_k), key=lambda a: (int(chosen.flatten()[a]), a))
    kept = set()
    for a in flat_order:
        e = int(chosen.flatten()[a])
        if taken[e] < capacity:
            taken[e] += 1
            kept.add(a)
        else:
            dropped += 1
    w1, w3, w2 = layer.experts.w1, layer.experts.w3, layer.experts.w2
    for t, token in enumerate(tokens):
        y = layer.shared(token)
        for j in range(config.top_k):
            if t * config.top_k + j in kept:
                e = int(chosen[t, j])
                y = y + gates[t, j] * ((F.silu(w1[e] @ token) * (w3[e] @ token)) @ w2[e].T)
        out.append(y)
    return torch.stack(out).view_as(x), dropped / (len(tokens) * config.top_k)


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
def test_layer_matches_the_formula_and_counts_drops(capacity_factor):
    layer = skewed_layer(replace(CONFIG, capacity_factor=capacity_factor))
    x, _ = skewed_tokens()
    with torch.no_grad():
        got = layer(x)
        want, dropped = by_formula(layer, x)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert float(layer.assigned) == 0.0  # no grad: not a training forward, nothing counted
    layer(x).sum().backward()
    assert float(layer.dropped / layer.assigned) == pytest.approx(dropped)
    assert (dropped > 0.2) == (capacity_factor > 0)  # expert 0 wants every token, capacity takes half


def layer_step(layer: MoEFeedForward, x: torch.Tensor, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    out = layer(x, aux_scale=1.0 / (ROWS * SEQ))
    (out * weights).sum().backward()
    grads = {name: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone()
             for name, p in layer.named_parameters()}
    return {"out": out.detach(), "x": x.grad, "load": layer.load.clone(), **grads}


def expert_parallel_step(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    layer = skewed_layer()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh=list(range(world_size)), mesh_dim_names=("ep",))
    shard_experts(layer.experts, mesh)
    layer.dispatch = ExpertAllToAll(dist.group.WORLD, world_size, rank, CONFIG.num_experts)
    x, weights = skewed_tokens()
    rows = slice(rank * ROWS // world_size, (rank + 1) * ROWS // world_size)
    result = layer_step(layer, x[rows], weights[rows])
    result["bytes"] = torch.tensor(layer.dispatch.bytes_sent)
    return result


def test_expert_parallel_layer_matches_one_process_when_routing_is_skewed():
    """Dropless under ep2: every expert's rows cross to the rank that holds it and back, forward and backward,
    whatever each expert gets (expert 0 every token, expert 3 none)."""
    want = layer_step(skewed_layer(), *skewed_tokens())
    load = want["load"]
    assert load[3] == 0 and load[0] == ROWS * SEQ, load  # the skew the test is for
    ranks = run_ranks(expert_parallel_step, 2, timeout_s=120)

    def close(got, ref, what):
        error = float((got - ref).norm() / ref.norm())
        assert error < 1e-5, f"{what}: relative error {error:.1e}"

    close(torch.cat([r["out"] for r in ranks]), want["out"], "output")
    close(torch.cat([r["x"] for r in ranks]), want["x"], "input gradient")
    for name in ("router.weight", "shared.w1.weight", "shared.w2.weight"):  # replicated: each rank's tokens' share
        close(sum(r[name] for r in ranks), want[name], name)
    for name in ("experts.w1", "experts.w3", "experts.w2"):  # rank r holds experts 2r, 2r+1, all tokens' share
        close(torch.cat([r[name] for r in ranks]), want[name], name)
    assert all(int(r["bytes"]) > 0 for r in ranks)
