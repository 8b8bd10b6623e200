"""Dense against mixture of experts at equal active parameters: tokens per second and bytes per step,
side by side in one run on the same ranks.

    python -m hetero.bench.moe [--ranks 2] [--steps 12] [--hidden 128] [--layers 4] [--seq-len 128]

Both are byte-level GPTs on the standard library's sources (``hetero.data.text``), trained through the
runtime on ``ranks`` gloo ranks with AdamW, fp32. The dense one has a SwiGLU MLP of ``4·hidden`` units and
runs at dp=ranks; the MoE one has ``--experts`` experts of ``4·hidden / top_k`` units, top_k of them per
token (so the same expert units, and FLOPs, per token, plus the router), at dp=ranks with ep=ranks, and
beside it at ep=1 (every expert on every rank: no all-to-all, every expert's gradients in the sync), which
separates the experts' compute from their exchange. Steps rotate through the three (the first two of each
are warm-up); the bytes are every rank's gradient sync and all-to-all traffic, summed.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from hetero.config import OptimizerConfig
from hetero.data.text import load_stdlib_corpus
from hetero.models import default_registry
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.flops import active_ffn_size
from hetero.models.gpt.moe import MoEFeedForward
from hetero.runtime import build_runtime
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks

WARMUP = 2


def configs(hidden: int, layers: int, seq_len: int, experts: int, top_k: int) -> dict[str, GPTConfig]:
    dense = GPTConfig(vocab_size=256, hidden_size=hidden, num_layers=layers, num_heads=4, seq_len=seq_len)
    moe = GPTConfig(vocab_size=256, hidden_size=hidden, num_layers=layers, num_heads=4, seq_len=seq_len,
                    num_experts=experts, top_k=top_k, expert_ffn_size=dense.ffn_size // top_k, balance_loss=0.01,
                    router_z_loss=0.001)
    return {"dense": dense, "moe": moe, "moe ep1": moe}


def text_batches(steps: int, rows: int, seq_len: int) -> list[dict[str, torch.Tensor]]:
    corpus = load_stdlib_corpus().train.long()
    out = []
    for step in range(steps):
        start = step * rows * (seq_len + 1)
        windows = corpus[start: start + rows * (seq_len + 1)].view(rows, seq_len + 1)
        out.append({"tokens": windows[:, :-1], "labels": windows[:, 1:]})
    return out


def active_parameters(config: GPTConfig) -> int:
    """Parameters a token goes through: attention, the MLP or its top_k experts (and router), embeddings."""
    h, d = config.hidden_size, config.head_size
    attention = h * (config.num_heads + 2 * config.kv_heads) * d + config.num_heads * d * h
    mlp = 3 * h * active_ffn_size(config) + (h * config.num_experts if config.moe else 0)
    return config.num_layers * (attention + 2 * h + mlp) + 2 * config.vocab_size * h + h


def all_parameters(config: GPTConfig) -> int:
    if not config.moe:
        return active_parameters(config)
    idle = config.num_layers * 3 * config.hidden_size * config.expert_size * (config.num_experts - config.top_k)
    return active_parameters(config) + idle


def _bytes(runtime) -> torch.Tensor:
    """This rank's bytes so far: (gradient sync, all-to-all)."""
    module = runtime.modules["llm"]
    experts = sum(layer.dispatch.bytes_sent for layer in module.model.modules() if isinstance(layer, MoEFeedForward))
    return torch.tensor([module.replica_sync.bytes_sent, experts], dtype=torch.float64)


def on_rank(rank: int, world_size: int, models: dict[str, GPTConfig], steps: int, rows: int) -> dict:
    runtimes = {}
    for name, config in models.items():
        layout = {"dp": world_size} | ({"ep": world_size} if name == "moe" else {})
        blocks = {"llm": module("gpt", config, layout, OptimizerConfig(lr=1e-3))}
        runtimes[name] = build_runtime(experiment(world_size, blocks, global_batch=rows, microbatches=1, seed=0),
                                       default_registry())
    data = text_batches(steps, rows, models["dense"].seq_len)
    seconds, losses = dict.fromkeys(models, 0.0), {name: [] for name in models}
    sent = {name: torch.zeros(2, dtype=torch.float64) for name in models}
    names = list(models)
    for step, batch in enumerate(data):
        for name in names[step % len(names):] + names[: step % len(names)]:
            before = _bytes(runtimes[name])
            dist.barrier()
            started = time.perf_counter()
            metrics = runtimes[name].train_step(batch)
            dist.barrier()
            if step >= WARMUP:
                seconds[name] += time.perf_counter() - started
                sent[name] += _bytes(runtimes[name]) - before
            losses[name].append(metrics["loss"])
    return {"seconds": seconds, "sent": sent, "losses": losses}


def measure(ranks: int, steps: int, hidden: int, layers: int, seq_len: int, experts: int, top_k: int,
            rows: int) -> dict:
    models = configs(hidden, layers, seq_len, experts, top_k)
    results = run_ranks(on_rank, ranks, models, steps, rows, timeout_s=600)
    timed = steps - WARMUP
    out = {"ranks": ranks, "timed_steps": timed, "tokens_per_step": rows * seq_len}
    for name, config in models.items():
        seconds = max(r["seconds"][name] for r in results)  # the slowest rank sets the pace
        out[name] = {"active_params": active_parameters(config), "params": all_parameters(config),
                     "tokens_per_s": rows * seq_len * timed / seconds,
                     "sync_bytes_per_step": float(sum(r["sent"][name][0] for r in results)) / timed,
                     "all_to_all_bytes_per_step": float(sum(r["sent"][name][1] for r in results)) / timed,
                     "first_loss": results[0]["losses"][name][0], "last_loss": results[0]["losses"][name][-1]}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--rows", type=int, default=8, help="rows per step (global batch)")
    args = parser.parse_args(argv)
    result = measure(args.ranks, args.steps, args.hidden, args.layers, args.seq_len, args.experts, args.top_k, args.rows)
    print(f"{result['ranks']} ranks, {result['tokens_per_step']} tokens a step, {result['timed_steps']} timed steps each")
    print("variant | active params | all params | tokens/s | grad sync / step | all-to-all / step | loss first -> last")
    total = {}
    for name in ("dense", "moe", "moe ep1"):
        r = result[name]
        total[name] = r["sync_bytes_per_step"] + r["all_to_all_bytes_per_step"]
        print(f"{name:7s} | {r['active_params']:13,d} | {r['params']:10,d} | {r['tokens_per_s']:8,.0f} | "
              f"{r['sync_bytes_per_step'] / 2**20:13.2f} MB | {r['all_to_all_bytes_per_step'] / 2**20:14.2f} MB | "
              f"{r['first_loss']:.3f} -> {r['last_loss']:.3f}")
    dense = result["dense"]["tokens_per_s"]
    print(f"tokens/s, moe / dense: {result['moe']['tokens_per_s'] / dense:.2f}x (ep1: "
          f"{result['moe ep1']['tokens_per_s'] / dense:.2f}x); bytes/step, moe / dense: {total['moe'] / total['dense']:.2f}x "
          f"(ep1: {total['moe ep1'] / total['dense']:.2f}x)")


if __name__ == "__main__":
    main()
