"""The layout planner: cluster descriptions, the cost model's accounting, the search, the CLI."""

import json
import math
from dataclasses import replace

import pytest
import yaml

from hetero.cli import main
from hetero.config import load_experiment
from hetero.testing.kinds import build_graph
from hetero.errors import ConfigError
from hetero.models.gpt.config import GPTConfig
from hetero.plan.cluster import ClusterSpec, DeviceSpec, LinkSpec, cluster_from_dict, load_cluster
from hetero.plan.cost import GIB, Choice, CostModel, allreduce_s, describe, stacked_forward_flops
from hetero.plan.report import heterogeneous_gain
from hetero.plan.search import Planner, graph_pipeline_s, linked_pipeline_s, predict_configured
from hetero.plan.workload import gradient_wire_ratio, workload_of
from hetero.parallel.compression.config import CompressionConfig, CompressorConfig, DiLoCoConfig

LLAMA_7B = GPTConfig(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, ffn_hidden_size=11008, seq_len=4096)


def test_cluster_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"device: unknown field\(s\) tflops"):
        cluster_from_dict({"device": {"tflops": 3}})
    with pytest.raises(ConfigError, match=r"inter_node.bandwidth_gb_s=-1 must be a non-negative number"):
        cluster_from_dict({"inter_node": {"bandwidth_gb_s": -1}})
    with pytest.raises(ConfigError, match=r"device.precision='fp8' is not one of bf16, fp32"):
        cluster_from_dict({"device": {"precision": "fp8"}})
    with pytest.raises(ConfigError, match=r"nodes=0 must be a positive integer"):
        cluster_from_dict({"nodes": 0})
    with pytest.raises(ConfigError, match=r"no such file"):
        load_cluster("no_such_cluster")
    shipped = load_cluster("h100_64")
    assert (shipped.world_size, shipped.device.memory_gib) == (64, 80)


def test_ring_allreduce_cost():
    link = LinkSpec(bandwidth_gb_s=10.0, latency_us=5.0)
    assert allreduce_s(1e9, 1, link) == 0
    # 2(n-1) steps of latency, 2(n-1)/n of the data over the link
    assert allreduce_s(1e9, 4, link) == pytest.approx(6 * 5e-6 + 1.5 * 1e9 / 10e9)


def test_memory_accounting_of_a_7b_llm():
    model = CostModel(ClusterSpec(nodes=1, gpus_per_node=8))
    llm = describe("llm", "gpt", LLAMA_7B)
    assert llm.params == pytest.approx(6.74e9, rel=0.01)  # Llama-2-7B
    alone = model.module_cost(llm, Choice(), samples=8)
    # bf16 weights, fp32 gradients, fp32 master weights and Adam moments unsharded at dp=1: 18 bytes/param
    assert alone.memory_bytes > 18 * llm.params
    assert not model.fits(alone.memory_bytes)
    tp8 = model.module_cost(llm, Choice(tp=8), samples=8)
    assert tp8.memory_bytes < alone.memory_bytes / 7
    recompute = model.module_cost(llm, Choice(tp=8, recompute=True), samples=8)
    assert recompute.memory_bytes < tp8.memory_bytes and recompute.compute_s > tp8.compute_s
    sharded = model.module_cost(llm, Choice(tp=8, dp=8), samples=64)  # optimizer state sharded over dp
    assert sharded.memory_bytes < tp8.memory_bytes


