"""Schedules: the order in which each rank runs the same per-microbatch actions of a step.

An action is ``F``/``B`` (this rank's pipeline stage of a module, forward or backward, on a microbatch)
or ``EF``/``EB`` (an edge's forward or backward call on a microbatch: every rank of the source's last
stage and of the destination's first stage takes part). A schedule gives each rank its list:

- ``phased`` (modules share ranks): modules in graph order, each one's incoming edges then its forwards;
  a module nothing consumes (a sink) runs its whole pipeline schedule (1F1B or GPipe) there; then, in
  reverse order, each other module's outgoing edges backward and its backwards. Every rank meets the
  edges in one global order, so boundary calls pair without buffering.
- ``graph_pipeline`` (every module on its own ranks): each rank runs its stage's 1F1B order (GPipe if a
  module asks for it) with a warmup of the stages on the longest path after it, receiving from its
  incoming edges before a first stage's forward and sending after a last stage's; the edges' sends are
  posted asynchronously, as between a module's own stages.

``check_schedule`` runs every rank's list in a simulation (sends posted without waiting, receives
waiting for their send, edge calls of the phased schedule waiting for all their ranks) and checks that
both sides of every edge call it in the same order and that a module's stage replicas run the same
actions: a schedule that would deadlock or mispair fails here, on every rank alike, before any message.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetero.errors import ConfigError
from hetero.graph.graph import Edge, Graph
from hetero.parallel.pipeline import stage_order


@dataclass(frozen=True)
class Action:
    op: str  # F | B | EF | EB
    target: str  # a module, or an edge's name
    microbatch: int

    def __str__(self) -> str:
        return f"{self.op} {self.target} {self.microbatch}"


class ScheduleError(ConfigError):
    """A schedule that would deadlock or mispair its messages."""


def edge_ranks(graph: Graph, edge: Edge) -> set[int]:
    """The ranks an edge call involves: the source's last stage and the destination's first."""
    src, dst = graph.nodes[edge.src].layout, graph.nodes[edge.dst].layout
    return {r for r, c in src.coords() if c.pp == src.pp - 1} | {r for r, c in dst.coords() if c.pp == 0}


def rank_actions(graph: Graph, rank: int, microbatches: int, training: bool) -> list[Action]:
    if graph.schedule == "graph_pipeline":
        return _graph_pipeline(graph, rank, microbatches, training)
    return _phased(graph, rank, microbatches, training)


def _stage_of(graph: Graph, name: str, rank: int) -> int | None:
    coord = graph.nodes[name].layout.coord(rank)
    return None if coord is None else coord.pp


def _pipeline_schedule(graph: Graph, names) -> str:
    return "gpipe" if any(graph.nodes[n].options.pipeline_schedule == "gpipe" for n in names) else "1f1b"


def _phased(graph: Graph, rank: int, n: int, training: bool) -> list[Action]:
    actions: list[Action] = []
    for name in graph.order:
        for edge in graph.in_edges(name):
            if rank in edge_ranks(graph, edge):
                actions += [Action("EF", edge.name, m) for m in range(n)]
        stage = _stage_of(graph, name, rank)
        if stage is None:
            continue
        if training and graph.is_sink(name):
            node = graph.nodes[name]
            warmup = node.layout.pp - 1 - stage
            actions += [Action(op, name, m) for op, m in stage_order(node.options.pipeline_schedule, warmup, n)]
        else:
            actions += [Action("F", name, m) for m in range(n)]
    if training:
        for name in reversed(graph.order):
            if graph.is_sink(name):
                continue
            for edge in graph.out_edges(name):
                if rank in edge_ranks(graph, edge):
                    actions += [Action("EB", edge.name, m) for m in range(n)]
            if _stage_of(graph, name, rank) is not None:
                actions += [Action("B", name, m) for m in range(n)]
    return actions


def _graph_pipeline(graph: Graph, rank: int, n: int, training: bool) -> list[Action]:
    (name,) = [m for m in graph.order if _stage_of(graph, m, rank) is not None]
    node, stage = graph.nodes[name], _stage_of(graph, name, rank)
    first, last = stage == 0, stage == node.layout.pp - 1
    warmup = node.layout.pp - 1 - stage + graph.depth_after(name)
    order = stage_order(_pipeline_schedule(graph, graph.order), warmup, n) if training else [("F", m) for m in range(n)]
    actions: list[Action] = []
    for op, m in order:
        if op == "F":
            actions += [Action("EF", e.name, m) for e in graph.in_edges(name)] if first else []
            actions.append(Action("F", name, m))
            actions += [Action("EF", e.name, m) for e in graph.out_edges(name)] if last else []
        else:
            actions += [Action("EB", e.name, m) for e in graph.out_edges(name)] if last else []
            actions.append(Action("B", name, m))
            actions += [Action("EB", e.name, m) for e in graph.in_edges(name)] if first else []
    return actions


def check_schedule(graph: Graph, microbatches: int, training: bool) -> dict[int, list[Action]]:
    """Every rank's actions, checked (``check_actions``)."""
    world = graph.placement.world_size
    lists = {rank: rank_actions(graph, rank, microbatches, training) for rank in range(world)}
    check_actions(graph, lists)
    return lists


