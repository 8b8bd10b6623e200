"""Nothing the runtime or a module kind creates in a step lands on an implicit default device: with the
default device set to ``meta`` (where any tensor made without an explicit device would go, and fail to
mix with real ones), training steps and an evaluation give exactly the losses of a run without it. Three
graphs on 2 ranks cover every kind, compressed edges and stage links, compressed gradient syncs, TP, CP,
PP and FSDP2."""

import torch

from hetero.config import OptimizerConfig
from hetero.parallel.compression.config import CompressionConfig, CompressorConfig
from hetero.parallel.compression.edge_config import ActivationCodecConfig, EdgeCompressionConfig
from hetero.parallel.options import ParallelOptions
from hetero.testing.kinds import build_runtime
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks
from test_graph_parity import DNA, LLM, VIDEO, VISION, batches as graph_batches
from test_gpt_parity import CONFIG as GPT, batches as gpt_batches

INT8 = CompressionConfig(grad=CompressorConfig(method="int8"))
EDGE = EdgeCompressionConfig(ActivationCodecConfig("int8", block_size=32), ActivationCodecConfig("int8", block_size=32), "none")


def graphs():
    """(experiment, batches) of each case."""
    full = {"vision": module("vit", VISION, {"dp": 2}, parallel=ParallelOptions(fsdp=True)),
            "llm": module("gpt", LLM, {"tp": 2}), "dna": module("genezip", DNA, {"tp": 2}),
            "video": module("video", VIDEO, {"dp": 2}, compression=INT8)}
    edges = [{"src": "vision", "dst": "llm", "compression": EDGE}, ("dna", "llm"), ("llm", "video")]
    yield experiment(2, full, edges=edges, global_batch=8, microbatches=2, grad_clip=0.5, seed=3), graph_batches(8, 3)
    long_context = {"llm": module("gpt", GPT, {"cp": 2}, OptimizerConfig(lr=1e-2))}
    yield experiment(2, long_context, global_batch=8, microbatches=2), gpt_batches(GPT, 3)
    pipeline = CompressionConfig(pipeline=EDGE)
    pipelined = {"llm": module("gpt", GPT, {"pp": 2}, OptimizerConfig(lr=1e-2), compression=pipeline)}
    yield experiment(2, pipelined, global_batch=8, microbatches=4), gpt_batches(GPT, 3)


def losses(config, data, default_device):
    runtime = build_runtime(config)
    out = []
    torch.set_default_device(default_device)
    try:
        for batch in data[:2]:
            metrics = runtime.train_step(batch)
            out.append((metrics["loss"], metrics["grad_norm"]))
        out.append(runtime.evaluate(data[2:]))
    finally:
        torch.set_default_device(None)
    return out


def both_ways(rank, world_size):
    return [(losses(config, data, None), losses(config, data, "meta")) for config, data in graphs()]


def test_steps_create_nothing_on_the_default_device():
    for rank_results in run_ranks(both_ways, 2, timeout_s=300):
        for plain, meta in rank_results:
            assert plain == meta


def fused_and_not(rank, world_size):
    """The full graph's first case (TP's DTensor parameters, FSDP2's sharded ones, plain ones) stepped by
    the fused AdamW the runtime picks on CUDA (it runs on the CPU too) and by the default one."""
    from hetero.runtime.module import build_adamw

    config, data = next(graphs())
    out = []
    for fused in (False, True):
        runtime = build_runtime(config)
        for state in runtime.modules.values():
            state.optimizer = build_adamw(state.model, state.node.settings.optim, fused=fused)
        out.append([runtime.train_step(batch)["loss"] for batch in data[:3]])
    return out


def test_fused_adamw_steps_every_kind_of_parameter_alike():
    for plain, fused in run_ranks(fused_and_not, 2, timeout_s=300):
        assert plain[0] == fused[0]  # the first loss comes before any update
        for a, b in zip(plain[1:], fused[1:]):
            assert abs(a - b) <= 1e-5 * abs(b), (plain, fused)
