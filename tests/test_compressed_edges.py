"""Compressed pipeline and boundary edges on real gloo ranks.

- The identity codec gives results bitwise equal to the uncompressed path (LM pp2; VLM graph pipeline and
  phased schedule), through the runtime.
- Integer payloads (int2/int4 codes with bf16 scales, top-k values and indices) cross boundaries between
  different layouts: every destination shard equals the single-process decode of the whole tensor, sliced
  by the test's own indexing, and so does every source rank's gradient.
- Lossy codecs with compensation match a single-process emulation: the same model in one process with the
  same edge ends applied where the stages meet (``EdgeFunction``), losses and gradients within 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from boundary_oracle import reference_indices, take
from test_vlm_parity import CLIP, LLM, OPTIM, VISION, batches, reference

from hetero.models.gpt.model import GPT, token_loss_sum
from hetero.models.gpt.config import GPTConfig
from hetero.testing.references import VisionLanguageModel
from hetero.parallel.boundary import Sharding, Side, TensorSpec
from hetero.parallel.compressed_boundary import CompressedBoundary
from hetero.parallel.compression.activation_codecs import build_activation_codec, payload_bytes
from hetero.parallel.compression.config import CompressionConfig
from hetero.parallel.compression.edge import EdgeEnd
from hetero.parallel.compression.edge_config import ActivationCodecConfig, EdgeCompressionConfig
from hetero.config import CheckpointConfig, OptimizerConfig
from hetero.testing.kinds import build_graph
from hetero.parallel.layout import Layout
from hetero.testing.kinds import build_runtime
from hetero.runtime.module import build_adamw
from hetero.testing.experiments import experiment, module, module_grads
from hetero.testing.multiprocess import run_ranks
from hetero.train.checkpoint import Checkpointer
from hetero.train.job import run_identity

GPT_CONFIG = GPTConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, seq_len=16)
BATCH, MICRO, STEPS, REUSE, SEED = 8, 2, 6, 2, 3
OPTIM_LM = OptimizerConfig(lr=1e-2, warmup_steps=2)


def edge(forward: str, backward: str, compensation: str = "lazy", refresh: str = "none",
         **codec) -> EdgeCompressionConfig:
    return EdgeCompressionConfig(
        ActivationCodecConfig(forward, **codec), ActivationCodecConfig(backward, **codec), compensation,
        ActivationCodecConfig(refresh, **codec),
    )


def lm_batches(steps: int = STEPS) -> list[dict[str, torch.Tensor]]:
    """A fresh batch every ``REUSE`` steps (lazy sampling), the same one in between."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for step in range(steps):
        if step % REUSE == 0:
            tokens = torch.randint(0, GPT_CONFIG.vocab_size, (BATCH, GPT_CONFIG.seq_len + 1), generator=gen)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
    return out


def lm_config(edge_config: EdgeCompressionConfig | None):
    compression = CompressionConfig(pipeline=edge_config) if edge_config is not None else CompressionConfig()
    blocks = {"llm": module("gpt", GPT_CONFIG, {"pp": 2}, OPTIM_LM, compression=compression)}
    return experiment(2, blocks, global_batch=BATCH, microbatches=BATCH // MICRO, seed=SEED,
                      train={"sample_reuse": REUSE})


def train_lm(rank: int, world_size: int, edge_config: EdgeCompressionConfig | None) -> tuple[list[float], dict, dict]:
    runtime = build_runtime(lm_config(edge_config))
    losses, grads = [], {}
    for step, batch in enumerate(lm_batches()):
        losses.append(runtime.train_step(batch)["loss"])
        if step == 0:
            grads = {k.removeprefix("llm."): v for k, v in module_grads(runtime).items()}
    return losses, grads, runtime.links["llm"].sent_bytes


def lm_identity_versus_plain(rank: int, world_size: int) -> tuple[bool, bool]:
    plain = train_lm(rank, world_size, None)
    identity = train_lm(rank, world_size, edge("identity", "identity"))
    same_grads = plain[1].keys() == identity[1].keys() and all(
        torch.equal(plain[1][k], identity[1][k]) for k in plain[1]
    )
    return plain[0] == identity[0], same_grads, plain[2], identity[2]


