"""GeneZip's parts: causal prediction through dynamic chunking (one and two stages, and fixed stride),
bounded routing, the de-chunker's EMA, the straight-through confidence, the ratio loss's fixed point, the
compressed tokens it hands on, the region budget (causal calls, reading-frame features, the controller's
step), the rate shift that compresses at a chosen rate, and the bench's H-Net at GeneZip's parameter count."""

import math
from dataclasses import replace

import pytest
import torch

from hetero.config import OptimizerConfig
from hetero.models.genezip.model import (
    GeneZip,
    Routing,
    bound_boundaries,
    padded_tokens,
    smooth_chunks,
    straight_through,
)
from hetero.bench.dechunk import smooth_chunks_loop, worst_case
from hetero.bench.genezip import parameter_count, variant_configs
from hetero.models.genezip.config import GeneZipConfig
from hetero.models.genezip.objectives import genezip_loss, heldout_metrics, ratio_loss, routing_counts
from hetero.models.genezip.rate import matched_rate_shift
from hetero.models.genezip.regions import BIAS_LIMIT, reading_frame_features
from hetero.data.genome import BASES

SMALL = dict(seq_len=96, hidden_size=32, num_heads=4, main_layers=1, local_window=8, routing_window=16)


@pytest.mark.parametrize("stages,routing", [(1, "dynamic"), (2, "dynamic"), (1, "fixed"), (2, "fixed")])
def test_prediction_is_causal(stages, routing):
    """Changing base t changes no prediction before t, and some prediction from t on."""
    torch.manual_seed(0)
    config = GeneZipConfig(**SMALL, stages=stages, routing=routing, min_boundaries=2, max_boundaries=6)
    model = GeneZip(config)
    for router in (m.router for m in model.modules() if hasattr(m, "router") and m.router is not None):
        torch.nn.init.orthogonal_(router.wk.weight)  # boundary probabilities around 1/2: a mix of chunk starts
    bases = torch.randint(0, 4, (3, config.seq_len))
    before = model(bases).logits
    for t in (5, 40, 90):
        changed = bases.clone()
        changed[:, t] = (changed[:, t] + 1) % 4
        after = model(changed).logits
        assert torch.equal(after[:, :t], before[:, :t])
        assert (after[:, t:] - before[:, t:]).abs().max() > 1e-4


def test_bounded_routing_keeps_floor_and_ceiling_per_window_causally():
    gen = torch.Generator().manual_seed(0)
    for density in (0.0, 0.1, 0.5, 1.0):
        chosen = torch.rand(64, 50, generator=gen) < density
        bounded = bound_boundaries(chosen, window=16, floor=3, ceiling=5)
        full = bounded[:, :48].reshape(64, 3, 16).sum(-1)
        assert bool((full >= 3).all()) and bool((full <= 5).all())
        assert bool((bounded[:, 48:].sum(-1) == 2).all())  # a last window of 2 positions: both start chunks
        # A window with at most the ceiling's natural starts keeps every one of them.
        natural = chosen[:, :48].reshape(64, 3, 16)
        within = natural.sum(-1, keepdim=True) <= 5
        assert bool((bounded[:, :48].reshape(64, 3, 16) | ~natural | ~within).all())
        # Causal: a change at position t leaves every decision before t alone.
        for t in (7, 20, 49):
            flipped = chosen.clone()
            flipped[:, t] = ~flipped[:, t]
            assert torch.equal(bound_boundaries(flipped, 16, 3, 5)[:, :t], bounded[:, :t])


def test_floor_fills_the_end_of_a_window_and_ceiling_drops_late_starts():
    none = torch.zeros(1, 8, dtype=torch.bool)
    assert bound_boundaries(none, 8, 2, 0).int().tolist() == [[0, 0, 0, 0, 0, 0, 1, 1]]
    every = torch.ones(1, 8, dtype=torch.bool)
    assert bound_boundaries(every, 8, 0, 3).int().tolist() == [[1, 1, 1, 0, 0, 0, 0, 0]]


def test_smoothing_keeps_a_chunk_at_rate_one_and_the_past_at_rate_zero():
    states = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(smooth_chunks(states, torch.ones(2, 6)), states)
    first_only = torch.zeros(2, 6)
    first_only[:, 0] = 1
    assert torch.equal(smooth_chunks(states, first_only), states[:, :1].expand(-1, 6, -1))


@pytest.mark.parametrize("chunks", [1, 2, 3, 5, 64, 1000])
def test_the_scan_matches_the_loop_forward_and_backward(chunks):
    """The parallel scan against the chunk-by-chunk loop it replaced, at 1e-6 in fp32: the states
    absolutely, the gradients relative to their largest entry (a rate's gradient sums products over the
    width, so a small one can be the difference of large terms and carry their rounding)."""
    states, rate = worst_case(2, chunks, 16, seed=chunks)
    with torch.no_grad():
        rate[:, 1::7] = 0.0  # chunks that keep all of the past, and ones that keep none of it
        rate[:, 2::5] = 1.0
    out, reference = smooth_chunks(states, rate), smooth_chunks_loop(states, rate)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-6)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (states, rate), grad_out)
    expected = torch.autograd.grad(reference, (states, rate), grad_out)
    for got, want in zip(grads, expected):
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-6


