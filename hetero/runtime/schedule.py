"""Schedules: the order in which each rank runs the same per-microbatch actions of a step.

An action is ``F``/``B`` (this rank's pipeline stage of a module, forward or backward, on a microbatch)
or ``EF``/``EB`` (an edge's forward or backward call on a microbatch: every rank of the source's last
stage and of the destination's first stage takes part). A schedule gives each rank its list:

- ``phased`` (modules share ranks): modules in graph order, each one's incoming edges then its forwards;
  a module nothing consumes (a sink) runs its whole pipeline schedule (1F1B or GPipe) there; then, in
  reverse order, each other module's outgoing edges backward and its backwards. Every rank meets the
  edges in one global order, so boundary calls pair without buffering.
- ``graph_1f1b`` (any placement): every module's stages keep their 1F1B order (GPipe if a module asks
  for it), warmed up by the stages on the longest path after them, receiving from their incoming edges
  before a first stage's forward and sending after a last stage's; the edges' sends are posted
  asynchronously, as between a module's own stages. A rank holding several modules interleaves them
  by a simulation of the step (``_graph_1f1b``); on disjoint placements each rank runs its one queue.

A module with nothing trained at or above it (``Graph.backward``: frozen, and so is every module it
reads from) runs forward only: no ``B`` in training, and no ``EB`` on its outgoing edges. Alone on its
ranks with ``parallel.forward_ahead`` = k, its list (F and EF only) is cut in two at run time
(``Runtime.train_step``): a step runs its actions of microbatches k.. and then those of the next step's
microbatches ..k-1, whose sends the receivers take in that next step. Every edge still carries the
microbatches in order, so the lists checked here pair as they are.

``check_schedule`` runs every rank's list in a simulation (``_Progress``: sends posted on entering an
action, receives waiting for their sends, edge calls of the phased schedule waiting for all their ranks) and checks that
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


def schedule_lists(graph: Graph, microbatches: int, training: bool) -> dict[int, list[Action]]:
    """Every rank's actions under the graph's schedule (unchecked)."""
    world = graph.placement.world_size
    if graph.schedule == "graph_1f1b":
        return _graph_1f1b(graph, world, microbatches, training)
    return {rank: _phased(graph, rank, microbatches, training) for rank in range(world)}


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
        if training and graph.is_sink(name) and graph.backward(name):
            node = graph.nodes[name]
            warmup = node.layout.pp - 1 - stage
            actions += [Action(op, name, m) for op, m in stage_order(node.options.pipeline_schedule, warmup, n)]
        else:
            actions += [Action("F", name, m) for m in range(n)]
    if training:
        for name in reversed(graph.order):
            if graph.is_sink(name) or not graph.backward(name):
                continue
            for edge in graph.out_edges(name):
                if rank in edge_ranks(graph, edge):
                    actions += [Action("EB", edge.name, m) for m in range(n)]
            if _stage_of(graph, name, rank) is not None:
                actions += [Action("B", name, m) for m in range(n)]
    return actions


def edge_senders(graph: Graph, action: Action) -> set[int]:
    """The ranks that hand data over in an edge call: the source's last stage in ``EF``, the destination's
    first stage in ``EB``."""
    edge = next(e for e in graph.edges if e.name == action.target)
    src, dst = graph.nodes[edge.src].layout, graph.nodes[edge.dst].layout
    if action.op == "EF":
        return {r for r, c in src.coords() if c.pp == src.pp - 1}
    return {r for r, c in dst.coords() if c.pp == 0}


def edge_receivers(graph: Graph, action: Action) -> set[int]:
    """The ranks that take data in an edge call: the destination's first stage in ``EF``, the source's
    last stage in ``EB``."""
    edge = next(e for e in graph.edges if e.name == action.target)
    src, dst = graph.nodes[edge.src].layout, graph.nodes[edge.dst].layout
    if action.op == "EF":
        return {r for r, c in dst.coords() if c.pp == 0}
    return {r for r, c in src.coords() if c.pp == src.pp - 1}


def _stage_queue(graph: Graph, name: str, rank: int, n: int, training: bool) -> list[Action]:
    """Module ``name``'s stage on ``rank``: its 1F1B order (GPipe if a module asks), warmed up by the
    stages on the longest path after it, each forward with the edge calls it needs before it (first
    stage) or makes after it (last stage), each backward likewise. An edge call appears once on a rank:
    where a rank holds both ends, with the end that hands data over (the source's forward, the
    destination's backward)."""
    node, stage = graph.nodes[name], _stage_of(graph, name, rank)
    first, last = stage == 0, stage == node.layout.pp - 1
    warmup = node.layout.pp - 1 - stage + graph.depth_after(name)
    backward = training and graph.backward(name)
    order = stage_order(_pipeline_schedule(graph, graph.order), warmup, n) if backward else [("F", m) for m in range(n)]

    def holds_source(edge: Edge) -> bool:
        src = graph.nodes[edge.src].layout
        coord = src.coord(rank)
        return coord is not None and coord.pp == src.pp - 1

    def holds_destination(edge: Edge) -> bool:
        coord = graph.nodes[edge.dst].layout.coord(rank)
        return coord is not None and coord.pp == 0

    actions: list[Action] = []
    for op, m in order:
        if op == "F":
            actions += [Action("EF", e.name, m) for e in graph.in_edges(name) if first and not holds_source(e)]
            actions.append(Action("F", name, m))
            actions += [Action("EF", e.name, m) for e in graph.out_edges(name) if last]
        else:
            actions += [Action("EB", e.name, m) for e in graph.out_edges(name) if last and not holds_destination(e)]
            actions.append(Action("B", name, m))
            actions += [Action("EB", e.name, m) for e in graph.in_edges(name) if first and graph.backward(e.src)]
    return actions


def _graph_1f1b(graph: Graph, world: int, n: int, training: bool) -> dict[int, list[Action]]:
    """One 1F1B over the whole module graph: every module's stage queues (``_stage_queue``) merged per
    rank by a simulation of the step. Whenever a rank is free it starts the first queue head that can
    run at once, by priority: an edge call in which it only sends (a peer waits for it); then backwards
    (the sooner a gradient returns, the sooner memory frees), an encoder's backward (no rank waits for it)
    last; then the earliest microbatch, then graph order (two encoders of one LLM alternate). When no
    rank can start anything, the ranks of one edge call enter it together: the first call, by microbatch
    (backward first) and edge order, that each of its ranks is in or, free, has at a queue head. A rank
    thus waits only in a call that all its ranks enter, so no two waits cross. A rank holding several
    modules fills one module's idle slots (a pipeline's warm-up and cool-down, a downstream module's wait
    for its input) with another's work. Every rank computes the same simulation, so the lists agree;
    ``check_actions`` checks them as any schedule."""
    def terminal(rank: int, action: Action) -> bool:
        """A first stage's backward of a module nothing feeds (an encoder's): no rank waits for it."""
        return action.op == "B" and not graph.in_edges(action.target) and _stage_of(graph, action.target, rank) == 0

    def hands_over(rank: int, action: Action) -> bool:
        """An edge call in which this rank only sends."""
        return action.op in ("EF", "EB") and rank not in edge_receivers(graph, action)

    queues = {rank: [_stage_queue(graph, name, rank, n, training) for name in graph.order
                     if _stage_of(graph, name, rank) is not None] for rank in range(world)}
    lists: dict[int, list[Action]] = {rank: [] for rank in range(world)}
    state = _Progress(graph, lists)
    edge_index = {e.name: i for i, e in enumerate(graph.edges)}

    def at_head(rank: int, action: Action) -> list[Action] | None:
        return next((q for q in queues[rank] if q and q[0] == action), None)

    def joinable(action: Action) -> bool:
        return all(state.entered(r, action) or (not state.blocked(r) and at_head(r, action) is not None)
                   for r in state.ranks[action.target])

    while any(q for qs in queues.values() for q in qs):
        progressed = False
        for rank in range(world):
            if state.blocked(rank):
                continue
            heads = [q for q in queues[rank] if q]
            ordered = sorted(heads, key=lambda q: (not hands_over(rank, q[0]), terminal(rank, q[0]),
                                                   q[0].op not in ("B", "EB"), q[0].microbatch))
            chosen = next((q for q in ordered if state.ready(rank, q[0])), None)
            if chosen is not None:
                lists[rank].append(chosen.pop(0))
                progressed = True
        if state.advance() or progressed:
            continue
        calls = {q[0] for r in range(world) if not state.blocked(r) for q in queues[r]
                 if q and q[0].op in ("EF", "EB")}
        call = min((c for c in calls if joinable(c)), default=None,
                   key=lambda c: (c.microbatch, c.op != "EB", edge_index[c.target]))
        if call is None:
            stuck = {r: [str(q[0]) for q in queues[r] if q] for r in queues if any(queues[r])}
            raise ScheduleError(f"the graph_1f1b schedule found no order for these queue heads: {stuck}")
        for r in state.ranks[call.target]:
            if not state.entered(r, call):
                lists[r].append(at_head(r, call).pop(0))
        state.advance()
    state.finish()
    return lists


class _Progress:
    """Where each rank is in its (growing) action list, and which actions are done: the semantics both
    the graph 1F1B's simulation and ``check_actions`` run by. Sends are posted on entering an action; a
    stage's forward waits for the previous stage's, a backward for the next stage's; an edge call
    completes on a rank that only hands data over at once (the source's ranks in ``EF``; the
    destination's in ``EB`` once every destination rank entered, for their reduce-scatter), and on
    every other rank once every rank of the call entered it. Under ``phased`` an edge call waits for all
    its ranks and completes on all of them together."""

    def __init__(self, graph: Graph, lists: dict[int, list[Action]]):
        self.graph, self.lists = graph, lists
        self.synchronous = graph.schedule == "phased"
        self.position = dict.fromkeys(lists, 0)
        self.done: set[tuple[int, Action]] = set()
        self.ranks = {e.name: edge_ranks(graph, e) for e in graph.edges}

    def blocked(self, rank: int) -> bool:
        """Whether ``rank`` is inside an action it entered and has not finished."""
        return self.position[rank] < len(self.lists[rank])

    def entered(self, rank: int, action: Action) -> bool:
        return (rank, action) in self.done or (self.blocked(rank) and self.lists[rank][self.position[rank]] == action)

    def ready(self, rank: int, action: Action) -> bool:
        if action.op in ("F", "B"):
            node = self.graph.nodes[action.target]
            coord = node.layout.coord(rank)
            step = -1 if action.op == "F" else 1
            if 0 <= coord.pp + step < node.layout.pp:
                return (node.layout.rank_at(coord._replace(pp=coord.pp + step)), action) in self.done
            # a first stage's forward needs its inputs, a last stage's backward its outputs' gradients:
            # this rank's part of those edge calls done (a rank holding both ends lists them elsewhere)
            edges = self.graph.in_edges(action.target) if action.op == "F" else self.graph.out_edges(action.target)
            op = "EF" if action.op == "F" else "EB"
            return all((rank, Action(op, e.name, action.microbatch)) in self.done for e in edges
                       if rank in self.ranks[e.name])
        ranks = self.ranks[action.target]
        if self.synchronous:
            return all(self.entered(r, action) for r in ranks)
        if rank in edge_receivers(self.graph, action):
            waits_for = ranks
        elif action.op == "EF":
            return True
        else:
            waits_for = edge_senders(self.graph, action)
        return all(r == rank or self.entered(r, action) for r in waits_for)

    def advance(self) -> bool:
        """Finish every entered action that can finish now; whether any did."""
        progressed, moving = False, True
        while moving:
            moving = False
            for rank in self.lists:
                if not self.blocked(rank):
                    continue
                action = self.lists[rank][self.position[rank]]
                if not self.ready(rank, action):
                    continue
                if self.synchronous and action.op in ("EF", "EB"):
                    for peer in self.ranks[action.target]:
                        self.done.add((peer, action))
                        self.position[peer] += 1
                else:
                    self.done.add((rank, action))
                    self.position[rank] += 1
                moving = progressed = True
        return progressed

    def finish(self) -> None:
        """Run what is left of the lists to their end, or raise ``ScheduleError`` naming where they stick."""
        while any(self.blocked(r) for r in self.lists):
            if not self.advance():
                stuck = {r: str(self.lists[r][self.position[r]]) for r in self.lists if self.blocked(r)}
                raise ScheduleError(
                    f"the {self.graph.schedule} schedule deadlocks: each rank waits at its next action: "
                    + "; ".join(f"rank {r}: {a}" for r, a in sorted(stuck.items()))
                )


def check_schedule(graph: Graph, microbatches: int, training: bool) -> dict[int, list[Action]]:
    """Every rank's actions, checked (``check_actions``)."""
    lists = schedule_lists(graph, microbatches, training)
    check_actions(graph, lists)
    return lists


def check_actions(graph: Graph, lists: dict[int, list[Action]]) -> None:
    """Raise ``ScheduleError`` when the ranks' lists would mispair an edge's calls, let a module's stage
    replicas diverge, or deadlock (see the module docstring)."""
    _check_pairing(graph, lists)
    _Progress(graph, lists).finish()


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
