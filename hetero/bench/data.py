"""``hetero bench data``: what each rank's loader does per step when it decodes only the images its
modules take, beside every rank decoding every image.

- **measured**: the ``own_data_vlm`` modules at vision dp4 (its projector beside it) on ranks 0-3 and
  the LLM at dp2 on ranks 4-5, on the example conversations (``hetero data example``): per rank, the
  images decoded, the image bytes read and the time to build its batch, per step, each rank's loader run
  in turn in this process, with ``train.data.per_rank`` on and off;
- **simulated** from the step plan (``ItemReads`` on each world's bookkeeping; nothing is decoded): a
  tower of items at dp N/2 on the first half of N ranks and an LLM at tp8·dp N/16 on the rest, two
  one-image samples per tower replica per step, for worlds of 64 to 16384 ranks: the images one tower
  rank and one LLM rank decode per step, against the global batch's (what every rank decodes without
  per-rank loading).

- **balance**: a native-resolution tower (``max_patches`` 64) at dp4 on the same conversations, packed
  into rows of 1024 tokens: max/mean patches per replica over ``--balance-steps`` steps, with the images
  split by patch count as the step plan does (from the sample index: no image is decoded), next to an
  equal split by image count.

The loop's wait for its batch with 0, 1 and 2 workers is ``data_wait_ms`` in a job's ``metrics.jsonl``
(see docs/data.md for the figures on this machine).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hetero.config import experiment_from_dict, load_experiment
from hetero.data.example import write_llava
from hetero.data.splits import load
from hetero.graph import build_graph
from hetero.runtime.rows import StepRows, item_reads

SIX_RANKS = ["world_size=6", "vision.layout.dp=4", "projector.layout.dp=4", "llm.layout.tp=1", "llm.layout.dp=2",
             "llm.layout.offset=4", "llm.micro_batch_size=4"]
SEQ_LEN = 32


def measured(path: Path, steps: int) -> list[dict]:
    rows = []
    for per_rank in (True, False):
        experiment = load_experiment("own_data_vlm", [f"train.data.path={path}", *SIX_RANKS])
        graph = build_graph(experiment)
        microbatches = experiment.num_microbatches("vision", 4)
        for rank in range(6):
            batches, reads = load(experiment, graph, "train"), item_reads(graph, microbatches, rank)
            start = time.perf_counter()
            for step in range(steps):
                batches.batch(step, reads if per_rank else None)
            seconds = time.perf_counter() - start
            shaper = batches.shaper
            rows.append({"per_rank": per_rank, "rank": rank, "images": shaper.decoded / steps,
                         "kb": shaper.bytes_read / steps / 1024, "ms": 1e3 * seconds / steps})
    return rows


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
    graph = build_graph(experiment)
    meta = {"tokens": torch.zeros(rows, SEQ_LEN, dtype=torch.long), "image_row": torch.arange(rows),
            "image_start": torch.zeros(rows, dtype=torch.long)}
    return graph, meta


def simulated(worlds: list[int]) -> list[dict]:
    rows = []
    for world in worlds:
        graph, meta = plan_world(world)
        tower, llm = (len(item_reads(graph, 1, rank)(meta)) for rank in (0, world - 1))
        rows.append({"world": world, "global": len(meta["image_row"]), "tower": tower, "llm": llm})
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
    graph = build_graph(experiment)
    batches, ratios = load(experiment, graph, "train"), {"patches": [], "count": []}
    for step in range(steps):
        plan = batches.batch(step, lambda batch: torch.zeros(0, dtype=torch.long))  # bookkeeping: nothing decoded
        costs, rows = plan["image_grid"].prod(1), StepRows(graph, plan, 1)
        loads = {"patches": [int(costs[rows.local("vision", 0, d)].sum()) for d in range(4)],
                 "count": [int(costs[part].sum()) for part in torch.tensor_split(rows.module("vision", 0), 4)]}
        for name, load_ in loads.items():
            ratios[name].append(max(load_) * 4 / sum(load_))
    assert batches.shaper.decoded == 0
    return ratios


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hetero bench data", description=__doc__)
    parser.add_argument("--steps", type=int, default=10, help="steps each rank's loader builds (measured)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[64, 256, 1024, 4096, 16384])
    parser.add_argument("--balance-steps", type=int, default=100)
    parser.add_argument("--data", type=Path, default=None, help="the example conversations (default: written anew)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    path = args.data or write_llava(Path(tempfile.mkdtemp(prefix="bench_data.")), 600, seed=0)
    print(f"measured: vision dp4 on ranks 0-3, LLM dp2 on ranks 4-5; per rank and step over {args.steps} steps")
    print(f"{'rank':>4s} | {'images decoded':>20s} | {'image KB read':>20s} | {'batch ms':>20s}")
    print(f"{'':>4s} | {'own / everything':>20s} | {'own / everything':>20s} | {'own / everything':>20s}")
    result = measured(path, args.steps)
    for own, every in zip(result[:6], result[6:]):
        print(f"{own['rank']:4d} | {own['images']:9.1f} / {every['images']:8.1f} | {own['kb']:9.1f} / "
              f"{every['kb']:8.1f} | {own['ms']:9.1f} / {every['ms']:8.1f}")
    print("\nsimulated from the step plan: tower dp N/2, LLM tp8·dp N/16; two one-image samples per tower replica")
    print(f"{'world':>6s} | {'images a step':>13s} | {'a tower rank decodes':>20s} | {'an LLM rank decodes':>19s}")
    for row in simulated(args.worlds):
        print(f"{row['world']:6d} | {row['global']:13d} | {row['tower']:20d} | {row['llm']:19d}")
    ratios = balance(path, args.balance_steps)
    print(f"\nbalance: native-resolution tower dp4, {args.balance_steps} steps planned from the index (no image decoded)")
    for name, values in ratios.items():
        print(f"split by {name:7s} | max/mean patches per replica: mean {statistics.mean(values):.3f}, "
              f"worst {max(values):.3f}")