def test_identity_codec_is_bitwise_the_uncompressed_pipeline():
    fp32 = STEPS * (BATCH // MICRO) * MICRO * GPT_CONFIG.seq_len * GPT_CONFIG.hidden_size * 4
    sent = [{"forward": fp32, "backward": 0}, {"forward": 0, "backward": fp32}]  # stage 0, stage 1
    for rank, (same_losses, same_grads, plain_bytes, identity_bytes) in enumerate(
        run_ranks(lm_identity_versus_plain, 2, timeout_s=300)
    ):
        assert same_losses and same_grads
        assert plain_bytes == identity_bytes == sent[rank]


class EdgeFunction(torch.autograd.Function):
    """Both ends of a compressed edge in one process: forward through the codec, gradients back through it."""

    @staticmethod
    def forward(ctx, x, upstream: EdgeEnd, downstream: EdgeEnd, microbatch: int):  # type: ignore[override]
        ctx.ends, ctx.microbatch = (upstream, downstream), microbatch
        parts = upstream.encode_forward(microbatch, x)
        return downstream.decode_forward(microbatch, parts, x.shape[-1]).clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        upstream, downstream = ctx.ends
        parts = downstream.encode_backward(ctx.microbatch, grad.contiguous())
        return upstream.decode_backward(ctx.microbatch, parts, grad.shape[-1]), None, None, None


def edge_ends(config: EdgeCompressionConfig) -> tuple[EdgeEnd, EdgeEnd]:
    return EdgeEnd(config, "upstream"), EdgeEnd(config, "downstream")


def begin(ends, rows: list[torch.Tensor], step: int, sample_ids=None) -> None:
    for end in ends:
        end.begin_step(rows, step % REUSE == 0, sample_ids)


def lm_emulation(edge_config: EdgeCompressionConfig) -> tuple[list[float], dict]:
    """The GPT in one process, microbatch by microbatch, with the edge applied after its first layer."""
    torch.manual_seed(SEED)
    model = GPT(GPT_CONFIG)
    optimizer = build_adamw(model, OPTIM_LM)
    ends = edge_ends(edge_config)
    current = {}
    model.layers["0"].register_forward_hook(lambda module, args, out: EdgeFunction.apply(out, *ends, current["mb"]))
    losses, grads = [], {}
    for step, batch in enumerate(lm_batches()):
        tokens, labels = batch["tokens"], batch["labels"]
        begin(ends, list(torch.arange(BATCH).split(MICRO)), step)
        optimizer.zero_grad()
        total = 0.0
        for mb, (x, y) in enumerate(zip(tokens.split(MICRO), labels.split(MICRO))):
            current["mb"] = mb
            loss = token_loss_sum(model(x), y) / tokens.numel()
            loss.backward()
            total += loss.item()
        if step == 0:
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        for group in optimizer.param_groups:
            group["lr"] = OPTIM_LM.lr_at(step)
        optimizer.step()
        losses.append(total)
    return losses, grads


def assert_matches(losses, grads, ref_losses, ref_grads) -> None:
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: loss {got} vs {want}"
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():
        error = ((grad - ref_grads[name]).norm() / ref_grads[name].norm()).item()
        assert error <= 1e-5, f"{name}: relative gradient error {error:.1e}"


@pytest.mark.parametrize(
    "forward,backward,compensation,refresh",
    [("int2", "int4", "lazy", "int4"), ("topk", "int8", "lazy", "none"), ("int4", "bf16", "none", "none")],
)
def test_compressed_pipeline_matches_one_process_emulation(forward, backward, compensation, refresh):
    config = edge(forward, backward, compensation, refresh)
    ref_losses, ref_grads = lm_emulation(config)
    plain_losses, _ = lm_emulation(edge("identity", "identity"))
    results = run_ranks(train_lm, 2, config, timeout_s=300)
    grads = results[0][1] | results[1][1]
    assert results[0][0] == results[1][0]
    assert_matches(results[0][0], grads, ref_losses, ref_grads)
    assert ref_losses != plain_losses  # the codec changed training: the comparison is not vacuous
    # bytes per edge and direction: each microbatch's payload, in the refresh codec on a batch's first step
    shape = (MICRO, GPT_CONFIG.seq_len, GPT_CONFIG.hidden_size)
    forward_codec = build_activation_codec(config.forward)
    refresh_codec = build_activation_codec(config.refresh) if refresh != "none" else forward_codec
    fresh_steps = sum(step % REUSE == 0 for step in range(STEPS))
    microbatches = BATCH // MICRO
    forward = microbatches * (fresh_steps * payload_bytes(refresh_codec, shape)
                              + (STEPS - fresh_steps) * payload_bytes(forward_codec, shape))
    backward = STEPS * microbatches * payload_bytes(build_activation_codec(config.backward), shape)
    assert results[0][2] == {"forward": forward, "backward": 0}
    assert results[1][2] == {"forward": 0, "backward": backward}


def train_lm_with_resume(rank: int, world_size: int, edge_config: EdgeCompressionConfig, directory: str) -> list[float]:
    """Save after step 3 (inside a lazy reuse window: the compensation state crosses the checkpoint),
    resume in a fresh runtime, train on."""
    config = lm_config(edge_config)
    checkpoints = Checkpointer(CheckpointConfig(every=1), Path(directory), run_identity(config, build_graph(config)))
    data, cut = lm_batches(), 3
    first = build_runtime(config)
    losses = [first.train_step(batch)["loss"] for batch in data[:cut]]
    checkpoints.save(first, cut)
    checkpoints.close()
    second = build_runtime(config)
    checkpoints.load(second, Path(directory) / f"step_{cut:06d}", same_local=True)
    return losses + [second.train_step(batch)["loss"] for batch in data[cut:]]


def test_resumed_compressed_pipeline_continues_bitwise(tmp_path):
    config = edge("int2", "int4", refresh="int4")
    straight = run_ranks(train_lm, 2, config, timeout_s=300)[0][0]
    resumed = run_ranks(train_lm_with_resume, 2, config, str(tmp_path), timeout_s=300)
    assert resumed[0] == resumed[1] == straight


# ---------------------------------------------------------------------------------- the VLM


def vlm_train(rank, world_size, layouts, microbatches, config: EdgeCompressionConfig | None, steps: int):
    pipeline = {"compression": CompressionConfig(pipeline=config)} if config is not None else {}
    modules = {"vision": module("vit", VISION, layouts["vision"], OPTIM["vision"]),
               "llm": module("gpt", LLM, layouts["llm"], OPTIM["llm"], **pipeline)}
    edges = [{"src": "vision", "dst": "llm"} | ({"compression": config} if config is not None else {})]
    runtime = build_runtime(experiment(world_size, modules, edges=edges, global_batch=BATCH, microbatches=microbatches,
                                       grad_clip=CLIP, train={"sample_reuse": REUSE}))
    losses, grads = [], {}
    for step, batch in enumerate(vlm_batches(steps)):
        losses.append(runtime.train_step(batch)["loss"])
        if step == 0:
            grads = module_grads(runtime)
    return losses, grads


def vlm_batches(steps: int) -> list[dict]:
    fresh = batches(BATCH)
    return [fresh[step // REUSE] for step in range(steps)]


def vlm_identity_versus_plain(rank, world_size, layouts, microbatches) -> tuple[bool, bool]:
    plain = vlm_train(rank, world_size, layouts, microbatches, None, 3)
    identity = vlm_train(rank, world_size, layouts, microbatches, edge("identity", "identity"), 3)
    return plain[0] == identity[0], all(torch.equal(plain[1][k], identity[1][k]) for k in plain[1])


VLM_LAYOUTS = {
    "graph pipeline vision dp2 (0-1), llm pp2 (2-3)": ({"vision": {"dp": 2}, "llm": {"pp": 2, "offset": 2}}, 4),
    "phased colocated vision dp2, llm tp2 (0-1)": ({"vision": {"dp": 2}, "llm": {"tp": 2}}, 2),
}


@pytest.mark.parametrize("case", list(VLM_LAYOUTS))
def test_identity_codec_is_bitwise_the_uncompressed_boundary(case):
    layouts, world_size = VLM_LAYOUTS[case]
    for same_losses, same_grads in run_ranks(vlm_identity_versus_plain, world_size, layouts, 2, timeout_s=300):
        assert same_losses and same_grads


def vlm_emulation(config: EdgeCompressionConfig, steps: int) -> tuple[list[float], dict]:
    """The whole VLM in one process with edges after the encoder and after the LLM's first layer. The
    global batch runs as one pass: each edge row is keyed by its global row, as the runtime keys it."""
    model = VisionLanguageModel(VISION, LLM, seed=0)
    boundary, stages = edge_ends(config), edge_ends(config)
    model.vision.register_forward_hook(lambda module, args, out: EdgeFunction.apply(out, *boundary, 0))
    model.llm.layers["0"].register_forward_hook(lambda module, args, out: EdgeFunction.apply(out, *stages, 0))
    record = reference(BATCH, model, vlm_batches(steps), lambda step: begin(boundary + stages, [torch.arange(BATCH)], step))
    return [losses[0] for losses in record.losses], record.grads


def test_compressed_graph_pipeline_matches_one_process_emulation():
    """Vision dp2 on ranks 0-1 feeding an LLM pp2 on ranks 2-3: int2 forward (bf16 on a fresh batch's first
    step, which crosses on a boundary of its own), int4 backward, lazy compensation on the boundary and on
    the LLM's stage edge."""
    config = edge("int2", "int4", refresh="bf16", block_size=32)
    layouts, world_size = VLM_LAYOUTS["graph pipeline vision dp2 (0-1), llm pp2 (2-3)"]
    ref_losses, ref_grads = vlm_emulation(config, STEPS)
    assert ref_losses != vlm_emulation(edge("identity", "identity"), STEPS)[0]  # not vacuous
    results = run_ranks(vlm_train, world_size, layouts, 2, config, STEPS, timeout_s=300)
    grads = {}
    for _, rank_grads in results:
        grads.update(rank_grads)
    assert_matches(results[0][0], grads, ref_losses, ref_grads)


# ------------------------------------------------------------------- payloads across layouts


def layout(ranks, **degrees) -> Layout:
    return Layout(tp=degrees.get("tp", 1), cp=degrees.get("cp", 1), dp=degrees.get("dp", 1), pp=1,
                  ranks=tuple(ranks))


PAYLOAD_CASES = {
    "dp2 (0-1) to tp2 (2-3)": (layout([0, 1], dp=2), layout([2, 3], tp=2), Sharding(0, None), Sharding(0, None), 4),
    "dp2 (0-1) to cp2·dp1 (2-3), sequence split": (
        layout([0, 1], dp=2), layout([2, 3], cp=2), Sharding(0, None), Sharding(0, 1, zigzag=False), 4),
    "dp1 (0) to dp3 (0-2), colocated": (layout([0]), layout([0, 1, 2], dp=3), Sharding(0, None), Sharding(0, None), 3),
    "tp2 (0-1) to dp2 (1-2), overlapping": (layout([0, 1], tp=2), layout([1, 2], dp=2), Sharding(0, None),
                                            Sharding(0, None), 3),
}
SHAPE = (6, 4, 64)


def payload_crossing(rank, world_size, source, destination, src_sharding, dst_sharding, codecs):
    """Send a global tensor through compressed boundaries (one per codec) and return, per codec, whether
    every shard and every gradient equals the single-process decode of the whole tensor."""
    out = {}
    for method in codecs:
        config = edge(method, method, "none", block_size=32)
        spec = TensorSpec(ndim=3, source=src_sharding, destination=dst_sharding)
        boundary = CompressedBoundary(f"payload-{method}", Side(source), Side(destination), spec, SHAPE[-1], config)
        codec = build_activation_codec(config.forward)
        x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(11))
        g = torch.randn(SHAPE, generator=torch.Generator().manual_seed(12))
        expected_x = codec.decode(codec.encode(x), SHAPE[-1])
        expected_g = codec.decode(codec.encode(g), SHAPE[-1])
        src_index = reference_indices(SHAPE, src_sharding, source, rank) if rank in source.ranks else None
        dst_index = reference_indices(SHAPE, dst_sharding, destination, rank) if rank in destination.ranks else None
        rows = [torch.arange(SHAPE[0])]
        boundary.begin_step(rows, rows, True)
        got_x = boundary.forward(0, take(x, src_index) if src_index else None, SHAPE)
        got_g = boundary.backward(0, take(g, dst_index) if dst_index else None, SHAPE)
        checks = []
        if dst_index:
            checks.append(torch.equal(got_x, take(expected_x, dst_index)))
        if src_index:
            checks.append(torch.equal(got_g, take(expected_g, src_index)))
        out[method] = all(checks)
    return out


@pytest.mark.parametrize("case", list(PAYLOAD_CASES))
def test_integer_payloads_cross_between_layouts(case):
    source, destination, src_sharding, dst_sharding, world_size = PAYLOAD_CASES[case]
    codecs = ["int2", "int4", "int8", "topk", "bf16"]
    for rank, result in enumerate(run_ranks(payload_crossing, world_size, source, destination, src_sharding,
                                             dst_sharding, codecs, timeout_s=300)):
        assert all(result.values()), f"rank {rank}: {result}"
