"""How well the planner, calibrated on this machine, predicts what its layouts measure here.

    hetero bench plan-accuracy [--steps 20] [--rounds 3]

The cost model is calibrated on 2 ranks (``hetero.plan.calibrate``); then each 2-rank configuration of
one vision-language model is predicted as configured (``hetero.plan.search.predict_configured``) and
measured with the throughput benchmark's ranks (``hetero.bench.throughput.measure``). Rounds alternate
the configurations so that machine noise falls on all of them; a configuration's measured step time is
the median over rounds of its median step in a round, and its measured ratio to the first configuration
the median over rounds of that ratio within a round. The table gives predicted and measured step times
and each configuration's step time relative to the first, predicted against measured. Starting each
configuration's two ranks costs more than its steps, so 20 timed steps add little time; with 6, one
round's noise moved single ratios by up to 20% here.
"""

from __future__ import annotations

import argparse
import statistics

from hetero.bench.throughput import absolute_paths, ensure_shards, measure
from hetero.config import load_experiment
from hetero.graph import build_graph
from hetero.models import default_registry
from hetero.plan.calibrate import calibrate
from hetero.plan.search import predict_configured
from hetero.testing.multiprocess import run_ranks

# colocated_vlm made heavier, so that compute outweighs per-op overheads: a 4-layer, 256-wide LLM over
# 16 image patches + caption, a 4-layer ViT; 16 samples per step.
MODEL = [
    "world_size=2", "batch.global_batch_size=16",
    "vision.model.patch_size=8", "vision.model.hidden_size=128", "vision.model.num_layers=4", "vision.model.out_size=256",
    "llm.model.hidden_size=256", "llm.model.num_layers=4", "llm.model.num_heads=8", "llm.model.seq_len=64",
]
CONFIGS = {
    "colocated: vision dp2, llm dp2": [
        "vision.layout.dp=2", "llm.layout.tp=1", "llm.layout.dp=2", "batch.micro_batch_size=8", "vision.micro_batch_size=8",
    ],
    "non-colocated: vision rank 0, llm rank 1, phased": [
        "placement=non_colocated", "vision.layout.dp=1", "vision.layout.offset=0", "llm.layout.tp=1",
        "llm.layout.dp=1", "llm.layout.offset=1", "batch.micro_batch_size=4", "vision.micro_batch_size=4",
        "schedule=phased",
    ],
    "non-colocated: vision rank 0, llm rank 1, graph_1f1b": [
        "placement=non_colocated", "vision.layout.dp=1", "vision.layout.offset=0", "llm.layout.tp=1",
        "llm.layout.dp=1", "llm.layout.offset=1", "batch.micro_batch_size=4", "vision.micro_batch_size=4",
        "schedule=graph_1f1b",
    ],
    "colocated: vision dp2 merging 2x2 patches, llm dp2": [
        "vision.layout.dp=2", "llm.layout.tp=1", "llm.layout.dp=2", "batch.micro_batch_size=8", "vision.micro_batch_size=8",
        "+vision.model.merge=2", "+vision.model.projector=false", "+vision.model.class_token=false",
    ],
    "Megatron-style: vision on llm stage 0 (rank 0), llm pp2": [
        "placement=auto", "vision.layout.dp=1", "vision.layout.offset=0", "llm.layout.tp=1", "llm.layout.dp=1",
        "llm.layout.pp=2", "llm.layout.offset=0", "batch.micro_batch_size=4", "vision.micro_batch_size=4",
        "schedule=graph_1f1b",
    ],
    "colocated: vision dp2, llm tp2": [
        "vision.layout.dp=2", "llm.layout.tp=2", "llm.layout.dp=1", "batch.micro_batch_size=16", "vision.micro_batch_size=8",
    ],
    "colocated: vision dp2, llm pp2, phased": [
        "vision.layout.dp=2", "llm.layout.tp=1", "llm.layout.dp=1", "llm.layout.pp=2", "batch.micro_batch_size=4",
        "vision.micro_batch_size=2", "schedule=phased",
    ],
    "colocated: vision dp2, llm pp2, graph_1f1b": [
        "vision.layout.dp=2", "llm.layout.tp=1", "llm.layout.dp=1", "llm.layout.pp=2", "batch.micro_batch_size=4",
        "vision.micro_batch_size=2", "schedule=graph_1f1b",
    ],
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration and round (after 2 warmup)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all configurations")
    args = parser.parse_args(argv)
    experiments = {name: load_experiment("colocated_vlm", MODEL + overrides) for name, overrides in CONFIGS.items()}
    placements = {name: build_graph(e, default_registry()).placement for name, e in experiments.items()}
    cluster = calibrate(2)
    print(f"calibrated: GEMM {cluster.device.matmul_tflops * 1e3:.1f} GFLOP/s + {cluster.device.matmul_overhead_us:.0f} us, "
          f"attention {cluster.device.attention_tflops * 1e3:.1f} GFLOP/s, elementwise {cluster.device.memory_gb_s:.2f} GB/s "
          f"+ {cluster.device.elementwise_overhead_us:.0f} us, all-reduce {cluster.intra_node.bandwidth_gb_s:.2f} GB/s "
          f"+ {cluster.intra_node.latency_us:.0f} us per step, tensor parallelism "
          f"+{cluster.device.tp_layer_overhead_us / 1e3:.1f} ms per layer", flush=True)
    predicted = {name: predict_configured(e, placements[name], cluster).step_s for name, e in experiments.items()}
    rounds: list[dict[str, float]] = []  # per round, each configuration's median step
    for _ in range(args.rounds):
        rounds.append({})
        for name, experiment in experiments.items():
            experiment = absolute_paths(experiment)
            ensure_shards(experiment)
            per_rank = run_ranks(measure, 2, experiment, args.steps, 2, timeout_s=900)
            rounds[-1][name] = statistics.median(max(step) for step in zip(*(r["times"] for r in per_rank)))
    first = next(iter(experiments))
    measured = {name: statistics.median(r[name] for r in rounds) for name in experiments}
    # A slow spell of the machine falls on the configurations measured during it: each ratio is taken
    # within a round, against that round's first configuration, then the median over rounds.
    ratios = {name: statistics.median(r[name] / r[first] for r in rounds) for name in experiments}
    print(f"{'configuration':<58} {'predicted ms':>12} {'measured ms':>12} {'pred. ratio':>11} {'meas. ratio':>11} {'error':>7}")
    for name in experiments:
        p_ratio, m_ratio = predicted[name] / predicted[first], ratios[name]
        print(f"{name:<58} {predicted[name] * 1e3:12.1f} {measured[name] * 1e3:12.1f} {p_ratio:11.3f} {m_ratio:11.3f} "
              f"{p_ratio / m_ratio - 1:+7.1%}")


if __name__ == "__main__":
    main()