def test_straight_through_is_one_forward_with_the_confidence_gradient():
    confidence = torch.tensor([0.2, 0.9], requires_grad=True)
    value = straight_through(confidence)
    assert value.tolist() == [1.0, 1.0]
    (value * torch.tensor([3.0, 5.0])).sum().backward()
    assert confidence.grad.tolist() == [3.0, 5.0]


def routing_with(fraction: float, probability: float, length: int = 120) -> Routing:
    boundary = torch.zeros(1, length, dtype=torch.bool)
    boundary[0, :: round(1 / fraction)] = True
    return Routing(torch.full((1, length), probability, requires_grad=True), boundary, torch.ones_like(boundary))


@pytest.mark.parametrize("target", [2.0, 4.0, 8.0])
def test_ratio_loss_pushes_toward_its_target(target):
    """The gradient on the boundary probabilities raises them when too few positions start chunks and
    lowers them when too many do: the fixed point is 1/target of positions."""
    for fraction, sign in ((1 / (2 * target), -1), (min(1.0, 2 / target), 1)):
        routing = routing_with(fraction, 0.5)
        ratio_loss(routing, torch.tensor([target]), None).sum().backward()
        assert torch.sign(routing.probability.grad.sum()) == sign


def test_region_targets_apply_per_region():
    """With regions, each region's positions are pushed toward its own target."""
    routing = routing_with(1 / 4, 0.5)
    regions = torch.zeros(1, 120, dtype=torch.long)
    regions[0, 60:] = 1
    ratio_loss(routing, torch.tensor([8.0, 2.0]), regions).sum().backward()
    grad = routing.probability.grad[0]
    assert bool((grad[:60] > 0).all()) and bool((grad[60:] < 0).all())  # region 0: fewer; region 1: more


def test_fixed_stride_and_the_tokens_it_hands_on():
    config = GeneZipConfig(**SMALL, routing="fixed", target_bpt=4, out_size=16)
    torch.manual_seed(0)
    model = GeneZip(config)
    bases = torch.randint(0, 4, (2, config.seq_len))
    output = model(bases)
    assert output.routings[0].boundary[0].nonzero().flatten().tolist() == list(range(0, config.seq_len, 4))
    tokens = padded_tokens(output, config)
    assert tokens.shape == (2, config.max_tokens(), 16) == (2, 24, 16)
    counts = routing_counts(output.routings[0], torch.zeros_like(bases), config.routing_window)
    assert counts.overall_bases_per_token() == 4.0 and counts.fewest_per_window == 4
    loss = genezip_loss(config, output, bases, None)
    assert float(loss.ratio.abs().sum()) == 0.0  # a fixed stride has nothing to route


def test_dynamic_tokens_are_padded_to_the_ceiling():
    config = GeneZipConfig(**SMALL, min_boundaries=1, max_boundaries=5, out_size=32)
    torch.manual_seed(0)
    output = GeneZip(config)(torch.randint(0, 4, (3, config.seq_len)))
    tokens = padded_tokens(output, config)
    assert tokens.shape == (3, 30, 32)
    counts = output.routings[0].boundary.sum(1)
    for row, count in enumerate(counts.tolist()):
        assert torch.equal(tokens[row, count:], torch.zeros_like(tokens[row, count:]))
        assert bool(tokens[row, :count].abs().sum(-1).gt(0).all())


def budget_config(**fields) -> GeneZipConfig:
    return GeneZipConfig(**SMALL, min_boundaries=2, max_boundaries=6, region_bpt={"coding": 3.0, "intergenic": 6.0},
                         region_channels=8, **fields)


def test_region_budget_is_causal():
    """With the budget's biases apart, changing base t changes no region call, no routing decision and no
    prediction before t."""
    torch.manual_seed(0)
    model = GeneZip(budget_config())
    model.budget.bias.copy_(torch.tensor([-2.0, 2.0]))
    bases = torch.randint(0, 4, (3, 96))
    before = model(bases)
    called = model.budget.called_coding(before.region_logits)
    assert 0 < int(called.sum()) < called.numel()  # both calls occur, so the bias varies along the sequence
    for t in (5, 40, 90):
        changed = bases.clone()
        changed[:, t] = (changed[:, t] + 1) % 4
        after = model(changed)
        assert torch.equal(after.region_logits[:, :t], before.region_logits[:, :t])
        assert torch.equal(after.routings[0].boundary[:, :t], before.routings[0].boundary[:, :t])
        assert torch.equal(after.logits[:, :t], before.logits[:, :t])
        assert (after.region_logits[:, t:] - before.region_logits[:, t:]).abs().max() > 1e-6


