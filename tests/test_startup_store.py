"""Store requests at start-up, counted on real gloo groups: the figure ``hetero bench scale`` reports for a
simulated world rests on this count (``gloo_store_requests``)."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import torch.distributed as dist

from hetero.bench.scale import gloo_store_requests, joined_groups
from hetero.testing.kinds import build_graph
from hetero.models.gpt.config import GPTConfig
from hetero.models.vit.config import ViTConfig
from hetero.parallel.boundary import Boundary
from hetero.parallel.boundary_plan import Side, TensorSpec
from hetero.parallel.mesh import build_module_meshes
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks

VISION = ViTConfig(image_size=8, patch_size=4, hidden_size=16, num_layers=1, num_heads=2, out_size=16)
LLM = GPTConfig(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, seq_len=16)


class CountingStore(dist.Store):
    """A real file store that counts the requests made to it."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner, self.requests = inner, Counter()

    def set(self, key, value):
        self.requests["set"] += 1
        return self.inner.set(key, value)

    def get(self, key):
        self.requests["get"] += 1
        return self.inner.get(key)

    def add(self, key, value):
        self.requests["add"] += 1
        return self.inner.add(key, value)

    def compare_set(self, key, expected, desired):
        self.requests["compare_set"] += 1
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys, timeout=None):
        self.requests["wait"] += 1
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys):
        self.requests["check"] += 1
        return self.inner.check(keys)

    def delete_key(self, key):
        self.requests["delete_key"] += 1
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)


def startup_requests(rank: int, world: int, path: str) -> tuple[int, list[int]]:
    """(store requests the job's groups and boundaries made here, sizes of the groups this rank joined)."""
    dist.barrier()  # every rank has finished connecting: a rank that left early would close a peer's connection
    dist.destroy_process_group()  # the harness's world: this test's world counts its store
    store = CountingStore(dist.FileStore(path, world))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    config = experiment(4, {"vision": module("vit", VISION, {"dp": 2}),
                            "llm": module("gpt", LLM, {"tp": 2, "offset": 2})},
                        edges=[("vision", "llm")], global_batch=2, microbatches=1)
    graph = build_graph(config)
    before = sum(store.requests.values())
    build_module_meshes(graph.placement, 60.0)
    for edge in graph.edges:
        Boundary(edge.name, Side(graph.nodes[edge.src].layout), Side(graph.nodes[edge.dst].layout),
                 TensorSpec(3, source=edge.source, destination=edge.destination), timeout_s=60.0)
    made = sum(store.requests.values()) - before
    joined = sorted(len(members) for members in joined_groups())
    dist.barrier()
    dist.destroy_process_group()  # a plain world again, for the harness's closing barrier
    dist.init_process_group("gloo", init_method=f"file://{path}.closing", rank=rank, world_size=world)
    return made, joined


def test_store_requests_follow_the_groups_joined(tmp_path):
    """Each rank's requests grow with the groups it joins (none for the groups it only names)."""
    results = run_ranks(startup_requests, 4, str(tmp_path / "store"))
    for rank, (made, joined) in enumerate(results):
        assert joined, f"rank {rank} joined no group"
        assert made == gloo_store_requests(joined), (rank, made, joined)


def test_bench_scale_builds_the_job_s_groups_on_a_fake_world():
    from hetero.bench.scale import measure

    rows = measure([64], samples=2)
    assert not dist.is_initialized()  # each sampled rank's fake world is gone
    for row in rows:
        assert 0 < row["groups_joined"] <= row["groups_created"], row
        assert row["gloo_store_requests"] > 2 * row["groups_joined"], row
        assert row["planner_s"] > 0, row  # the planner searched every experiment, the full graph included
