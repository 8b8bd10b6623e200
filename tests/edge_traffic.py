"""The least traffic a graph's edges can move, from masks (the boundary oracle's slicing, never the plan's
arithmetic): every element some destination rank needs and its own process does not hold as a source
crosses once, and each destination rank receives exactly what it needs and lacks (under CP and SP: the
positions it holds, nothing else). A parity test compares each edge's first-step counters with it."""

from __future__ import annotations

from boundary_oracle import Case, ideal_bytes
from hetero.config import ExperimentConfig
from hetero.testing.kinds import build_graph
from hetero.graph.graph import Edge, Graph
from hetero.parallel.boundary import Side, TensorSpec
from hetero.parallel.sharding import Rows
from hetero.runtime.rows import StepRows
from hetero.testing.parity import Record


def minimum_bytes(graph: Graph, edge: Edge, shape: tuple[int, ...], rows: Rows) -> tuple[int, int]:
    """(bytes crossing between the modules, bytes the destination ranks receive in all) at the least."""
    spec = TensorSpec(3, source=edge.source, destination=edge.destination)
    case = Case(edge.name, Side(graph.nodes[edge.src].layout), Side(graph.nodes[edge.dst].layout),
                {"tensor": spec}, ({"tensor": shape},))
    ideal = ideal_bytes(case, 0, rows)
    return ideal["cross"], ideal["total"]


def check_edge_bytes(results: list[Record], config: ExperimentConfig, batch: dict, microbatches: int) -> str:
    """Assert every edge moved the least traffic in the first step (``batch``), both ways; a summary."""
    graph = build_graph(config)
    step_rows = StepRows(graph, batch, microbatches)
    lines = []
    for edge in graph.edges:
        cross = received = 0
        for m in range(microbatches):
            count = len(step_rows.edge(edge, m))
            if count:
                least = minimum_bytes(graph, edge, (count, edge.tokens, edge.width), step_rows.split(edge, m))
                cross, received = cross + least[0], received + least[1]
        forward, within, backward = (sum(r.edge_bytes[edge.name][i] for r in results) for i in range(3))
        assert (forward, forward + within, backward) == (cross, received, cross), (
            f"{edge.name}: crossed {forward} bytes forward and {backward} back, destination ranks received "
            f"{forward + within}; the least is {cross} crossing each way and {received} received")
        lines.append(f"{edge.name} {cross / 1024:.1f} KB across each way, {received / 1024:.1f} KB received (the least)")
    return "; ".join(lines)
