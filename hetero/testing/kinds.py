"""The built-in kinds for tests and scripts: ``build_graph`` and ``build_runtime`` as in ``hetero.graph``
and ``hetero.runtime``, the registry defaulting to ``hetero.models.default_registry()``.

The library's own ``build_graph(experiment, registry)`` takes the registry from its entry point (the
contract's packages never import ``hetero.models``); a test or a script is such an entry point, and these
assemble it for them:

    from hetero.testing.kinds import build_graph, build_runtime

    graph = build_graph(experiment)                  # or build_graph(experiment, my_registry)
    runtime = build_runtime(experiment)
"""

from __future__ import annotations

from hetero.config import ExperimentConfig
from hetero.graph import Graph
from hetero.graph import build_graph as _build_graph
from hetero.kinds.registry import KindRegistry
from hetero.models import default_registry
from hetero.parallel.compression.collective import Collective
from hetero.runtime import Runtime
from hetero.runtime import build_runtime as _build_runtime


def build_graph(experiment: ExperimentConfig, registry: KindRegistry | None = None) -> Graph:
    """``hetero.graph.build_graph`` with the built-in kinds unless ``registry`` is given."""
    return _build_graph(experiment, registry or default_registry())


def build_runtime(
    experiment: ExperimentConfig, registry: KindRegistry | None = None, graph: Graph | None = None,
    outer_comms: dict[str, Collective] | None = None,
) -> Runtime:
    """``hetero.runtime.build_runtime`` with the built-in kinds unless ``registry`` (or the ``graph``) is given."""
    if graph is None:
        registry = registry or default_registry()
    return _build_runtime(experiment, registry, graph, outer_comms)


__all__ = ["build_graph", "build_runtime", "default_registry"]