def test_ratio_loss_trains_the_router_not_the_budgets_bias():
    """The budget's bias moves the chunk starts and the de-chunker's rates, but the ratio loss reads the
    router's own probabilities and decisions: the same loss and router gradient whatever the bias."""
    torch.manual_seed(0)
    model = GeneZip(budget_config())
    bases = torch.randint(0, 4, (3, 96))
    regions = torch.randint(0, 2, (3, 96))
    ratios, gradients, starts = [], [], []
    for bias in ([0.0, 0.0], [-2.0, 2.0]):
        model.budget.bias.copy_(torch.tensor(bias))
        model.zero_grad()
        output = model(bases)
        ratio = genezip_loss(model.config, output, bases, regions).ratio
        ratio.sum().backward()
        ratios.append(ratio.detach())
        gradients.append(model.stage.router.wq.weight.grad.clone())
        starts.append(output.routings[0].boundary)
    assert not torch.equal(starts[0], starts[1])
    assert torch.equal(ratios[0], ratios[1]) and torch.equal(gradients[0], gradients[1])
    assert gradients[0].abs().sum() > 0


@pytest.mark.parametrize("budget", [False, True])
def test_the_matched_rate_shift_routes_the_batches_at_the_wanted_rate(budget):
    """Above and below the rate a model routes at unshifted, the shift it finds makes the forward pass route
    the same batches at the target (to a chunk start or two), with or without a region budget's biases."""
    torch.manual_seed(0)
    regions = dict(region_bpt={"coding": 3.0, "intergenic": 6.0}, region_channels=8) if budget else {}
    model = GeneZip(GeneZipConfig(**SMALL, min_boundaries=2, **regions))
    torch.nn.init.orthogonal_(model.stage.router.wk.weight)  # boundary probabilities around 1/2
    if budget:  # the untrained classifier calls most bases coding
        model.budget.bias.copy_(torch.tensor([-0.3, 0.05]))
    batches = [{"bases": torch.randint(0, 4, (4, 96)), "regions": torch.randint(0, 2, (4, 96))} for _ in range(2)]
    bases = 2 * 4 * 96
    unshifted = heldout_metrics(model, batches)["bpt"]
    for target in (unshifted * 0.8, unshifted * 1.25):
        shift = matched_rate_shift(model, batches, target)
        achieved = heldout_metrics(model, batches, shift)["bpt"]
        assert shift != 0 and abs(bases / achieved - bases / target) <= 2
    with pytest.raises(ValueError, match="out of reach"):
        matched_rate_shift(model, batches, 16 / 1.5)  # fewer starts than the floor of 2 per 16 bases


def test_reading_frame_features_restart_at_an_in_frame_stop():
    """After TAA ends at position 8, the frame of the codon ending at t = 8 + 3k counts bases since 8; the
    other frames (no stop) count from the sequence start."""
    sequence = "CCCCCCTAACCCCCCCCCCC"
    bases = torch.tensor([[BASES.index(b) for b in sequence]])
    forward = reading_frame_features(bases)[0, :, :3] * 6  # log1p(bases since the frame's last stop)
    for t in (11, 14, 17):
        assert forward[t, 0].expm1().round() == t - 8
        assert forward[t, 1].expm1().round() == t + 1 and forward[t, 2].expm1().round() == t + 1


def statistics(bases, starts):
    """``STATISTICS`` from (true region × call) tables of bases and of chunk starts."""
    return torch.tensor([*torch.tensor(bases).flatten().tolist(), *torch.tensor(starts).flatten().tolist()],
                        dtype=torch.float64)


def test_controller_moves_each_bias_toward_its_regions_target():
    """Calls that match the regions: each bias moves by gain·log(achieved / wanted) rate; a rate on target
    leaves its bias alone; the counts' scale does not matter; the state is in the state dict."""
    model = GeneZip(budget_config(region_gain=0.1))
    budget = model.budget
    # intergenic: 100 bases, 25 starts (4 per token, wants 6); coding: 300 bases, 100 starts (3, on target)
    budget.update(statistics([[100, 0], [0, 300]], [[25, 0], [0, 100]]))
    assert torch.allclose(budget.bias, torch.tensor([-0.1 * math.log(6 / 4), 0.0]))
    scaled = GeneZip(budget_config(region_gain=0.1)).budget
    scaled.update(statistics([[100, 0], [0, 300]], [[25, 0], [0, 100]]) / 7)
    assert torch.allclose(scaled.bias, budget.bias)
    assert {"budget.bias", "budget.counts", "budget.seen", "budget.updates"} <= set(model.state_dict())


