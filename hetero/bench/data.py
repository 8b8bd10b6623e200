"""``hetero bench data``: what each rank's loader does per step when it decodes only the images its
modules take, beside every rank decoding every image.

- **measured**: the ``own_data_vlm`` modules at vision dp4 (its projector beside it) on ranks 0-3 and
  the LLM at dp2 on ranks 4-5, on the example conversations (``hetero data example``): per rank, the
  images decoded, the image bytes read, the samples tokenized and the time to build its batch, per step,
  the six ranks' loaders running at once (a process each), with ``train.data.per_rank`` on, then off;
- **simulated** from the step plan (``RankReads`` on each world's bookkeeping; nothing is decoded): a
  tower of items at dp N/2 on the first half of N ranks and an LLM at tp8·dp N/16 on the rest, two
  one-image samples per tower replica per step, for worlds of 64 to 16384 ranks: the images one tower
  rank and one LLM rank decode per step, against the global batch's (what every rank decodes without
  per-rank loading).

- **balance**: a native-resolution tower (``max_patches`` 64) at dp4 on the same conversations, packed
  into rows of 1024 tokens: max/mean patches per replica over ``--balance-steps`` steps, with the images
  split by patch count as the step plan does (from the sample index: no image is decoded), next to an
  equal split by image count.

- **data wait** (``--wait-steps``, 0 skips it): the main job (``colocated_vlm``) and ``own_data_vlm`` on
  the example conversations, each run with 0, 1 and 2 ``train.data.workers``: the mean step time and the
  loop's wait for its batch (``data_wait_ms`` in ``metrics.jsonl``) after the first 20 steps.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hetero.config import experiment_from_dict, load_experiment
from hetero.data.example import write_llava
from hetero.data.splits import load
from hetero.graph import build_graph
from hetero.models import default_registry
from hetero.runtime.rows import StepRows, rank_reads

SIX_RANKS = ["world_size=6", "vision.layout.dp=4", "projector.layout.dp=4", "llm.layout.tp=1", "llm.layout.dp=2",
             "llm.layout.offset=4", "llm.micro_batch_size=4"]
SEQ_LEN = 32


def rank_loader(path: Path, rank: int, per_rank: bool, steps: int) -> dict:
    """Rank ``rank``'s loader over ``steps`` steps: per step, the images it decoded, their KB, the samples
    it tokenized and the ms it took to build a batch."""
    experiment = load_experiment("own_data_vlm", [f"train.data.path={path}", *SIX_RANKS])
    graph = build_graph(experiment, default_registry())
    batches = load(experiment, graph, "train")
    reads = rank_reads(graph, experiment.num_microbatches("vision", 4), rank) if per_rank else None
    start = time.perf_counter()
    for step in range(steps):
        batches.batch(step, reads)
    seconds = time.perf_counter() - start
    shaper = batches.shaper
    return {"per_rank": per_rank, "rank": rank, "images": shaper.decoded / steps, "kb": shaper.bytes_read / steps / 1024,
            "samples": shaper.tokenized / steps, "ms": 1e3 * seconds / steps}


def measured(path: Path, steps: int) -> list[dict]:
    """Every rank's loader at once, one process each (as on six ranks), per-rank loading on, then off."""
    with multiprocessing.get_context("fork").Pool(6) as pool:
        return [row for per_rank in (True, False)
                for row in pool.starmap(rank_loader, [(path, rank, per_rank, steps) for rank in range(6)])]