def check_actions(graph: Graph, lists: dict[int, list[Action]]) -> None:
    """Raise ``ScheduleError`` when the ranks' lists would mispair an edge's calls, let a module's stage
    replicas diverge, or deadlock (see the module docstring)."""
    _check_pairing(graph, lists)
    _simulate(graph, lists)


def _check_pairing(graph: Graph, lists: dict[int, list[Action]]) -> None:
    for edge in graph.edges:
        for op in ("EF", "EB"):
            orders = {r: [a.microbatch for a in lists[r] if a.op == op and a.target == edge.name]
                      for r in edge_ranks(graph, edge)}
            if len({tuple(o) for o in orders.values()}) > 1:
                raise ScheduleError(f"edge {edge.name}: its ranks make {op} calls in different orders: {orders}")
    for name, node in graph.nodes.items():
        by_stage: dict[int, dict[int, list]] = {}
        for rank, coord in node.layout.coords():
            mine = [a for a in lists[rank] if a.target == name]
            by_stage.setdefault(coord.pp, {})[rank] = mine
        for stage, orders in by_stage.items():
            if len({tuple(map(str, o)) for o in orders.values()}) > 1:
                raise ScheduleError(f"{name} stage {stage}: its ranks run different actions")


def _simulate(graph: Graph, lists: dict[int, list[Action]]) -> None:
    synchronous = graph.schedule == "phased"
    edges = {e.name: e for e in graph.edges}
    done: set[tuple] = set()  # (rank, action) executed
    position = dict.fromkeys(lists, 0)

    def executed(rank: int, action: Action) -> bool:
        return (rank, action) in done

    def ready(rank: int, action: Action) -> bool:
        if action.op in ("F", "B"):
            node = graph.nodes[action.target]
            coord = node.layout.coord(rank)
            step = -1 if action.op == "F" else 1
            if 0 <= coord.pp + step < node.layout.pp:
                return executed(node.layout.rank_at(coord._replace(pp=coord.pp + step)), action)
            return True
        edge = edges[action.target]
        ranks = edge_ranks(graph, edge)
        if synchronous:
            return all(position[r] < len(lists[r]) and lists[r][position[r]] == action for r in ranks)
        src, dst = graph.nodes[edge.src].layout, graph.nodes[edge.dst].layout
        senders = {r for r, c in src.coords() if c.pp == src.pp - 1} if action.op == "EF" else \
            {r for r, c in dst.coords() if c.pp == 0}
        return rank in senders or all(executed(r, action) for r in senders)

    while any(position[r] < len(lists[r]) for r in lists):
        progressed = False
        for rank in lists:
            while position[rank] < len(lists[rank]) and ready(rank, lists[rank][position[rank]]):
                action = lists[rank][position[rank]]
                if synchronous and action.op in ("EF", "EB"):
                    for peer in edge_ranks(graph, edges[action.target]):
                        done.add((peer, action))
                        position[peer] += 1
                else:
                    done.add((rank, action))
                    position[rank] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(lists[r][position[r]]) for r in lists if position[r] < len(lists[r])}
            raise ScheduleError(
                f"the {graph.schedule} schedule deadlocks: each rank waits at its next action: "
                + "; ".join(f"rank {r}: {a}" for r, a in sorted(stuck.items()))
            )
