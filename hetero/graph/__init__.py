"""The module graph of an experiment: modules of registered kinds, each under its own layout, and edges."""

from hetero.graph.build import build_graph
from hetero.graph.graph import Edge, Graph, Node

__all__ = ["Edge", "Graph", "Node", "build_graph"]