def plan_world(world: int):
    half, llm_dp = world // 2, world // 16
    rows = 2 * half
    experiment = experiment_from_dict({
        "name": "data_plan", "world_size": world, "batch": {"global_batch_size": rows, "micro_batch_size": 1},
        "vision": {"kind": "vit", "model": {"image_size": 224, "patch_size": 14, "channels": 3, "hidden_size": 64,
                                            "num_layers": 1, "num_heads": 4, "out_size": 64, "class_token": False,
                                            "projector": False, "items": True},
                   "layout": {"dp": half}, "micro_batch_size": 2},
        "llm": {"kind": "gpt", "model": {"vocab_size": 256, "hidden_size": 64, "num_layers": 1, "num_heads": 8,
                                         "seq_len": 512},
                "layout": {"tp": 8, "dp": llm_dp, "offset": half}, "micro_batch_size": rows // llm_dp},
        "projector": {"kind": "projector", "model": {"in_size": 64, "out_size": 64, "tokens": 256, "items": True},
                      "layout": {"dp": half}, "micro_batch_size": 2},
        "edges": [{"src": "vision", "dst": "projector"}, {"src": "projector", "dst": "llm"}],
    })
    graph = build_graph(experiment, default_registry())
    meta = {"tokens": torch.zeros(rows, SEQ_LEN, dtype=torch.long), "image_row": torch.arange(rows),
            "image_start": torch.zeros(rows, dtype=torch.long)}
    return graph, meta


def simulated(worlds: list[int]) -> list[dict]:
    rows = []
    for world in worlds:
        graph, meta = plan_world(world)
        (_, tower), (llm_rows, llm) = (rank_reads(graph, 1, rank)(meta) for rank in (0, world - 1))
        rows.append({"world": world, "global": len(meta["image_row"]), "tower": len(tower), "llm": len(llm),
                     "llm_rows": len(llm_rows["tokens"])})
    return rows


NATIVE = """
name: data_balance
world_size: 4
placement: colocated
batch: {{global_batch_size: 16, micro_batch_size: 4}}
vision:
  kind: vit
  model: {{image_size: 32, patch_size: 8, channels: 3, hidden_size: 32, num_layers: 1, num_heads: 2, out_size: 32,
          class_token: false, max_patches: 64}}
  layout: {{dp: 4}}
llm:
  kind: gpt
  model: {{vocab_size: 256, hidden_size: 32, num_layers: 1, num_heads: 2, seq_len: 1024}}
  layout: {{dp: 4}}
train: {{data: {{format: llava, path: {path}, pack: true}}}}
edges:
  - {{src: vision, dst: llm}}
"""


def balance(path: Path, steps: int) -> dict[str, list[float]]:
    """max/mean patches per tower replica per step, split by patches (the plan's) and by image count."""
    config = Path(tempfile.mkdtemp(prefix="bench_data.")) / "data_balance.yaml"
    config.write_text(NATIVE.format(path=path))
    experiment = load_experiment(str(config))
    graph = build_graph(experiment, default_registry())
    batches, ratios = load(experiment, graph, "train"), {"patches": [], "count": []}
    for step in range(steps):
        none = torch.zeros(0, dtype=torch.long)
        plan = batches.batch(step, lambda places, columns: ({}, none))  # bookkeeping: nothing tokenized or decoded
        costs, rows = plan["image_grid"].prod(1), StepRows(graph, plan, 1)
        loads = {"patches": [int(costs[rows.local("vision", 0, d)].sum()) for d in range(4)],
                 "count": [int(costs[part].sum()) for part in torch.tensor_split(rows.module("vision", 0), 4)]}
        for name, load_ in loads.items():
            ratios[name].append(max(load_) * 4 / sum(load_))
    assert batches.shaper.decoded == 0 and batches.shaper.tokenized == 0
    return ratios


WAIT_WARMUP = 20  # steps left out of the wait: the first ones start the workers


def waits(path: Path, steps: int) -> list[dict]:
    """Per job and number of workers, the mean step time and data wait (ms) after ``WAIT_WARMUP`` steps."""
    jobs = {"main job": ["colocated_vlm"], "example conversations": ["own_data_vlm", f"train.data.path={path}"]}
    rows = []
    for job, command in jobs.items():
        for workers in (0, 1, 2):
            run_dir = Path(tempfile.mkdtemp(prefix="bench_data_wait."))
            subprocess.run([sys.executable, "-m", "hetero.cli", "train", *command, f"train.steps={steps}",
                            "train.log_every=1", "train.eval_every=0", f"train.data.workers={workers}",
                            "train.wandb=disabled", f"train.run_dir={run_dir}"], check=True, capture_output=True)
            lines = [json.loads(line) for line in next(run_dir.glob("*/metrics.jsonl")).open()]
            timed = [line for line in lines if "data_wait_ms" in line][WAIT_WARMUP:]
            step_ms = statistics.mean(1e3 * line["step_s"] for line in timed)
            wait_ms = statistics.mean(line["data_wait_ms"] for line in timed)
            rows.append({"job": job, "workers": workers, "step_ms": step_ms, "wait_ms": wait_ms})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hetero bench data", description=__doc__)
    parser.add_argument("--steps", type=int, default=10, help="steps each rank's loader builds (measured)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[64, 256, 1024, 4096, 16384])
    parser.add_argument("--balance-steps", type=int, default=100)
    parser.add_argument("--wait-steps", type=int, default=80, help=f"steps of each job timed for the data wait "
                        f"(the first {WAIT_WARMUP} left out; 0: no wait runs)")
    parser.add_argument("--data", type=Path, default=None, help="the example conversations (default: written anew)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    path = args.data or write_llava(Path(tempfile.mkdtemp(prefix="bench_data.")), 600, seed=0)
    print(f"measured: vision dp4 on ranks 0-3, LLM dp2 on ranks 4-5; per rank and step over {args.steps} steps")
    columns = ("images decoded", "image KB read", "samples tokenized", "batch ms")
    print(f"{'rank':>4s} | " + " | ".join(f"{c:>20s}" for c in columns))
    print(f"{'':>4s} | " + " | ".join(f"{'own / everything':>20s}" for _ in columns))
    result = measured(path, args.steps)
    for own, every in zip(result[:6], result[6:]):
        print(f"{own['rank']:4d} | " + " | ".join(f"{own[k]:9.1f} / {every[k]:8.1f}"
                                                   for k in ("images", "kb", "samples", "ms")))
    print("\nsimulated from the step plan: tower dp N/2, LLM tp8·dp N/16; two one-image samples per tower replica")
    print(f"{'world':>6s} | {'images a step':>13s} | {'a tower rank decodes':>20s} | {'an LLM rank decodes':>19s} | "
          f"{'rows an LLM rank tokenizes':>26s}")
    for row in simulated(args.worlds):
        print(f"{row['world']:6d} | {row['global']:13d} | {row['tower']:20d} | {row['llm']:19d} | "
              f"{row['llm_rows']:26d}")
    ratios = balance(path, args.balance_steps)
    print(f"\nbalance: native-resolution tower dp4, {args.balance_steps} steps planned from the index (no image decoded)")
    for name, values in ratios.items():
        print(f"split by {name:7s} | max/mean patches per replica: mean {statistics.mean(values):.3f}, "
              f"worst {max(values):.3f}")
    if args.wait_steps:
        print(f"\ndata wait: mean over steps {WAIT_WARMUP + 1}-{args.wait_steps}, one run each")
        print(f"{'job':>22s} | {'workers':>7s} | {'step ms':>8s} | {'wait ms':>8s} | {'wait share':>10s}")
        for row in waits(path, args.wait_steps):
            print(f"{row['job']:>22s} | {row['workers']:7d} | {row['step_ms']:8.1f} | {row['wait_ms']:8.2f} | "
                  f"{row['wait_ms'] / row['step_ms']:10.1%}")
