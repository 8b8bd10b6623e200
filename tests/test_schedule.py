"""Schedules as data: a pipeline stage's order, and the runtime's per-rank action lists for module graphs,
checked before any message (pairing of every edge's calls on both sides, replicas in step, no deadlock)."""

import random
from dataclasses import replace

import pytest

from hetero.errors import ConfigError
from hetero.testing.kinds import build_graph
from hetero.models.gpt.config import GPTConfig
from hetero.models.video.config import VideoConfig
from hetero.models.video.memory import MemoryConfig
from hetero.models.vit.config import ViTConfig
from hetero.parallel.pipeline import SCHEDULES, schedule_actions
from hetero.runtime.schedule import Action, ScheduleError, check_actions, check_schedule
from hetero.testing.experiments import experiment, module

VISION = ViTConfig(image_size=16, patch_size=8, hidden_size=32, num_layers=1, num_heads=4, out_size=32)
LLM = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, seq_len=16)
VIDEO = VideoConfig(frame_size=8, patch_size=4, hidden_size=32, num_layers=1, num_heads=4,
                    memory=MemoryConfig(policy="sliding", budget=3), condition_size=32)


def parse(text: str) -> list[Action]:
    return [Action(op, target, int(m)) for op, target, m in (item.split(":") for item in text.split())]


def test_1f1b_actions_four_stages_eight_microbatches():
    def actions(text):
        return [(a[0], int(a[1:])) for a in text.split()]

    assert schedule_actions("1f1b", 0, 4, 8) == actions("F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7")
    assert schedule_actions("1f1b", 1, 4, 8) == actions("F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7")
    assert schedule_actions("1f1b", 3, 4, 8) == actions("F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7")
    assert schedule_actions("gpipe", 2, 4, 3) == actions("F0 F1 F2 B0 B1 B2")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("num_stages,num_microbatches", [(1, 1), (4, 1), (4, 2), (4, 8), (8, 3)])
def test_actions_cover_every_microbatch_and_bound_memory(schedule, num_stages, num_microbatches):
    for s in range(num_stages):
        actions = schedule_actions(schedule, s, num_stages, num_microbatches)
        assert sorted(actions) == [(k, mb) for k in "BF" for mb in range(num_microbatches)]
        assert all(actions.index(("F", mb)) < actions.index(("B", mb)) for mb in range(num_microbatches))
        in_flight = [sum(1 if k == "F" else -1 for k, _ in actions[: i + 1]) for i in range(len(actions))]
        bound = num_microbatches if schedule == "gpipe" else min(num_stages - s, num_microbatches)
        assert max(in_flight) == bound


def test_bad_orders_are_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="'interleaved'.*gpipe, 1f1b"):
        schedule_actions("interleaved", 0, 2, 4)
    with pytest.raises(ValueError, match="num_microbatches=0 must be >= 1"):
        schedule_actions("1f1b", 0, 2, 0)
    with pytest.raises(ValueError, match="stage_index=2 is outside 0..1"):
        schedule_actions("gpipe", 2, 2, 1)


def vlm(layouts: dict, world: int, **top):
    modules = {"vision": module("vit", VISION, layouts["vision"]), "llm": module("gpt", LLM, layouts["llm"])}
    return build_graph(experiment(world, modules, edges=[("vision", "llm")], global_batch=8, microbatches=2, **top))


def test_the_phased_schedule_meets_the_edges_in_one_order_on_every_rank():
    graph = vlm({"vision": {"dp": 4}, "llm": {"tp": 2, "dp": 2}}, 4)
    assert graph.schedule == "phased"
    lists = check_schedule(graph, 2, training=True)
    assert lists[0] == parse("F:vision:0 F:vision:1 EF:vision->llm:0 EF:vision->llm:1 F:llm:0 B:llm:0 F:llm:1 "
                             "B:llm:1 EB:vision->llm:0 EB:vision->llm:1 B:vision:0 B:vision:1")
    assert all(lists[r] == lists[0] for r in range(4))
    assert check_schedule(graph, 2, training=False)[0] == parse(
        "F:vision:0 F:vision:1 EF:vision->llm:0 EF:vision->llm:1 F:llm:0 F:llm:1")


@pytest.mark.parametrize("layouts,world,schedule", [
    ({"vision": {"dp": 2}, "llm": {"dp": 2}}, 2, "phased"),  # colocated
    ({"vision": {"dp": 2}, "llm": {"pp": 2, "dp": 1}}, 2, "phased"),  # colocated, bubbles to fill: opt-in
    ({"vision": {"dp": 1}, "llm": {"dp": 1, "offset": 1}}, 2, "graph_1f1b"),  # disjoint
    ({"vision": {"dp": 4}, "llm": {"dp": 2, "offset": 2}}, 4, "graph_1f1b"),  # mixed
])
def test_auto_picks_phased_only_where_every_module_spans_every_rank(layouts, world, schedule):
    assert vlm(layouts, world).schedule == schedule
    assert vlm(layouts, world, schedule="phased").schedule == "phased"
    assert vlm(layouts, world, schedule="graph_1f1b").schedule == "graph_1f1b"


