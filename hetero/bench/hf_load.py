"""Peak host memory of each rank while ``llm.init.hf`` loads a Hugging Face checkpoint under TP, against
the checkpoint's size.

    python -m hetero.bench.hf_load [--tp 4] [--layers 8] [--hidden 768] [--dir DIR]

Writes a Llama-shaped checkpoint of random fp32 weights (config.json, safetensors shards of about 64 MB
and their index; 277 MB at the defaults), then starts ``tp`` ranks that each build the LLM as a job does
(``build_runtime``: on the meta device, parallelized, allocated, read slice by slice), after a first
build of a tiny LLM at the same layout. Each rank resets its peak resident set (``/proc/self/clear_refs``)
just before each build and reports how far the peak rose above the resident set it started from: for
the load, the memory it took, its own TP shard included, file pages mapped while reading counted.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch

from hetero.models import default_registry
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.hf import gpt_weights, weight_names
from hetero.models.gpt.hf_export_config import hf_config
from hetero.models.gpt.model import GPT
from hetero.testing.multiprocess import run_ranks

SHARD_BYTES = 64 << 20


def write_checkpoint(path: Path, config: GPTConfig) -> int:
    """A checkpoint of ``config`` with random weights in shards; its size in bytes."""
    from safetensors.torch import save_file

    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in GPT(config).state_dict().items()}
    name_of = weight_names(config)
    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in gpt_weights(config):
        if (hf := name_of(name)) is None:
            continue
        if sum(t.numel() * 4 for t in shards[-1].values()) >= SHARD_BYTES:
            shards.append({})
        shards[-1][hf] = torch.randn(shapes[name], generator=generator) * 0.02
        size += math.prod(shapes[name]) * 4
    weight_map = {}
    for i, tensors in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, path / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file)
    (path / "config.json").write_text(json.dumps(hf_config(config)))
    index = {"metadata": {"total_size": size}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return size


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def load_on_rank(rank: int, world_size: int, path: str, seq_len: int) -> dict[str, int]:
    """The peak's rise over two builds in turn: a tiny LLM at the same layout, from random weights (what
    any job's first build costs: imports, process groups, allocator pools), then the one from ``path``."""
    from hetero.parallel.data import local_data
    from hetero.runtime import build_runtime
    from hetero.testing.experiments import experiment, module

    tiny = {"vocab_size": 64, "hidden_size": 64, "num_layers": 1, "num_heads": 4, "seq_len": 16}
    rises = []
    for block in (module("gpt", tiny, {"tp": world_size, "dp": 1}),
                  module("gpt", {"seq_len": seq_len}, {"tp": world_size, "dp": 1}, init={"hf": path})):
        config = experiment(world_size, {"llm": block}, global_batch=1, microbatches=1)
        Path("/proc/self/clear_refs").write_text("5")  # the peak resident set restarts from the current one
        before = _status_kib("VmRSS")
        runtime = build_runtime(config, default_registry())
        rises.append((_status_kib("VmHWM") - before) * 1024)
    state = runtime.modules["llm"]
    held = sum(local_data(p).numel() * p.element_size() for p in state.model.parameters())
    return {"first_build": rises[0], "rise": rises[1], "held": held, "read": state.pretrained_bytes}


def measure(tp: int, layers: int, hidden: int, directory: Path) -> dict:
    config = GPTConfig(vocab_size=8192, hidden_size=hidden, num_layers=layers, num_heads=hidden // 64,
                       num_kv_heads=hidden // 64, ffn_hidden_size=hidden * 8 // 3 // 64 * 64, seq_len=256)
    size = write_checkpoint(directory, config)
    ranks = run_ranks(load_on_rank, tp, str(directory), config.seq_len, timeout_s=600)
    return {"checkpoint_bytes": size, "ranks": ranks}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--dir", type=Path, help="where to write the checkpoint (default: a temporary directory)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hetero-hf-load-") as tmp:
        result = measure(args.tp, args.layers, args.hidden, args.dir or Path(tmp))
    size = result["checkpoint_bytes"]
    print(f"checkpoint: {size / 2**20:.1f} MiB (fp32), loaded under tp{args.tp}")
    print("rank | a tiny job's first build | the load's peak RSS rise | / checkpoint | its weights | read")
    for rank, r in enumerate(result["ranks"]):
        print(f"{rank:4d} | {r['first_build'] / 2**20:20.1f} MiB | {r['rise'] / 2**20:20.1f} MiB | "
              f"{r['rise'] / size:12.3f} | {r['held'] / size:11.3f} | {r['read'] / size:.3f}")
    print(f"worst rank: {max(r['rise'] for r in result['ranks']) / size:.3f} of the checkpoint")


if __name__ == "__main__":
    main()
