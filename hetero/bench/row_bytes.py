"""``hetero bench row-bytes``: the bytes of each rank's batch when it holds only the rows its modules read
(``train.data.per_rank``, compact batches: ``hetero.kinds.batch_rows``) beside the global batch that
every rank held before.

- **measured**: the main job's modules (``colocated_vlm``) laid out apart on 8 ranks, the ViT at dp4 on
  ranks 0-3 and the LLM at tp2·dp2 on ranks 4-7, on the digits' first training batch: each rank's
  batch bytes, global and as its loader builds it, column by column;
- **simulated** from the step plan (``RankReads`` on each world's bookkeeping; nothing is built): the
  same two modules at N ranks, the ViT at dp N/2 on the first half and the LLM at tp8·dp N/16 on the
  rest, a fixed batch per replica (``--rows`` rows of ``--seq-len`` tokens per LLM replica, one image
  each), for worlds of 64 to 16384 ranks: the bytes a tower rank and an LLM rank hold, global and
  compact. A row's tokens and labels are int64, its image fp32.
"""

from __future__ import annotations

import argparse

import torch

from hetero.config import experiment_from_dict, load_experiment
from hetero.data.splits import load, prepare
from hetero.graph import build_graph
from hetero.kinds.batch_rows import HELD
from hetero.models import default_registry
from hetero.runtime.rows import rank_reads

APART = ["world_size=8", "placement=auto", "llm.layout.offset=4"]


def nbytes(batch: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in batch.values())


def measured() -> list[dict]:
    """Per rank of the 8: the global batch's bytes and the compact batch's, with its held columns' rows."""
    experiment = load_experiment("colocated_vlm", APART)
    graph = build_graph(experiment, default_registry())
    first = next(iter(graph.nodes))
    microbatches = experiment.num_microbatches(first, graph.nodes[first].layout.dp)
    prepare(experiment, graph)
    batches = load(experiment, graph, "train")
    batch = batches.batch(0)
    out = []
    for rank in range(experiment.world_size):
        mine = batches.batch(0, rank_reads(graph, microbatches, rank))
        held = {key[len(HELD):]: int(flags.sum()) for key, flags in mine.items() if key.startswith(HELD)}
        out.append({"rank": rank, "global": nbytes(batch), "compact": nbytes(mine), "held": held})
    return out


def world_experiment(world: int, rows: int, seq_len: int) -> dict:
    half, llm_dp = world // 2, world // 16
    return {
        "name": "row_bytes", "world_size": world,
        "batch": {"global_batch_size": rows * llm_dp, "micro_batch_size": rows},
        "vision": {"kind": "vit", "model": {"image_size": 224, "patch_size": 14, "channels": 3, "hidden_size": 64,
                                            "num_layers": 1, "num_heads": 2, "out_size": 64},
                   "layout": {"dp": half}, "micro_batch_size": rows * llm_dp // half},
        "llm": {"kind": "gpt", "model": {"vocab_size": 256, "hidden_size": 64, "num_layers": 1, "num_heads": 8,
                                         "seq_len": seq_len},
                "layout": {"tp": 8, "dp": llm_dp, "offset": half}},
        "edges": [{"src": "vision", "dst": "llm"}],
    }


def simulated(worlds: list[int], rows: int, seq_len: int) -> list[dict]:
    """Per world: global rows, and the bytes of a tower rank's and an LLM rank's batch, global and compact
    (tokens, labels: int64 × seq_len; images: fp32 3×224×224; index and label counts: int64; a held
    flag a row per compact column)."""
    per_row = {"tokens": 8 * seq_len, "labels": 8 * seq_len, "images": 4 * 3 * 224 * 224}
    out = []
    for world in worlds:
        experiment = experiment_from_dict(world_experiment(world, rows, seq_len))
        graph = build_graph(experiment, default_registry())
        size = experiment.batch.global_batch_size
        meta = {"index": torch.arange(size)}
        planning = 2 * 8 * size  # index and label counts, for every row
        whole = planning + size * sum(per_row.values())
        result = {"world": world, "rows": size, "global": whole}
        for name, rank in (("tower", 0), ("llm", world - 1)):
            held = rank_reads(graph, 1, rank)(meta, tuple(per_row))[0]
            result[name] = planning + sum(len(held.get(key, ())) * b for key, b in per_row.items()) + len(per_row) * size
        out.append(result)
    return out


def mib(n: int) -> str:
    return f"{n / 2**20:10.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hetero bench row-bytes", description=__doc__)
    parser.add_argument("--worlds", type=int, nargs="+", default=[64, 256, 1024, 4096, 16384])
    parser.add_argument("--rows", type=int, default=8, help="rows per LLM replica per step")
    parser.add_argument("--seq-len", type=int, default=32768)
    args = parser.parse_args(argv)
    print("measured: the main job's ViT at dp4 on ranks 0-3, its LLM at tp2·dp2 on ranks 4-7; the digits' first "
          "training batch, bytes per rank")
    print(f"{'rank':>4s} | {'global MiB':>10s} | {'compact MiB':>11s} | rows held per column")
    for row in measured():
        held = ", ".join(f"{k} {v}" for k, v in sorted(row["held"].items()))
        print(f"{row['rank']:4d} | {mib(row['global'])} | {mib(row['compact']):>11s} | {held}")
    print(f"\nsimulated: ViT dp N/2, LLM tp8·dp N/16, {args.rows} rows of {args.seq_len} tokens per LLM replica; "
          f"MiB per rank")
    print(f"{'world':>6s} | {'rows':>6s} | {'global':>10s} | {'tower rank':>10s} | {'LLM rank':>10s}")
    for row in simulated(args.worlds, args.rows, args.seq_len):
        print(f"{row['world']:6d} | {row['rows']:6d} | {mib(row['global'])} | {mib(row['tower'])} | {mib(row['llm'])}")


if __name__ == "__main__":
    main()