def test_pipeline_bubble_and_dp_traffic():
    model = CostModel(ClusterSpec(nodes=2, gpus_per_node=8))
    llm = describe("llm", "gpt", LLAMA_7B)
    pp4 = model.module_cost(llm, Choice(tp=2, pp=4, dp=2), samples=16)
    assert pp4.microbatches == 8
    # 1F1B: every microbatch through the slowest stage, one through each other stage (m + pp - 1 slots when
    # they balance); the first stage has the embedding, the last the head, so here a little less
    assert 8 + 3 * 0.8 < pp4.slots < 8 + 3 and pp4.compute_s == pytest.approx(pp4.slots * pp4.microbatch_s)
    heavy = [model.module_cost(llm, Choice(tp=2, pp=4, dp=2), samples=16, extra_first_stage_s=x) for x in (1.0, 2.0)]
    assert heavy[1].compute_s - heavy[0].compute_s == pytest.approx(8 * 1.0)  # the slowest stage, 8 times
    dense = model.module_cost(llm, Choice(tp=8, dp=2), samples=16)
    int8 = gradient_wire_ratio(CompressionConfig(grad=CompressorConfig(method="int8", block_size=64)))
    assert int8 == pytest.approx((1 + 4 / 64) / 4)
    compressed = model.module_cost(llm, Choice(tp=8, dp=2), samples=16, grad_ratio=int8)
    assert compressed.dp_s < dense.dp_s / 3
    diloco = CompressionConfig(diloco=DiLoCoConfig(inner_steps=32))
    assert gradient_wire_ratio(diloco) == pytest.approx(1 / 32)
    sparse = CompressorConfig(method="topk", ratio=64 / 4096, segment=4096, value_bits=2)  # 2-bit codes, 2 bf16
    assert gradient_wire_ratio(CompressionConfig(grad=sparse)) == pytest.approx(64 / 4096 * (2 + 0.5 + 12) / 32)


def test_nothing_fits_one_small_device():
    cluster = ClusterSpec(nodes=1, gpus_per_node=1, device=DeviceSpec(memory_gib=16))
    plans = Planner(cluster, workload_of(load_experiment("vlm_7b"))).plans()
    assert plans == {"megatron": [], "homogeneous": [], "colocated": [], "colocated_1f1b": [], "non_colocated": []}


def test_long_context_vlm_on_64_h100s():
    """The acceptance case: a heterogeneous placement is never behind one shared grid, and pulls ahead at
    long context (the LLM's model parallelism grows with it and a shared grid drags the encoder along);
    filling the LLM's pipeline bubbles with encoder work never makes a colocated plan slower. Predicted
    gains: 4.5% at 8k (bubble filling's plan), 1.3% at 32k, 7.4% at 128k."""
    experiment, cluster = load_experiment("vlm_7b"), load_cluster("h100_64")
    gains = {}
    for context in (8192, 32768, 131072):
        workload = workload_of(experiment, context)
        plans = Planner(cluster, workload).plans()
        gains[context] = heterogeneous_gain(plans)
        for mode, found in plans.items():
            best = found[0]
            assert cluster.device.usable_memory * 80 >= best.memory_gib
            assert best.model_flops == pytest.approx(workload.model_flops)
            assert 0 < best.tflops_per_gpu < cluster.device.peak_tflops
            assert sum(best.breakdown().values()) == pytest.approx(best.step_s)
        assert plans["colocated_1f1b"][0].step_s <= plans["colocated"][0].step_s
    assert all(gain >= 1 for gain in gains.values())
    assert gains[131072] > 1.05


def test_more_context_holds_more_images():
    experiment = load_experiment("vlm_7b")
    base = workload_of(experiment)
    assert (base.sequences, base.samples("vision")) == (256, 256)  # one image per sequence as configured
    longer = workload_of(experiment, 4096 * 4)
    assert longer.sequences == 64  # the same tokens per step
    # images: the configured text (4096 - 729 tokens) stays, images fill the rest of each sequence
    assert longer.per_sequence["vision"] == pytest.approx(1 + (4096 * 3) / 729)
    mixed = workload_of(experiment, 4096 * 4, extra_context="mixed")
    assert mixed.per_sequence["vision"] == 4 and mixed.samples("vision") == 256