def graph_1f1b(llm_schedule="1f1b"):
    """vision (rank 0) -> llm pp2 (ranks 1-2) -> video (rank 3), every module on its own ranks."""
    modules = {"vision": module("vit", VISION, {"dp": 1}),
               "llm": module("gpt", LLM, {"pp": 2, "dp": 1, "offset": 1}, parallel={"pipeline_schedule": llm_schedule}),
               "video": module("video", VIDEO, {"dp": 1, "offset": 3})}
    return build_graph(experiment(4, modules, edges=[("vision", "llm"), ("llm", "video")], global_batch=8,
                                  microbatches=4))


def test_the_graph_1f1b_warms_up_each_stage_by_the_stages_after_it():
    graph = graph_1f1b()
    assert graph.schedule == "graph_1f1b"
    lists = check_schedule(graph, 4, training=True)
    forwards_first = {r: next(i for i, a in enumerate(acts) if a.op == "B") for r, acts in lists.items()}
    modules = {0: "vision", 1: "llm", 2: "llm", 3: "video"}
    # Forwards before the first backward: the stages after it (vision 3, llm stage 0: 2, stage 1: 1, video 0), + 1.
    assert {r: sum(a.op == "F" for a in lists[r][: forwards_first[r]]) for r in lists} == {0: 4, 1: 3, 2: 2, 3: 1}
    assert lists[3][:4] == parse("EF:llm->video:0 F:video:0 B:video:0 EB:llm->video:0")
    assert lists[2][:2] == parse("F:llm:0 EF:llm->video:0")
    for rank, name in modules.items():
        assert {a.target for a in lists[rank] if a.op in "FB"} == {name}


def test_a_schedule_whose_sides_call_an_edge_in_other_orders_is_refused():
    graph = vlm({"vision": {"dp": 4}, "llm": {"tp": 2, "dp": 2}}, 4)
    lists = check_schedule(graph, 2, training=True)
    lists[3] = [a for a in lists[3]]
    i, j = lists[3].index(Action("EF", "vision->llm", 0)), lists[3].index(Action("EF", "vision->llm", 1))
    lists[3][i], lists[3][j] = lists[3][j], lists[3][i]
    with pytest.raises(ScheduleError, match="edge vision->llm: its ranks make EF calls in different orders"):
        check_actions(graph, lists)


def test_a_schedule_that_would_deadlock_is_refused_before_any_message():
    """The LLM's last stage in GPipe order waits for microbatch 3, which its first stage (1F1B, warmed up
    by 3) sends only after the gradient of microbatch 0 came back."""
    graph = graph_1f1b()
    lists = check_schedule(graph, 4, training=True)
    gpipe = check_schedule(graph_1f1b("gpipe"), 4, training=True)
    lists[2] = gpipe[2]
    with pytest.raises(ScheduleError, match="deadlocks: each rank waits at its next action: rank 0: .*rank 1: B llm 0; rank 2: F llm 3"):
        check_actions(graph, lists)


def random_layouts(rng, world: int) -> dict[str, dict] | None:
    """A layout per module of the four-module graph: a random run of ranks each (the LLM's pipelined),
    None where the runs leave a rank without a module."""
    layouts = {}
    for name in ("vision", "dna", "llm", "video"):
        size = rng.choice([d for d in (1, 2, 4, 8) if d <= world])
        pp = rng.choice([p for p in (1, 2, 4) if p <= size]) if name == "llm" else 1
        layouts[name] = {"dp": size // pp, "pp": pp, "offset": rng.randrange(world - size + 1), "size": size}
    covered = set().union(*(range(lay["offset"], lay["offset"] + lay["size"]) for lay in layouts.values()))
    return layouts if covered == set(range(world)) else None


def test_the_graph_1f1b_finds_an_order_on_any_placement():
    """Random placements of vision, dna, llm (pipelined) and video over 2-8 ranks, partly shared, partly
    not, 1-8 microbatches: both schedules find lists that pair and do not deadlock, training and evaluating
    (an earlier merge let two ranks wait in two edge calls, each for the other: on dna_vlm, the colocated
    full graph and most random placements)."""
    from test_graph_parity import graph_experiment

    rng, checked = random.Random(0), 0
    while checked < 60:
        world, microbatches = rng.choice([2, 4, 8]), rng.choice([1, 2, 4, 8])
        layouts = random_layouts(rng, world)
        if layouts is None:
            continue
        try:
            graph = build_graph(graph_experiment(world, layouts, 16, microbatches, {}, "graph_1f1b"))
        except ConfigError:  # e.g. rows that do not split over a module's replicas
            continue
        for training in (True, False):
            check_schedule(graph, microbatches, training)
            check_schedule(replace(graph, schedule="phased"), microbatches, training)
        checked += 1
