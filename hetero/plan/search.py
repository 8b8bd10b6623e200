"""Search per-module layouts and placements with the cost model; predict a configured experiment.

A workload is one LLM, the encoders that feed it and the consumers its hidden states condition. Four
placement modes over the same world of N devices:

- homogeneous: every module takes the LLM's grid (tp, cp, dp on all N ranks); encoders run inside the
  LLM's first pipeline stage, consumers inside its last, once per LLM microbatch (how a single-layout
  framework runs them);
- colocated: every module on all N ranks with its own layout, one after the other in a step (``phased``);
- colocated_1f1b: the same layouts under one 1F1B over the graph (``graph_1f1b``): the other modules' work
  fills the LLM pipeline's warm-up and cool-down bubbles, (pp - 1) slots of its slowest stage on every
  rank, except one microbatch of each, which runs before the LLM's first forward and after its last
  backward; their activations stay alive for a pipeline's depth of microbatches, not all;
- non-colocated: the encoders on ranks of their own (together, taking turns, when several), the LLM on
  the next, the consumers on the last; the graph runs as one pipeline, so a step takes the slowest side
  plus the other sides' share of one microbatch (fill and drain), plus the boundary transfers
  (``predict_configured`` also prices a configured ``phased`` schedule there: the sides in turn).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hetero.config import ExperimentConfig
from hetero.errors import ConfigError
from hetero.graph.build import resolve_schedule
from hetero.parallel.placement import Placement
from hetero.plan.cluster import ClusterSpec
from hetero.plan.cost import GIB, Choice, CostModel, ModuleCost, Transformer, send_s
from hetero.plan.workload import Workload, training_modes, workload_of

# megatron: the homogeneous layout as Megatron runs it by default (the encoders whole in the first
# stage, the LLM's layers split evenly); homogeneous: the same with the first stage's layers tuned.
MODES = ("megatron", "homogeneous", "colocated", "colocated_1f1b", "non_colocated")
BASELINES = ("megatron", "homogeneous")


@dataclass
class Plan:
    mode: str
    ranks: dict[str, int]
    choices: dict[str, Choice]
    costs: dict[str, ModuleCost]
    step_s: float
    memory_gib: float  # the fullest rank's
    boundary_s: float
    model_flops: float
    world_size: int
    folded: tuple[str, ...] = ()  # modules whose forwards and backwards run inside another's stage (homogeneous)
    host_s: float = 0.0  # the busiest rank's image decoding per step, by its data workers beside the step

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.step_s / self.world_size / 1e12

    def breakdown(self) -> dict[str, float]:
        """Where a rank's step goes, averaged over the ranks (seconds; the three add up to ``step_s``):
        compute (forwards, backwards, optimizer), exposed communication (TP, CP, stage hops, gradient
        syncs, the boundary: none hidden behind compute in this model) and the rest, idle (pipeline
        bubbles, a faster side waiting for a slower one)."""
        compute = comm = 0.0
        for name, cost in self.costs.items():
            share = self.ranks[name] / self.world_size  # a module on every rank counts whole
            if name in self.folded:  # its work is in the stage time of the module it runs inside
                comm += share * cost.dp_s
                continue
            compute += share * cost.work_s
            comm += share * cost.comm_s
        comm += self.boundary_s
        return {"compute_s": compute, "comm_s": comm, "idle_s": max(self.step_s - compute - comm, 0.0)}

    def describe(self) -> str:
        parts = [f"{n}[{self.ranks[n]}] {c.label()}" for n, c in self.choices.items()]
        return "; ".join(parts)


def _powers(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else []


class Planner:
    def __init__(self, cluster: ClusterSpec, workload: Workload):
        self.cluster, self.workload = cluster, workload
        self.model = CostModel(cluster)
        self._paired_cache: dict[tuple, dict[str, tuple[Choice, ModuleCost]] | None] = {}
        self._llm_cache: dict[tuple[int, int | None], list[tuple[Choice, ModuleCost]]] = {}

    def choices(self, module: Transformer, ranks: int, samples: int, *, pp: bool, cp: bool) -> list[Choice]:
        """Every layout of ``module`` on ``ranks`` devices that runs ``samples`` per step."""
        found = []
        node = self.cluster.gpus_per_node
        is_llm = module is self.workload.llm
        for tp in _powers(min(node, ranks)):
            if module.heads % tp or module.kv_heads % tp or module.ffn % tp or (module.vocab and module.vocab % tp):
                continue
            for c in _powers(ranks // tp) if cp else [1]:
                if module.seq % c:
                    continue
                # Any stage count up to the layer count (stages may differ by one layer, as in Megatron).
                for p in range(1, min(module.layers, ranks // (tp * c)) + 1) if pp else [1]:
                    if ranks % (tp * c * p):
                        continue
                    dp = ranks // (tp * c * p)
                    # The LLM's sequences split evenly; encoder samples (images) may leave replicas uneven.
                    if is_llm and samples % dp or samples < dp:
                        continue
                    if is_llm:
                        micros = [m for m in self.workload.llm_micro if (samples // dp) % m == 0]
                    else:  # an even split of the replica's samples into 1, 2, 4, ... microbatches
                        replica = math.ceil(samples / dp)
                        micros = sorted({math.ceil(replica / k) for k in _powers(replica)})
                    for micro in micros:
                        for recompute in (False, True):
                            found.append(Choice(tp, c, p, dp, micro, recompute))
        return found

    def encoder_choices(self, encoder: Transformer, ranks: int, microbatches: int) -> list[Choice]:
        """Layouts of an encoder on ``ranks`` devices that split its samples into the LLM's number of
        microbatches (hetero's schedules pair encoder and LLM microbatches one to one)."""
        samples, found = self.workload.samples(encoder.name), []
        for tp in _powers(min(self.cluster.gpus_per_node, ranks)):
            if encoder.heads % tp or encoder.ffn % tp or ranks % tp or samples < ranks // tp:
                continue
            dp = ranks // tp
            micro = math.ceil(math.ceil(samples / dp) / microbatches)
            found += [Choice(tp, 1, 1, dp, micro, recompute) for recompute in (False, True)]
        return found

    def _paired(self, llm_cost: ModuleCost, ranks: dict[str, int], held: int | None,
                budget: float) -> dict[str, tuple[Choice, ModuleCost]] | None:
        """Each module's (of ``ranks``) fastest layout on its ranks, paired with the LLM's microbatches,
        within ``budget`` bytes of memory per rank (``None`` when none fits)."""
        key = (tuple(ranks.items()), llm_cost.microbatches, held, budget)
        if key not in self._paired_cache:
            self._paired_cache[key] = self._fastest_pairing(llm_cost.microbatches, ranks, held, budget)
        return self._paired_cache[key]

    def _fastest_pairing(self, microbatches: int, ranks: dict[str, int], held: int | None,
                         budget: float) -> dict[str, tuple[Choice, ModuleCost]] | None:
        picks, memory = {}, 0.0
        for name in ranks:
            encoder = self.workload.others[name]
            best = None
            for choice in self.encoder_choices(encoder, ranks[name], microbatches):
                cost = self.model.module_cost(encoder, choice, self.workload.samples(name),
                                              self.workload.grad_ratio.get(name, 1.0), held_microbatches=held)
                if memory + cost.memory_bytes <= budget and (best is None or cost.step_s < best[1].step_s):
                    best = (choice, cost)
            if best is None:
                return None
            picks[name] = best
            memory += best[1].memory_bytes
        return picks

    def llm_options(self, ranks: int, keep: int | None = None) -> list[tuple[Choice, ModuleCost]]:
        if (ranks, keep) not in self._llm_cache:
            self._llm_cache[ranks, keep] = self._fastest_llm_layouts(ranks, keep)
        return self._llm_cache[ranks, keep]

    def _fastest_llm_layouts(self, ranks: int, keep: int | None) -> list[tuple[Choice, ModuleCost]]:
        llm = self.workload.llm
        options = []
        for choice in self.choices(llm, ranks, self.workload.sequences, pp=True, cp=True):
            cost = self.model.module_cost(llm, choice, self.workload.sequences, self.workload.grad_ratio.get(llm.name, 1.0),
                                          hop_element_bytes=self.workload.stage_element_bytes)
            if self.model.fits(cost.memory_bytes):
                options.append((choice, cost))
        options.sort(key=lambda pair: pair[1].step_s)
        return options[:keep] if keep else options

    def homogeneous(self, world: int, even: bool = False) -> list[Plan]:
        """Every module on the LLM's grid; encoders inside its first stage, consumers inside its last. The
        first stage takes the number of the LLM's layers that is fastest, or with ``even`` its even share
        (Megatron's default: plans of mode ``megatron``)."""
        llm, plans = self.workload.llm, []
        for choice in self.choices(llm, world, self.workload.sequences, pp=True, cp=True):
            extra, extra_last, encoder_costs, encoder_memory = 0.0, 0.0, {}, 0.0
            for name, encoder in self.workload.others.items():
                per_micro = choice.micro * self.workload.per_sequence[name]  # samples per LLM microbatch
                count = max(1, round(per_micro))
                shared = Choice(choice.tp, 1, 1, choice.dp, count, choice.recompute)
                if encoder.heads % choice.tp or encoder.ffn % choice.tp:
                    break
                cost = self.model.module_cost(encoder, shared, count * choice.dp, self.workload.grad_ratio.get(name, 1.0))
                encoder_costs[name] = cost
                if name in self.workload.consumers:  # the last stage runs it and, at once, its backward
                    extra_last += cost.microbatch_s * per_micro / count
                    encoder_memory += cost.memory_bytes
                    continue
                extra += cost.microbatch_s * per_micro / count
                # Stage 0 keeps the encoder's weights and, per in-flight microbatch, its activations.
                encoder_memory += cost.memory_bytes * min(choice.pp, math.ceil(self.workload.sequences / choice.dp / choice.micro))
            else:
                # Like Megatron's --decoder-first-pipeline-num-layers: the encoder's stage may take fewer layers.
                firsts = range(math.ceil(llm.layers / choice.pp) + 1) if choice.pp > 1 and not even else [None]
                cost = min(
                    (self.model.module_cost(llm, choice, self.workload.sequences, self.workload.grad_ratio.get(llm.name, 1.0),
                                            extra_first_stage_s=extra, first_stage_layers=first,
                                            hop_element_bytes=self.workload.stage_element_bytes,
                                            extra_last_stage_s=extra_last) for first in firsts),
                    key=lambda c: c.step_s,
                )
                memory = cost.memory_bytes + encoder_memory
                if not self.model.fits(memory):
                    continue
                host = sum(self.host_s(n, choice.dp) for n in self.workload.others)  # stage 0's ranks decode
                step = max(cost.step_s + sum(c.dp_s for c in encoder_costs.values()), host)
                ranks = {n: world for n in [*self.workload.others, llm.name]}
                choices = {n: choice for n in self.workload.others} | {llm.name: choice}  # one grid for all
                plans.append(Plan("megatron" if even else "homogeneous", ranks, choices, encoder_costs | {llm.name: cost}, step,
                                  memory / GIB, 0.0, self.workload.model_flops, world, tuple(encoder_costs), host))
        return sorted(plans, key=lambda plan: plan.step_s)

    def colocated(self, world: int) -> list[Plan]:
        llm, plans = self.workload.llm, []
        usable = self.model.device.usable_memory * self.model.device.memory_gib * GIB
        others = list(self.workload.others)
        boundary = self._boundary_s(world, world, others) if others else 0.0
        for choice, cost in self.llm_options(world):
            # Phased, every microbatch is encoded before the LLM runs: all stay alive until its backward;
            # under one 1F1B an encoder holds a pipeline's depth of microbatches (consumers priced alike).
            for mode, held in (("colocated", cost.microbatches), ("colocated_1f1b", min(choice.pp + 1, cost.microbatches))):
                picks = self._paired(cost, dict.fromkeys(others, world), held, usable - cost.memory_bytes)
                if picks is None:
                    continue
                encoders = [c for _, c in picks.values()]
                step = (phased_colocated_s if mode == "colocated" else graph_1f1b_colocated_s)(cost, encoders) + boundary
                host = sum(self.host_s(n, c.dp) for n, (c, _) in picks.items())
                memory = cost.memory_bytes + sum(c.memory_bytes for c in encoders)
                plans.append(Plan(mode, dict.fromkeys([*picks, llm.name], world),
                                  {n: c for n, (c, _) in picks.items()} | {llm.name: choice},
                                  {n: c for n, (_, c) in picks.items()} | {llm.name: cost}, max(step, host),
                                  memory / GIB, boundary, self.workload.model_flops, world, host_s=host))
        return sorted(plans, key=lambda plan: plan.step_s)

    def plans_of(self, mode: str, plans: list[Plan]) -> list[Plan]:
        return [p for p in plans if p.mode == mode]

    def non_colocated(self, world: int, keep: int = 8) -> list[Plan]:
        """The encoders on the first ranks (together, when several), the LLM on the next, its consumers on
        the last (together), under one 1F1B over the graph, with the LLM's ``keep`` fastest layouts on its
        share. Without consumers, every count of encoder ranks is tried. With both encoders and consumers,
        each side takes one of its useful rank counts (``_side_counts``) and the LLM the rest."""
        encoders, consumers = list(self.workload.encoders), list(self.workload.consumers)
        if encoders and consumers:
            splits = [(e, c) for e in self._side_counts(encoders, world - 2)
                      for c in self._side_counts(consumers, world - 1 - e)]
        elif encoders:
            splits = [(e, 0) for e in range(1, world)]
        elif consumers:
            splits = [(0, c) for c in range(1, world)]
        else:
            return []
        plans = []
        for before, after in splits:
            for choice, cost in self.llm_options(world - before - after, keep):
                plan = self.three_sides(world, before, after, choice, cost)
                if plan is not None:
                    plans.append(plan)
        return sorted(plans, key=lambda plan: plan.step_s)

    def _side(self, names: list[str], ranks: int, cost: ModuleCost,
              held: int) -> dict[str, tuple[Choice, ModuleCost]] | None:
        """The fastest layouts of ``names`` sharing ``ranks``, paired with the LLM's microbatches (``cost``)."""
        usable = self.model.device.usable_memory * self.model.device.memory_gib * GIB
        return self._paired(cost, dict.fromkeys(names, ranks), held, usable) if names else {}

    def _side_counts(self, names: list[str], limit: int) -> list[int]:
        """Rank counts up to ``limit`` worth giving modules that share ranks: tp times the fewest replicas
        that bring some module's samples per replica down to a given count (more replicas at the same count
        add only gradient-sync time, and take ranks from the LLM)."""
        replicas = set()
        for name in names:
            samples = self.workload.samples(name)
            replicas |= {math.ceil(samples / math.ceil(samples / dp)) for dp in range(1, samples + 1)}
        tps = _powers(self.cluster.gpus_per_node)
        return sorted({tp * dp for tp in tps for dp in replicas if tp * dp <= limit})

    def three_sides(self, world: int, before: int, after: int, choice: Choice, cost: ModuleCost) -> Plan | None:
        """Encoders on ``before`` ranks, the LLM (``choice``) on the middle, consumers on ``after``."""
        encoders, consumers, llm = list(self.workload.encoders), list(self.workload.consumers), self.workload.llm
        # A graph pipeline: the encoders are stage 0 of 1 + pp stages (+ 1 for consumers) under 1F1B; the
        # consumers, the last stage, run each microbatch's backward right after its forward.
        front = self._side(encoders, before, cost, choice.pp + 1)
        back = self._side(consumers, after, cost, 1)
        if front is None or back is None:
            return None
        llm_ranks = world - before - after
        host = sum(self.host_s(n, c.dp) for n, (c, _) in front.items())  # the encoders' ranks decode
        sides = ([max(sum(c.step_s for _, c in front.values()), host)] if encoders else []) + [cost.step_s]
        sides += [sum(c.step_s for _, c in back.values())] if consumers else []
        m = cost.microbatches
        links = [self._boundary_s(before, llm_ranks, encoders, 2 * m) if encoders else None,
                 self._boundary_s(llm_ranks, after, consumers, 2 * m) if consumers else None]
        step, boundary = linked_pipeline_s(sides, links if encoders else [links[1]], m)
        picks = front | back
        ranks = dict.fromkeys(encoders, before) | {llm.name: llm_ranks} | dict.fromkeys(consumers, after)
        memory = max(sum(c.memory_gib for _, c in front.values()), cost.memory_gib,
                     sum(c.memory_gib for _, c in back.values()))
        return Plan("non_colocated", ranks, {n: c for n, (c, _) in picks.items()} | {llm.name: choice},
                    {n: c for n, (_, c) in picks.items()} | {llm.name: cost}, step, memory, boundary,
                    self.workload.model_flops, world, host_s=host)

    def host_s(self, name: str, replicas: int) -> float:
        """A rank's decoding per step for module ``name`` at ``replicas`` DP replicas (each replica's ranks
        decode that replica's share of the images; a consumer decodes none)."""
        if name not in self.workload.encoders:
            return 0.0
        return self.model.host_s(self.workload.encoders[name], math.ceil(self.workload.samples(name) / replicas))

    def _boundary_s(self, senders: int, receivers: int, names: list[str] | None = None, messages: int = 1) -> float:
        """The traffic between the LLM and ``names`` (default: the encoders), spread over the pairs of
        ranks that carry it, in ``messages`` messages per pair (each paying the link's latency)."""
        link = self.cluster.link(senders + receivers)
        pairs = min(senders, receivers)
        nbytes = self.workload.boundary_bytes(self.cluster.device.activation_bytes, names) / pairs
        return (messages - 1) * link.latency_us * 1e-6 + send_s(nbytes, link)

    def plans(self, world: int | None = None) -> dict[str, list[Plan]]:
        """Every placement mode's plans that fit, fastest first."""
        world = world or self.cluster.world_size
        colocated = self.colocated(world)
        return {"megatron": self.homogeneous(world, even=True), "homogeneous": self.homogeneous(world),
                "colocated": self.plans_of("colocated", colocated),
                "colocated_1f1b": self.plans_of("colocated_1f1b", colocated), "non_colocated": self.non_colocated(world)}


def graph_pipeline_s(sides: list[float], microbatches: int, ahead: bool = False) -> float:
    """A step of disjoint sets of ranks chained by one 1F1B over the graph (each side's step time given):
    the slowest side's step, plus every other side's share of one microbatch (filling and draining). A
    first side that computes ``ahead`` the next step's first microbatches during this one (a forward-only
    encoder, ``parallel.forward_ahead``) has them ready when the step starts: its fill is hidden, unless
    it is itself the slowest."""
    slowest = max(sides)
    fill = sum(sides) - slowest
    if ahead and sides[0] < slowest:
        fill -= sides[0]
    return slowest + fill / microbatches


def linked_pipeline_s(sides: list[float], links: list[float | None], microbatches: int,
                      ahead: bool = False) -> tuple[float, float]:
    """A graph pipeline of disjoint ``sides`` whose neighbours are joined by ``links`` (``links[i]`` between
    side i and i + 1, None where they are not joined; each the step's whole transfer, microbatch by
    microbatch): each link is a stage of its own, hidden behind compute but for its share of one
    microbatch, unless it is the slowest. The step and the links' exposed part."""
    chain = [sides[0]]
    for link, side in zip(links, sides[1:]):
        chain += ([link] if link is not None else []) + [side]
    bare = graph_pipeline_s(sides, microbatches, ahead)
    step = graph_pipeline_s(chain, microbatches, ahead)
    return step, step - bare


def phased_colocated_s(llm: ModuleCost, encoders: list[ModuleCost]) -> float:
    """A colocated step under ``phased``: each module's whole step in turn."""
    return llm.step_s + sum(c.step_s for c in encoders)


def graph_1f1b_colocated_s(llm: ModuleCost, encoders: list[ModuleCost]) -> float:
    """A colocated step under ``graph_1f1b``: the encoders' forwards and backwards go into the LLM
    pipeline's bubbles (``bubble_s`` on every rank), but one microbatch of each stays exposed (the first
    forward comes before the LLM's, the last backward after it); their syncs and optimizer steps stay
    outside."""
    hidden_work = sum(c.compute_s for c in encoders)
    exposed = max(hidden_work - llm.bubble_s, sum(c.microbatch_s for c in encoders))
    return llm.step_s + exposed + sum(c.dp_s + c.optimizer_s for c in encoders)


def predict_configured(experiment: ExperimentConfig, placement: Placement, cluster: ClusterSpec,
                       clip_frames: int = 32) -> Plan:
    """The cost model's step time for ``experiment`` exactly as configured (its layouts and ranks)."""
    workload = workload_of(experiment, activation_bytes=cluster.device.activation_bytes, clip_frames=clip_frames)
    planner = Planner(cluster, workload)
    llm = workload.llm.name
    choices, costs = {}, {}
    for name, layout in placement.layouts.items():
        module = workload.llm if name == llm else workload.others[name]
        choice = Choice(layout.tp, layout.cp, layout.pp, layout.dp, experiment.micro_batch_size(name),
                        experiment.modules[name].parallel.activation_checkpointing)
        choices[name] = choice
        costs[name] = planner.model.module_cost(module, choice, workload.samples(name), workload.grad_ratio[name],
                                                hop_element_bytes=workload.stage_element_bytes if name == llm else None)
    encoders, consumers, others = list(workload.encoders), list(workload.consumers), list(workload.others)
    relations = {placement.relation(name, llm) for name in others}
    ranks = {n: layout.size for n, layout in placement.layouts.items()}
    world = placement.world_size
    host = sum(planner.host_s(n, placement.layouts[n].dp) for n in encoders)  # the encoders' ranks decode
    if relations == {"overlapping"} and not consumers and all(_in_first_stage(placement, n, llm) for n in encoders):
        plan = _folded_plan(experiment, placement, workload, planner, choices, costs, ranks, world)
        return dataclasses.replace(plan, step_s=max(plan.step_s, host), host_s=host)
    front = {placement.layouts[n].ranks for n in encoders}
    back = {placement.layouts[n].ranks for n in consumers}
    if relations <= {"colocated"}:
        boundary = planner._boundary_s(world, world, others) if others else 0.0
        one_1f1b = resolve_schedule(experiment, placement) == "graph_1f1b"
        step = (graph_1f1b_colocated_s if one_1f1b else phased_colocated_s)(costs[llm], [costs[n] for n in others])
        step = max(step + boundary, host)
        mode = "colocated_1f1b" if one_1f1b else "colocated"
    elif relations == {"disjoint"} and len(front) <= 1 and len(back) <= 1 and (
            front == back or not front or not back or not set(*front) & set(*back)):
        m = costs[llm].microbatches
        front_link = planner._boundary_s(ranks[encoders[0]], ranks[llm], encoders, 2 * m) if encoders else None
        back_link = planner._boundary_s(ranks[llm], ranks[consumers[0]], consumers, 2 * m) if consumers else None
        before, after = max(sum(costs[n].step_s for n in encoders), host), sum(costs[n].step_s for n in consumers)
        if front == back:  # encoders and consumers take turns on one set of ranks
            side_s, links = [before + after, costs[llm].step_s], [(front_link or 0.0) + (back_link or 0.0)]
        else:
            side_s = [before] * bool(encoders) + [costs[llm].step_s] + [after] * bool(consumers)
            links = [front_link, back_link] if encoders else [back_link]
        if resolve_schedule(experiment, placement) == "phased":  # each side waits out the others' whole steps
            boundary = sum(link or 0.0 for link in links)
            step = sum(side_s) + boundary
        else:
            modes = training_modes(experiment)
            ahead = front != back and bool(encoders) and all(
                experiment.modules[n].parallel.forward_ahead and modes[n] == "forward" for n in encoders)
            step, boundary = linked_pipeline_s(side_s, links, m, ahead)
        mode = "non_colocated"
    else:
        raise ConfigError(
            "hetero plan predicts colocated placements, encoders (and consumers) that each share one set of "
            "ranks disjoint from the LLM's, and encoders on the LLM's first stage at its tp and dp (Megatron's); "
            f"this experiment's modules relate to the LLM as {sorted(relations)}"
        )
    memory = max(sum(costs[n].memory_bytes for n in placement.modules_on(r)) for r in range(world))
    return Plan(mode, ranks, choices, costs, step, memory / GIB, boundary, workload.model_flops, world, host_s=host)


def _in_first_stage(placement: Placement, name: str, llm: str) -> bool:
    """Whether ``name`` runs on exactly the ranks of the LLM's first pipeline stage, at its tp and dp."""
    layout, grid = placement.layouts[name], placement.layouts[llm]
    first = {rank for rank, coord in grid.coords() if coord.pp == 0}
    return set(layout.ranks) == first and (layout.tp, layout.dp, layout.cp, layout.pp) == (grid.tp, grid.dp, 1, 1)


def _folded_plan(experiment: ExperimentConfig, placement: Placement, workload: Workload, planner: Planner,
                 choices: dict[str, Choice], costs: dict[str, ModuleCost], ranks: dict[str, int], world: int) -> Plan:
    """Encoders on the LLM's first stage, under ``graph_1f1b`` as the planner's ``megatron`` mode prices
    them: each encoder's forward and backward per LLM microbatch added to that stage's slot, their syncs
    after the step."""
    llm = workload.llm.name
    if resolve_schedule(experiment, placement) == "phased":  # the encoders' whole steps, then the LLM's
        step = costs[llm].step_s + sum(costs[n].step_s for n in workload.encoders)
        memory = costs[llm].memory_bytes + sum(costs[n].memory_bytes for n in workload.encoders)
        return Plan("megatron", ranks, choices, costs, step, memory / GIB, 0.0, workload.model_flops, world)
    extra = sum(costs[n].compute_s / max(costs[llm].microbatches, 1) for n in workload.encoders)
    costs[llm] = planner.model.module_cost(workload.llm, choices[llm], workload.sequences, workload.grad_ratio[llm],
                                           extra_first_stage_s=extra, hop_element_bytes=workload.stage_element_bytes)
    step = costs[llm].step_s + sum(costs[n].dp_s + costs[n].optimizer_s for n in workload.encoders)
    memory = costs[llm].memory_bytes + sum(costs[n].memory_bytes for n in workload.encoders)
    return Plan("megatron", ranks, choices, costs, step, memory / GIB, 0.0, workload.model_flops, world,
                tuple(workload.encoders))
