"""What grows with the world, measured on a simulated world of N ranks: nothing starts, every figure
comes from the pure parts the ranks would run.

    python -m hetero.bench.scale [--worlds 1024 4096 16384] [--samples 8]

Experiments, scaled to each world size N:

- ``long-context VLM, colocated``: vision dp=N and an LLM at tp8·cp2·dp=N/16 on the same ranks, 256
  image tokens into an 8192-token sequence (width 1024);
- ``long-context VLM, non-colocated``: vision dp=N/4 on the first quarter, the LLM tp8·cp2 on the rest;
- ``full graph``: vision and GeneZip dp=N/4 on the first quarter, the LLM tp8·pp2 on the middle half,
  the video generator dp=N/4 on the last quarter (vision, DNA -> LLM -> video).

Per experiment and world:

- **plan ms**: the longest ``boundary_plan.rank_plan`` (median of 3 runs) over sampled ranks (the first, last and random
  ones of every edge's two sides) and every edge, for a microbatch that gives every replica of both sides
  rows, split evenly and, as a multimodal microbatch splits, into random per-replica counts;
- **plan KB**: the largest pickled plan among those (a boundary caches at most 64 signatures);
- **start-up**: every module's groups (``mesh.build_module_meshes``) and every edge's ``Boundary``,
  built by the job's own code on sampled ranks (the first and last of every module) of a world of N
  processes on torch's fake backend: the longest build, the ``new_group`` calls every rank makes, the
  most groups one rank joins, and the most store requests one rank's gloo groups make at creation
  (``gloo_store_requests``, the count ``tests/test_startup_store.py`` measures on real gloo);
- **layout**: ``hetero layout``'s rank map: build time and JSON size;
- **plan search**: ``hetero plan``'s search (every placement mode) on a cluster of N/8 nodes of 8 GPUs.
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import random
import statistics
import time

import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.testing._internal.distributed.fake_pg import FakeStore

from hetero.config import ExperimentConfig, experiment_from_dict
from hetero.graph import build_graph
from hetero.models import default_registry
from hetero.parallel.boundary import Boundary
from hetero.parallel.boundary_plan import Rows, Side, TensorSpec, rank_plan
from hetero.parallel.mesh import build_module_meshes
from hetero.parallel.rank_map import rank_map

REPEATS = 3  # a plan timed three times, its median kept: one run can take a garbage-collection pause
VISION = {"kind": "vit", "model": {"image_size": 256, "patch_size": 16, "hidden_size": 1024, "num_layers": 24,
                                   "num_heads": 16, "out_size": 1024}}
LLM = {"kind": "gpt", "model": {"vocab_size": 32000, "hidden_size": 1024, "num_layers": 16, "num_heads": 16,
                                "seq_len": 8192}}


def long_context_vlm(world: int, colocated: bool) -> ExperimentConfig:
    vision_ranks = world if colocated else world // 4
    llm_ranks, offset = (world, 0) if colocated else (world - vision_ranks, vision_ranks)
    llm_dp = llm_ranks // 16
    batch = math.lcm(vision_ranks, llm_dp)  # one microbatch, every replica of both some rows
    return experiment_from_dict({
        "name": f"long_context_vlm_{'colocated' if colocated else 'non_colocated'}", "world_size": world,
        "batch": {"global_batch_size": batch, "micro_batch_size": 1},
        "vision": VISION | {"layout": {"dp": vision_ranks}, "micro_batch_size": batch // vision_ranks},
        "llm": LLM | {"layout": {"tp": 8, "cp": 2, "dp": llm_dp, "offset": offset},
                      "micro_batch_size": batch // llm_dp},
        "edges": [{"src": "vision", "dst": "llm"}],
    })


def full_graph(world: int) -> ExperimentConfig:
    quarter = world // 4
    llm_dp = (world // 2) // 16
    return experiment_from_dict({
        "name": "full_graph", "world_size": world,
        "batch": {"global_batch_size": quarter, "micro_batch_size": 1},
        "vision": VISION | {"layout": {"dp": quarter}, "micro_batch_size": 1},
        "dna": {"kind": "genezip", "model": {"seq_len": 2048, "hidden_size": 512, "num_heads": 8, "out_size": 1024,
                                             "max_boundaries": 64, "routing_window": 128},
                "layout": {"dp": quarter}, "micro_batch_size": 1},
        "llm": LLM | {"layout": {"tp": 8, "pp": 2, "dp": llm_dp, "offset": quarter},
                      "micro_batch_size": quarter // llm_dp},
        "video": {"kind": "video", "model": {"frame_size": 64, "patch_size": 8, "condition_size": 1024},
                  "layout": {"dp": quarter, "offset": 3 * quarter}, "micro_batch_size": 1},
        "edges": [{"src": "vision", "dst": "llm"}, {"src": "dna", "dst": "llm"}, {"src": "llm", "dst": "video"}],
    })


def sampled(ranks: tuple[int, ...], count: int, rng: random.Random) -> list[int]:
    return sorted({ranks[0], ranks[-1], *rng.sample(ranks, min(count, len(ranks)))})


def random_counts(rows: int, parts: int, rng: random.Random) -> tuple[int, ...]:
    """A multimodal microbatch's split: each replica's rows a random count (empty ones too)."""
    cuts = sorted(rng.randint(0, rows) for _ in range(parts - 1))
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, rows]))


def edge_plans(graph, samples: int, rng: random.Random) -> tuple[float, int, int]:
    """(longest plan ms, largest pickled plan bytes, plans timed) over every edge and sampled rank."""
    worst_ms, worst_bytes, timed = 0.0, 0, 0
    for edge in graph.edges:
        src_layout, dst_layout = graph.nodes[edge.src].layout, graph.nodes[edge.dst].layout
        source = Side(src_layout).resolve(src_layout.pp - 1, "source")
        destination = Side(dst_layout).resolve(0, "destination")
        specs = {"x": TensorSpec(3, source=edge.source, destination=edge.destination)}
        rows = math.lcm(src_layout.dp, dst_layout.dp)  # every replica of both sides some rows
        shapes = {"x": (rows, edge.tokens, edge.width)}
        splits = [Rows(), Rows(random_counts(rows, src_layout.dp, rng), random_counts(rows, dst_layout.dp, rng))]
        ranks = sampled(source.active_ranks(), samples, rng) + sampled(destination.active_ranks(), samples, rng)
        for rank in ranks:
            for split in splits:
                runs = []
                for _ in range(REPEATS):
                    started = time.perf_counter()
                    plan = rank_plan(rank, shapes, specs, source, destination, split)
                    runs.append((time.perf_counter() - started) * 1e3)
                worst_ms = max(worst_ms, statistics.median(runs))
                worst_bytes = max(worst_bytes, len(pickle.dumps(plan)))
                timed += 1
    return worst_ms, worst_bytes, timed


def gloo_store_requests(group_sizes: list[int]) -> int:
    """Store requests one rank makes to join gloo groups of these sizes: its address set, then a wait and
    a get for every member's, itself included (torch 2.13). Gloo's lazy connections
    (``TORCH_GLOO_LAZY_INIT=1``: one request a group, two a peer at first use) would follow the peers a
    rank talks to instead, but a compressed full-graph step deadlocks under them (measured)."""
    return sum(2 * size + 1 for size in group_sizes)


def joined_groups() -> list[dict[int, int]]:
    """The rank maps of the groups this rank belongs to, the world's apart. torch keeps one more map under
    ``NON_GROUP_MEMBER``, the last group it was not in."""
    world = distributed_c10d._get_default_group()
    return [members for group, members in distributed_c10d._world.pg_group_ranks.items()
            if isinstance(group, dist.ProcessGroup) and group is not world]


def startup(graph, timeout_s: float = 60.0) -> dict:
    """The job's group and boundary construction on sampled ranks of a fake world of the graph's size."""
    world = graph.placement.world_size
    experts = frozenset(n for n, node in graph.nodes.items() if node.kind.expert_parallel(node.config))
    ranks = sorted({r for node in graph.nodes.values() for r in (node.layout.ranks[0], node.layout.ranks[-1])})
    worst = {"startup_s": 0.0, "groups_created": 0, "groups_joined": 0, "gloo_store_requests": 0}
    for rank in ranks:
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            started = time.perf_counter()
            build_module_meshes(graph.placement, timeout_s, experts)
            for edge in graph.edges:
                Boundary(edge.name, Side(graph.nodes[edge.src].layout), Side(graph.nodes[edge.dst].layout),
                         TensorSpec(3, source=edge.source, destination=edge.destination), timeout_s=timeout_s)
            elapsed = time.perf_counter() - started
            joined = [len(members) for members in joined_groups()]
            figures = {"startup_s": elapsed, "groups_created": distributed_c10d._world.group_count - 1,  # the world is the first
                       "groups_joined": len(joined), "gloo_store_requests": gloo_store_requests(joined)}
        finally:
            dist.destroy_process_group()
        worst = {k: max(v, figures[k]) for k, v in worst.items()}
    return worst


def planner_seconds(experiment: ExperimentConfig, world: int) -> float:
    from hetero.plan.cluster import load_cluster
    from hetero.plan.search import Planner
    from hetero.plan.workload import workload_of

    cluster = load_cluster("h100_64")
    cluster = type(cluster)(name=f"h100-{world}", nodes=world // cluster.gpus_per_node,
                            gpus_per_node=cluster.gpus_per_node, device=cluster.device, intra_node=cluster.intra_node,
                            inter_node=cluster.inter_node)
    started = time.perf_counter()
    Planner(cluster, workload_of(experiment, activation_bytes=cluster.device.activation_bytes)).plans()
    return time.perf_counter() - started


def measure(worlds: list[int], samples: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for world in worlds:
        for label, experiment in (("long-context VLM, colocated", long_context_vlm(world, True)),
                                  ("long-context VLM, non-colocated", long_context_vlm(world, False)),
                                  ("full graph", full_graph(world))):
            started = time.perf_counter()
            graph = build_graph(experiment, default_registry())
            build_s = time.perf_counter() - started
            plan_ms, plan_bytes, timed = edge_plans(graph, samples, rng)
            groups = startup(graph)
            started = time.perf_counter()
            description = json.dumps(rank_map(experiment, graph.placement))
            layout_s = time.perf_counter() - started
            rows.append({"world": world, "experiment": label, "graph_s": build_s, "plan_ms": plan_ms,
                         "plans_timed": timed, "plan_kb": plan_bytes / 1024, **groups, "layout_s": layout_s, "layout_mb": len(description) / 2**20,
                         "planner_s": planner_seconds(experiment, world)})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--samples", type=int, default=8, help="random ranks per side of each edge, besides the ends")
    args = parser.parse_args(argv)
    print("world | experiment | build s | plan ms (max) | plans | plan KB | start-up s | groups created | joined | "
          "gloo store requests | layout s | layout MB | plan search s")
    for r in measure(args.worlds, args.samples):
        print(f"{r['world']:5d} | {r['experiment']:31s} | {r['graph_s']:7.2f} | {r['plan_ms']:13.2f} | "
              f"{r['plans_timed']:5d} | {r['plan_kb']:7.1f} | {r['startup_s']:10.2f} | {r['groups_created']:14d} | "
              f"{r['groups_joined']:6d} | {r['gloo_store_requests']:19d} | "
              f"{r['layout_s']:8.2f} | {r['layout_mb']:9.2f} | {r['planner_s']:.2f}", flush=True)


if __name__ == "__main__":
    main()
