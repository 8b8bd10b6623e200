"""The one runtime: schedules of per-microbatch actions over any module graph, their executor, and the
step's end every rank agrees on. ``build_runtime(experiment, registry)`` makes one on this rank of a running
world."""

from __future__ import annotations

from hetero.config import ExperimentConfig
from hetero.graph import Graph, build_graph
from hetero.kinds.registry import KindRegistry
from hetero.parallel.compression.collective import Collective
from hetero.parallel.mesh import build_module_meshes
from hetero.runtime.runtime import Runtime


def build_runtime(
    experiment: ExperimentConfig, registry: KindRegistry | None = None, graph: Graph | None = None,
    outer_comms: dict[str, Collective] | None = None,
) -> Runtime:
    """The experiment's runtime on this rank: its graph checked, every module's process groups built (on
    every rank, in one order), its modules, edges and schedules. ``registry``: the kinds to build the graph
    of (not needed where the built ``graph`` is given). ``outer_comms``: see ``Runtime``."""
    if graph is None:
        if registry is None:
            raise TypeError("build_runtime needs the registry of module kinds (hetero.models.default_registry() "
                            "at the entry point) or the built graph")
        graph = build_graph(experiment, registry)
    experts = frozenset(name for name, node in graph.nodes.items() if node.kind.expert_parallel(node.config))
    meshes = build_module_meshes(graph.placement, experiment.timeout_s, experts)
    first = next(iter(graph.nodes))
    return Runtime(
        graph, meshes, microbatches=experiment.num_microbatches(first, graph.nodes[first].layout.dp),
        seed=experiment.seed, grad_clip=experiment.train.grad_clip, timeout_s=experiment.timeout_s,
        sample_reuse=experiment.train.sample_reuse, outer_comms=outer_comms,
    )


__all__ = ["Runtime", "build_runtime"]