def test_predict_configured_modes():
    cluster = ClusterSpec(nodes=1, gpus_per_node=8, device=DeviceSpec(activation_bytes=4, precision="fp32"))
    for name, mode in (("colocated_vlm", "colocated"), ("non_colocated_vlm", "non_colocated")):
        experiment = load_experiment(name)
        plan = predict_configured(experiment, build_graph(experiment).placement, cluster)
        assert plan.mode == mode and plan.step_s > 0
        llm = experiment.modules["llm"].layout
        assert (plan.choices["llm"].tp, plan.choices["llm"].dp) == (llm.tp, llm.dp)
    experiment = load_experiment("mixed_vlm")
    with pytest.raises(ConfigError, match="overlapping"):
        predict_configured(experiment, build_graph(experiment).placement, cluster)
    with pytest.raises(ConfigError, match=r"one gpt module, the vit, projector and genezip modules that feed it and "
                                          r"the video modules it conditions; this experiment has video: video"):
        workload_of(load_experiment("video"))
    unfed = load_experiment("full_graph")
    unfed.edges = [e for e in unfed.edges if e.src != "dna"]
    with pytest.raises(ConfigError, match=r"encoders whose edges lead into llm .*; dna \(genezip\) is not placed so"):
        workload_of(unfed)


def test_plan_cli_table_json_and_plot(tmp_path, capsys):
    png, report = tmp_path / "plan.png", tmp_path / "plan.json"
    assert main(["plan", "--cluster", "h100_64", "vlm_7b", "--contexts", "8192,65536", "--plot", str(png),
                 "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "context 65536: 16 sequences" in out and "best heterogeneous is" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(report.read_text())
    assert [c["context"] for c in data["contexts"]] == [8192, 65536]
    best = data["contexts"][1]["best"]["colocated"]
    assert math.prod(best["layouts"]["llm"][a] for a in ("tp", "cp", "pp", "dp")) == 64
    assert main(["plan", "vlm_7b"]) == 2
    assert "needs --cluster" in capsys.readouterr().err
    assert main(["plan", "--cluster", "h100_64", "vlm_7b", "--plot", str(png)]) == 2
    assert "give at least two" in capsys.readouterr().err


def test_calibrate_writes_a_loadable_cluster(tmp_path, capsys):
    out = tmp_path / "here.yaml"
    assert main(["plan", "--calibrate", str(out), "colocated_vlm", "world_size=2", "vision.layout.dp=2",
                 "llm.layout.tp=1", "llm.layout.dp=2", "vision.micro_batch_size=22", "--as-configured"]) == 0
    cluster = load_cluster(out)
    assert cluster.world_size == 2 and cluster.device.precision == "fp32"
    for value in (cluster.device.matmul_tflops, cluster.device.memory_gb_s, cluster.intra_node.bandwidth_gb_s):
        assert 0 < value < 1e4
    assert cluster.device.tp_layer_overhead_us >= 0
    assert 0 < cluster.host.decode_ms_per_megapixel < 1e4 and cluster.host.loader_workers == 1
    assert yaml.safe_load(out.read_text())["name"] == "here"
    assert "colocated_vlm as configured on here" in capsys.readouterr().out
    assert cluster.device.memory_gib * 2 * GIB <= 2 * 1024**4


def test_compressed_edges_shrink_boundary_and_stage_traffic():
    experiment = load_experiment("compressed_edges_vlm")
    workload = workload_of(experiment, activation_bytes=4)
    edge = experiment.edges[0].compression
    # packed codes plus one bf16 scale per block, forward and backward
    expected = sum(int(c.method[3:]) / 8 + 2 / c.block_size for c in (edge.forward, edge.backward))
    assert workload.boundary_element_bytes["vision"] == pytest.approx(expected)
    vision = workload.encoders["vision"]
    assert workload.boundary_bytes(4) == pytest.approx(workload.samples("vision") * vision.out_tokens * vision.out_width * expected)
    assert workload.stage_element_bytes is not None and workload.stage_element_bytes < 8
    model = CostModel(ClusterSpec(nodes=1, gpus_per_node=4))
    choice = Choice(pp=2, dp=2, micro=2)
    plain = model.module_cost(workload.llm, choice, 16)
    compressed = model.module_cost(workload.llm, choice, 16, hop_element_bytes=workload.stage_element_bytes)
    assert compressed.pp_s < plain.pp_s


def test_two_encoders_on_their_own_ranks_and_both_schedules_priced():
    """Non-colocated plans with two encoders (sharing their ranks, taking turns) against the LLM on the
    rest: one 1F1B over the graph prices the slower side plus the faster side's share of one microbatch;
    a configured ``phased`` schedule prices both sides in turn."""
    import dataclasses

    experiment, cluster = load_experiment("vlm_7b"), load_cluster("h100_64")
    workload = workload_of(experiment)
    workload.encoders["sketch"] = dataclasses.replace(workload.encoders["vision"], name="sketch")
    workload.per_sequence["sketch"], workload.grad_ratio["sketch"] = 0.5, 1.0
    plans = Planner(cluster, workload).plans()["non_colocated"]
    assert plans
    for plan in plans[:5]:
        assert set(plan.ranks) == {"vision", "sketch", "llm"} and plan.ranks["vision"] == plan.ranks["sketch"]
        assert plan.ranks["vision"] + plan.ranks["llm"] == 64
        sides = [plan.costs["vision"].step_s + plan.costs["sketch"].step_s, plan.costs["llm"].step_s]
        expected = max(sides) + min(sides) / plan.costs["llm"].microbatches + plan.boundary_s
        assert plan.step_s == pytest.approx(expected)

    small = ClusterSpec(nodes=1, gpus_per_node=8, device=DeviceSpec(activation_bytes=4, precision="fp32"))
    steps = {}
    for schedule in ("phased", "graph_1f1b"):
        configured = load_experiment("non_colocated_vlm", [f"schedule={schedule}"])
        plan = predict_configured(configured, build_graph(configured).placement, small)
        steps[schedule] = plan.step_s
        if schedule == "phased":
            assert plan.step_s == pytest.approx(plan.costs["vision"].step_s + plan.costs["llm"].step_s + plan.boundary_s)
    assert steps["graph_1f1b"] < steps["phased"]


def test_the_shipped_qwen_shaped_vlms_plan_on_their_clusters():
    """The GPU experiments for pretrained weights (vlm_qwen_0_5b on one 8-GPU node, vlm_qwen_7b on 64):
    every placement mode finds plans that fit, with a throughput below the peak."""
    for name, cluster_name in (("vlm_qwen_0_5b", "h100_8"), ("vlm_qwen_7b", "h100_64")):
        experiment, cluster = load_experiment(name), load_cluster(cluster_name)
        plans = Planner(cluster, workload_of(experiment)).plans()
        for mode, found in plans.items():
            assert found, (name, mode)
            assert found[0].memory_gib <= cluster.device.memory_gib
            assert 0 < found[0].tflops_per_gpu < cluster.device.peak_tflops
        plan = predict_configured(experiment, build_graph(experiment).placement, cluster)
        assert plan.step_s > 0 and plan.mode == "colocated"


def test_genezip_and_video_flops_match_torchs_counter():
    """The cost model's stacks and outer GEMMs of GeneZip (fixed routing, so the chunk counts are known;
    one and two stages) and of the video generator's training pass count exactly the FLOPs torch's counter
    sees in the real modules, but for the video's frame summaries: a forward without gradients, which
    training FLOPs leave out."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from hetero.kinds.flops import _attention_flops, counted_forward_flops
    from hetero.models.genezip.config import GeneZipConfig
    from hetero.models.genezip.model import GeneZip
    from hetero.models.video.config import VideoConfig
    from hetero.models.video.model import VideoGenerator
    from hetero.models.video.objectives import flow_matching_loss

    torch.manual_seed(0)
    for stages in (1, 2):
        config = GeneZipConfig(seq_len=256, hidden_size=32, num_heads=4, routing="fixed", target_bpt=4, stages=stages,
                               out_size=48)
        counted = counted_forward_flops(GeneZip(config), torch.randint(0, 4, (2, config.seq_len))) / 2
        assert stacked_forward_flops(describe("dna", "genezip", config)) == counted
    # The region budget's classifier (dynamic routing with two region targets) adds its own FLOPs.
    config = GeneZipConfig(seq_len=256, hidden_size=32, num_heads=4, region_bpt={"coding": 3.0, "intergenic": 6.0})
    classifier = counted_forward_flops(GeneZip(config).budget.classifier, torch.randint(0, 4, (2, config.seq_len))) / 2
    without = replace(config, region_bpt={})
    assert stacked_forward_flops(describe("dna", "genezip", config)) - stacked_forward_flops(
        describe("dna", "genezip", without)) == classifier

    config, frames = VideoConfig(frame_size=16, patch_size=4, hidden_size=32, num_heads=4, condition_size=24), 6
    attention = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops}
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=attention) as counter:
        flow_matching_loss(VideoGenerator(config), torch.rand(1, frames, 1, 16, 16), config.memory,
                           torch.Generator().manual_seed(0), torch.rand(1, 10, 24))
    summaries = 2 * frames * config.patches_per_frame * config.patch_dim * config.hidden_size
    video = describe("video", "video", config, clip_frames=frames)
    assert stacked_forward_flops(video) + summaries == counter.get_total_flops()
    assert video.seq == (2 * frames - 1) * config.patches_per_frame  # clean frames, then noisy frames 1..T-1


def test_full_graph_plans_with_a_consumer_and_the_split_search_finds_the_best_split():
    """hetero.bench.scale's full graph (vision and GeneZip into the LLM, the LLM into the video generator)
    on 256 H100s: every placement mode has plans; a non-colocated plan is three sides chained by one 1F1B
    (encoders, LLM, video), priced as such; the search's split of the ranks off the LLM between encoders
    and video (useful rank counts only) finds the best plan of an exhaustive search over every split."""
    from hetero.bench.scale import full_graph

    world = 256
    workload = workload_of(full_graph(world))
    assert list(workload.encoders) == ["vision", "dna"] and list(workload.consumers) == ["video"]
    h100 = load_cluster("h100_64")
    planner = Planner(ClusterSpec(nodes=world // 8, gpus_per_node=8, device=h100.device, intra_node=h100.intra_node,
                                  inter_node=h100.inter_node), workload)
    plans = planner.plans()
    assert all(plans.values())
    best = plans["non_colocated"][0]
    ranks = best.ranks
    assert ranks["vision"] == ranks["dna"] and ranks["vision"] + ranks["llm"] + ranks["video"] == world
    sides = [best.costs["vision"].step_s + best.costs["dna"].step_s, best.costs["llm"].step_s,
             best.costs["video"].step_s]
    assert best.step_s == pytest.approx(graph_pipeline_s(sides, best.costs["llm"].microbatches) + best.boundary_s)
    exhaustive = min(
        (plan.step_s for e in range(1, world - 1) for c in range(1, world - e)
         for choice, cost in planner.llm_options(world - e - c, 8)
         if (plan := planner.three_sides(world, e, c, choice, cost)) is not None),
    )
    assert best.step_s == exhaustive
    for plan in plans["homogeneous"][:3]:  # the video runs inside the LLM's last stage, on its grid
        assert plan.choices["video"] == plan.choices["llm"] and "video" in plan.folded


def test_predict_configured_full_graphs():
    """The shipped full graphs as configured: non-colocated (encoders, LLM, video on three sets of ranks)
    and colocated (all on every rank)."""
    cluster = ClusterSpec(nodes=1, gpus_per_node=8, device=DeviceSpec(activation_bytes=4, precision="fp32"))
    experiment = load_experiment("full_graph")
    plan = predict_configured(experiment, build_graph(experiment).placement, cluster)
    assert plan.mode == "non_colocated"
    sides = [plan.costs["vision"].step_s + plan.costs["dna"].step_s, plan.costs["llm"].step_s, plan.costs["video"].step_s]
    assert plan.step_s == pytest.approx(graph_pipeline_s(sides, plan.costs["llm"].microbatches) + plan.boundary_s)
    experiment = load_experiment("full_graph_colocated")
    assert predict_configured(experiment, build_graph(experiment).placement, cluster).mode in ("colocated", "colocated_1f1b")


def test_a_frozen_module_is_priced_as_what_it_runs():
    """LLaVA's stage 1: the tower forward only, the LLM forward and its inputs' gradients (to the trained
    projector), neither with gradient sync, optimizer or gradients in memory."""
    trained = workload_of(load_experiment("own_data_vlm"))
    frozen = workload_of(load_experiment("own_data_vlm", ["vision.trainable=false", "llm.trainable=false"]))
    assert [(m.name, m.training) for m in (frozen.llm, *frozen.others.values())] == [
        ("llm", "inputs"), ("vision", "forward"), ("projector", "full")]
    model = CostModel(ClusterSpec(nodes=1, gpus_per_node=8))
    choice = Choice(tp=2, dp=2)
    for name, passes in (("vision", 1), ("llm", 2), ("projector", 3)):
        def cost(workload):
            module = workload.llm if name == "llm" else workload.others[name]
            return module, model.module_cost(module, choice, 16)
        (module, full), (frozen_module, part) = cost(trained), cost(frozen)
        assert frozen_module.model_flops_per_sample == pytest.approx(module.model_flops_per_sample * passes / 3)
        if passes == 3:
            assert part == full
            continue
        assert part.dp_s == part.optimizer_s == 0 < full.dp_s and part.compute_s < full.compute_s
        assert part.memory_bytes < full.memory_bytes
        assert part.tp_s == pytest.approx(full.tp_s * (0.5 if passes == 1 else 1.0), rel=0.05)


def test_an_encoder_computing_ahead_hides_its_fill():
    """``parallel.forward_ahead`` on the frozen tower of the non-colocated VLM: its first microbatches are
    ready when the step starts, so the step loses the tower side's share of one microbatch, and only
    where the tower runs forward only."""
    cluster = ClusterSpec(nodes=1, gpus_per_node=8)
    frozen = ["vision.trainable=false"]

    def step(*overrides):
        experiment = load_experiment("non_colocated_vlm", list(overrides))
        return predict_configured(experiment, build_graph(experiment).placement, cluster)

    plain, ahead = step(*frozen), step(*frozen, "vision.parallel.forward_ahead=2")
    fill = plain.costs["vision"].step_s / plain.costs["llm"].microbatches
    assert plain.costs["vision"].step_s < plain.costs["llm"].step_s
    assert plain.step_s - ahead.step_s == pytest.approx(fill)


def test_parameters_frozen_by_glob_are_priced_by_their_share():
    """``frozen`` globs: the weights' gradients, their sync, optimizer state and update only for the share
    of parameters that train (here the LLM's embeddings and first block), between the whole module
    trained and frozen with its inputs' gradients."""
    globbed = workload_of(load_experiment("own_data_vlm", ["llm.frozen=[tok_embeddings.*,layers.0.*]"]))
    frozen = workload_of(load_experiment("own_data_vlm", ["llm.trainable=false"]))
    trained = workload_of(load_experiment("own_data_vlm"))
    share = globbed.llm.trained_share
    assert 0.2 < share < 0.8 and trained.llm.trained_share == 1.0
    model, choice = CostModel(ClusterSpec(nodes=1, gpus_per_node=8)), Choice(tp=2, dp=2)
    full, part, none = (model.module_cost(w.llm, choice, 16) for w in (trained, globbed, frozen))
    assert part.dp_s == pytest.approx(share * full.dp_s) and part.optimizer_s == pytest.approx(share * full.optimizer_s)
    assert none.compute_s < part.compute_s < full.compute_s
    assert none.memory_bytes < part.memory_bytes < full.memory_bytes
    assert globbed.llm.model_flops_per_sample == pytest.approx(trained.llm.model_flops_per_sample * (2 + share) / 3)


def test_the_megatron_style_baseline_splits_evenly_and_plan_takes_any_world_size(capsys):
    """``megatron``: the homogeneous grid with the LLM's layers split evenly, never faster than the tuned
    split, and each gain line names its baseline. ``--gpus 17``: two nodes of 8 and one device more."""
    cluster = load_cluster("h100_64")
    plans = Planner(cluster, workload_of(load_experiment("vlm_7b"))).plans()
    even, tuned = plans["megatron"][0], plans["homogeneous"][0]
    assert even.mode == "megatron" and even.step_s >= tuned.step_s
    assert all(p.costs["llm"].step_s > 0 for p in plans["megatron"])
    assert heterogeneous_gain(plans, "megatron") >= heterogeneous_gain(plans, "homogeneous")
    assert main(["plan", "--cluster", "h100_64", "--gpus", "17", "vlm_7b"]) == 0
    out = capsys.readouterr().out
    assert "on 17 devices" in out and "llm[16]" in out  # a 17-way homogeneous grid fits nothing here
    assert main(["plan", "--cluster", "h100_64", "vlm_7b"]) == 0
    out = capsys.readouterr().out
    assert "the throughput of the Megatron-style baseline (every module on the LLM's grid" in out
    assert "the throughput of the best homogeneous plan (its first stage's layers tuned)" in out


def test_gemm_efficiency_by_shape_is_the_padded_tiles_and_the_sms_they_occupy():
    device = DeviceSpec(matmul_tflops=1.0, matmul_overhead_us=0.0, sms=4, gemm_tile=128, attention_head_tile=32)
    model = CostModel(ClusterSpec(device=device))
    # 100 x 300 output: 1 x 3 tiles of 128², 3 of 4 SMs busy
    assert model.gemm_efficiency(100, 300) == pytest.approx(100 * 300 / (3 * 128 * 128) * 3 / 4)
    assert model.gemm_s(100, 64, 300) == pytest.approx(2 * 100 * 64 * 300 / 1e12 / model.gemm_efficiency(100, 300))
    assert model.gemm_efficiency(512, 256) == 1.0  # 4 x 2 whole tiles fill the 4 SMs twice
    assert CostModel(ClusterSpec(device=replace(device, sms=0))).gemm_efficiency(100, 300) == 1.0
    # attention heads of 72 run as 96 in a kernel built for steps of 32
    assert model.attention_s(1e12, head_dim=72) == pytest.approx(96 / 72)
    assert model.attention_s(1e12, head_dim=64) == pytest.approx(1.0)


def test_a_set_head_dim_is_what_the_cost_model_prices():
    config = GPTConfig(vocab_size=1000, hidden_size=512, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=256,
                       ffn_hidden_size=1024, seq_len=128)
    module = describe("llm", "gpt", config)
    assert module.head_dim == 256
    # q (512 -> 4·256), k and v (512 -> 2·256), o (4·256 -> 512), SwiGLU (3 · 512 · 1024)
    assert module.layer_params == 512 * 1024 + 2 * 512 * 512 + 1024 * 512 + 3 * 512 * 1024
    assert describe("llm", "gpt", replace(config, head_dim=None)).head_dim == 128


def test_the_bridge_comparison_prices_the_published_layouts():
    from hetero.plan.published import BASELINE_GPUS, HETERO_GPUS, PUBLISHED, compare, report

    cluster = load_cluster("h100_64")
    row = compare(cluster, 2048, 32)
    llm = row.megatron.choices["llm"]
    assert (llm.tp, llm.cp, llm.pp, llm.dp) == (4, 1, 2, 2) and row.megatron.ranks["llm"] == BASELINE_GPUS
    assert row.hetero.ranks == {"vision": 1, "llm": BASELINE_GPUS}
    assert row.megatron.step_s > row.tuned.step_s > row.llm_alone.step_s  # the encoder costs stage 0 time
    assert row.gain(row.megatron) == pytest.approx(row.megatron.step_s * 16 / (row.hetero.step_s * HETERO_GPUS) - 1)
    text = report(cluster)
    assert sum(line.startswith(f"| {seq}, {gbs} |") for seq, gbs in PUBLISHED for line in text.splitlines()) == 10  # gains, decomposition, 4096 with scaled images


def test_the_sweep_finds_the_encoder_the_baseline_cannot_shard():
    from hetero.plan.sweep import Result, points

    cluster = load_cluster("h100_64")
    found = {(p.axis, p.value): p for p in points()}
    assert all(p.workload.sequences & (p.workload.sequences - 1) == 0 for p in found.values())  # powers of two
    # InternViT-6B's 25 heads: no TP degree divides them, so on the LLM's grid the tower runs unsharded
    wide = Result(found["encoder size", "5.9B"], Planner(cluster, found["encoder size", "5.9B"].workload).plans())
    assert wide.plans["megatron"][0].choices["vision"].tp == 1
    assert wide.gain > 1.5 and wide.region == ">= +50%"
    small = Result(found["encoder size", "0.4B"], Planner(cluster, found["encoder size", "0.4B"].workload).plans())
    assert small.region == "< +20%"


def test_a_boundary_is_a_pipeline_stage_of_its_own():
    # encoder 1 s, LLM 4 s a step, 4 microbatches: the link's 0.5 s hides but for one microbatch's share
    assert linked_pipeline_s([1.0, 4.0], [0.5], 4) == pytest.approx((4 + 1.5 / 4, 0.5 / 4))
    # a link slower than both sides sets the pace
    assert linked_pipeline_s([1.0, 4.0], [8.0], 4) == pytest.approx((8 + 5 / 4, 8 + 5 / 4 - (4 + 1 / 4)))
    assert linked_pipeline_s([1.0, 4.0, 2.0], [None, 0.4], 2)[0] == pytest.approx(4 + 3.4 / 2)


def test_image_decoding_beside_the_step_bounds_the_ranks_that_decode():
    from hetero.plan.published import LLM_LAYOUT, bridge_workload

    cluster = load_cluster("h100_64")
    assert (cluster.host.decode_ms_per_megapixel, cluster.host.loader_workers) == (12, 8)
    slow = replace(cluster, nodes=3, gpus=17, host=replace(cluster.host, decode_ms_per_megapixel=1000.0))
    free = replace(slow, host=replace(slow.host, decode_ms_per_megapixel=0.0))
    workload = bridge_workload(2048, 32)  # 32 images of 992 x 992 px a step
    megapixels = 992 * 992 / 1e6
    plans = {}
    for name, spec in (("slow", slow), ("free", free)):
        planner = Planner(spec, workload)
        choice, cost = next((c, m) for c, m in planner.llm_options(16)
                            if (c.tp, c.pp, c.dp) == (LLM_LAYOUT.tp, LLM_LAYOUT.pp, LLM_LAYOUT.dp))
        plans[name] = planner.three_sides(17, 1, 0, choice, cost)
    # the encoder's one rank decodes all 32 images in its 8 workers: 3.97 s, longer than either side's step
    assert plans["slow"].host_s == pytest.approx(32 * megapixels * 1.0 / 8)
    assert plans["free"].host_s == 0 and plans["free"].step_s < plans["slow"].host_s
    assert plans["slow"].step_s >= plans["slow"].host_s
    # on the LLM's grid (dp2) stage 0's ranks decode their replica's 16 images
    megatron = Planner(replace(slow, nodes=2, gpus=16), workload).homogeneous(16, even=True)
    at_dp2 = [p for p in megatron if p.choices["llm"].dp == 2][0]
    assert at_dp2.host_s == pytest.approx(16 * megapixels / 8) and at_dp2.step_s >= at_dp2.host_s
    with pytest.raises(ConfigError, match=r"host.loader_workers=0 must be at least 1"):
        cluster_from_dict({"host": {"loader_workers": 0}})
    with pytest.raises(ConfigError, match=r"host: unknown field\(s\) workers"):
        cluster_from_dict({"host": {"workers": 2}})


def test_native_resolution_prices_memory_at_the_largest_image_and_time_at_the_typical_one():
    from hetero.plan.published import qwen3_vl_encoder

    model = CostModel(load_cluster("h100_64"))
    typical = describe("vision", "vit", qwen3_vl_encoder(5120))  # 62 x 62 patches
    native = describe("vision", "vit", qwen3_vl_encoder(5120, max_patches=4 * 3844))
    assert (native.seq, native.peak_seq) == (3844, 4 * 3844) and typical.peak_seq == 0
    for recompute in (False, True):
        choice = Choice(1, 1, 1, 1, 2, recompute)
        small, large = model.module_cost(typical, choice, 8), model.module_cost(native, choice, 8)
        assert large.step_s == small.step_s
        saved = 1152 if recompute else 7 * 1152 + 2 * 4304  # per token of a layer, bf16
        held = 27 * saved if not recompute else 27 * saved + 7 * 1152 + 2 * 4304  # + one layer recomputed
        assert large.memory_bytes - small.memory_bytes == pytest.approx(2 * 3 * 3844 * held * 2)