def test_controller_gain_anneals_with_the_learning_rate_after_warmup():
    """``decay`` scales the step (full during warm-up, the learning rate's fraction of its peak after it,
    nothing at 0) while the counts still update."""
    optim = OptimizerConfig(lr=1e-3, warmup_steps=2, decay_steps=4)
    assert [optim.decay_at(s) for s in (0, 1, 2)] == [1.0, 1.0, 1.0]
    assert optim.decay_at(4) == pytest.approx(0.55) and optim.decay_at(6) == pytest.approx(0.1)
    counts = statistics([[100, 0], [0, 300]], [[25, 0], [0, 100]])
    steps = {}
    for decay in (1.0, 0.55, 0.0):
        budget = GeneZip(budget_config(region_gain=0.1)).budget
        budget.update(counts, decay)
        steps[decay] = budget.bias.clone()
        assert int(budget.updates) == 1 and budget.counts.sum() > 0
    assert torch.allclose(steps[0.55], 0.55 * steps[1.0]) and steps[1.0][0] != 0
    assert torch.equal(steps[0.0], torch.zeros(2))


def test_controller_undoes_the_calls_mixing():
    """Mixed calls: the step Δ solves S·Δ = -gain·e, with S[r][k] the share of region r's starts under call
    k and e_r = log(achieved / wanted), so to first order each true region's log-rate error shrinks by
    gain·e_r. A step without DNA leaves the state alone."""
    budget = GeneZip(budget_config(region_gain=0.5)).budget
    bases, starts = [[80, 20], [30, 270]], [[16, 8], [6, 84]]
    budget.update(statistics(bases, starts))
    shares = torch.tensor(starts, dtype=torch.float64)
    shares = shares / shares.sum(1, keepdim=True)
    error = torch.log(torch.tensor([24 / 100, 90 / 300], dtype=torch.float64) * torch.tensor([6.0, 3.0], dtype=torch.float64))
    assert torch.allclose((shares @ budget.bias.double()), -0.5 * error, atol=1e-6)
    state = {k: v.clone() for k, v in budget.state_dict().items()}
    budget.update(torch.zeros(8, dtype=torch.float64))
    assert all(torch.equal(state[k], v) for k, v in budget.state_dict().items())


def test_controller_holds_a_bias_at_its_limit_and_steers_the_other_by_least_squares():
    """Intergenic's bias is at its limit and its rate still too high: it holds, and coding's bias takes the
    step that minimizes both regions' linearized log-rate errors (the normal equation holds)."""
    budget = GeneZip(budget_config(region_gain=0.5)).budget
    budget.bias.copy_(torch.tensor([-BIAS_LIMIT, 0.0]))
    bases, starts = [[80, 20], [30, 270]], [[16, 8], [6, 84]]  # intergenic 0.24 starts per base, wants 1/6
    budget.update(statistics(bases, starts))
    shares = torch.tensor(starts, dtype=torch.float64)
    shares = shares / shares.sum(1, keepdim=True)
    error = torch.log(torch.tensor([24 / 100, 90 / 300], dtype=torch.float64) * torch.tensor([6.0, 3.0], dtype=torch.float64))
    assert budget.bias[0] == -BIAS_LIMIT
    coding_step = budget.bias[1].double()
    assert abs(float(shares[:, 1] @ (shares[:, 1] * coding_step + 0.5 * error))) < 1e-6
    assert coding_step < 0  # coding alone asks for more starts; thinning intergenic's share under coding calls wins


def test_controller_moves_both_biases_together_until_the_calls_separate():
    """Calls that carry the same share of each region's starts: one shift for both biases, by the log of
    the overall rate over the overall wanted rate."""
    budget = GeneZip(budget_config(region_gain=1.0)).budget
    budget.update(statistics([[50, 50], [150, 150]], [[10, 10], [30, 30]]))
    overall = math.log(80 / (100 / 6 + 300 / 3))
    assert torch.allclose(budget.bias, torch.tensor([-overall, -overall]), atol=1e-6)


def test_the_bench_widens_hnet_to_genezips_parameter_count():
    """H-Net gets the width nearest GeneZip's count (its classifier adds parameters), with even heads for RoPE."""
    base = GeneZipConfig(**SMALL)
    configs = variant_configs(base, {"coding": 3.0, "intergenic": 6.0}, hnet_hidden=0)
    target = parameter_count(configs["genezip"])
    width = configs["hnet"].hidden_size
    assert width > base.hidden_size and width % (2 * base.num_heads) == 0
    off = {w: abs(parameter_count(replace(configs["hnet"], hidden_size=w)) - target) for w in (width - 8, width, width + 8)}
    assert off[width] == min(off.values())
    assert variant_configs(base, {"coding": 3.0, "intergenic": 6.0}, hnet_hidden=40)["hnet"].hidden_size == 40
