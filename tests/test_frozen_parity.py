"""Frozen modules and parameters, as LLaVA's two stages train: ``trainable: false`` freezes a module,
``frozen`` globs some of its parameters. The runtime matches one process in which the same parameters
have ``requires_grad=False`` (``check_parity``: losses and pre-clip gradient norms of 4 steps, the trained
parameters' gradients on every replica, 1e-5) on the images-as-items VLM (a tower, a projector, an LLM):
stage 1 (tower and LLM frozen: the LLM still passes gradients back to the projector); stage 2 (the tower
frozen) not colocated, colocated, with the LLM at pp2 and with the tower pipelined over two stages; a
glob freezing the LLM's first block, also under FSDP2. On every rank the frozen weights are bitwise what
they were after 5 steps, and a module with nothing trained at or above it holds no gradients, no
optimizer and no gradient sync, runs no backward, and its edge carries no gradient back (0 bytes)."""

import fnmatch
from dataclasses import replace

import pytest
import torch

from hetero.errors import ConfigError
from hetero.testing.kinds import build_graph
from hetero.testing.kinds import build_runtime
from hetero.runtime.schedule import check_schedule
from hetero.testing.multiprocess import run_ranks
from hetero.testing.parity import check_parity, record_run
from test_item_images_parity import VISION, batches, items_experiment, reference

FROZEN = {
    "stage 1": {"vision": {"trainable": False}, "llm": {"trainable": False}},
    "stage 2": {"vision": {"trainable": False}},
    "llm block 0": {"llm": {"frozen": ["layers.0.*"]}},
    "fsdp": {"vision": {"trainable": False, "parallel": {"fsdp": True}},
             "llm": {"frozen": ["layers.0.*"], "parallel": {"fsdp": True}}},
}
NOT_COLOCATED = (4, {"vision": {"dp": 2}, "projector": {"dp": 2, "offset": 2}, "llm": {"tp": 2, "offset": 2}})
CASES = {
    "stage 1, not colocated: vision dp2 (0-1), projector dp2 and llm tp2 (2-3)": ("stage 1", *NOT_COLOCATED),
    "stage 2, not colocated: vision dp2 (0-1), projector dp2 and llm tp2 (2-3)": ("stage 2", *NOT_COLOCATED),
    "stage 2, colocated on 2 ranks: vision dp2, projector dp2, llm tp2": (
        "stage 2", 2, {"vision": {"dp": 2}, "projector": {"dp": 2}, "llm": {"tp": 2}}),
    "stage 2, llm pp2: vision dp2, projector dp2 (0-1), llm pp2 (2-3)": (
        "stage 2", 4, {"vision": {"dp": 2}, "projector": {"dp": 2}, "llm": {"pp": 2, "offset": 2}}),
    "stage 2, colocated on 2 ranks: vision pp2 (a forward-only pipeline), projector tp2, llm cp2": (
        "stage 2", 2, {"vision": {"pp": 2}, "projector": {"tp": 2}, "llm": {"cp": 2}}),
    "llm block 0 frozen, colocated on 2 ranks: vision dp2, projector dp2, llm tp2": (
        "llm block 0", 2, {"vision": {"dp": 2}, "projector": {"dp": 2}, "llm": {"tp": 2}}),
    "fsdp, colocated on 2 ranks: vision dp2 frozen, projector dp2, llm dp2 with block 0 frozen": (
        "fsdp", 2, {"vision": {"dp": 2}, "projector": {"dp": 2}, "llm": {"dp": 2}}),
}


def is_frozen(frozen: dict, module: str, parameter: str) -> bool:
    settings = frozen.get(module, {})
    return not settings.get("trainable", True) or any(fnmatch.fnmatchcase(parameter, p) for p in settings.get("frozen", ()))


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def train(rank, world_size, layouts, frozen):
    runtime = build_runtime(items_experiment(world_size, layouts, settings=frozen))
    before = {(name, p): whole(param) for name, state in runtime.modules.items()
              for p, param in state.model.named_parameters() if is_frozen(frozen, name, p)}
    record = record_run(runtime, batches())
    runtime.train_step(batches()[0])  # a fifth step
    after = {(name, p): whole(param) for name, state in runtime.modules.items()
             for p, param in state.model.named_parameters() if is_frozen(frozen, name, p)}
    modules = {name: {"grads": sum(p.grad is not None for p in state.model.parameters()),
                      "optimizer": state.optimizer is not None, "synced": state.replica_sync.bytes_sent}
               for name, state in runtime.modules.items()}
    return record, [key for key in before if not torch.equal(before[key], after[key])], modules


@pytest.mark.parametrize("case", list(CASES))
def test_frozen_modules_and_parameters_train_with_parity(case):
    recipe, world_size, layouts = CASES[case]
    frozen = FROZEN[recipe]
    expected = reference(VISION, lambda module, parameter: is_frozen(frozen, module, parameter))
    results = run_ranks(train, world_size, layouts, frozen, timeout_s=300)
    records = [record for record, _, _ in results]
    print("\n" + check_parity(records, expected, f"frozen, {case}"))
    for rank, (_, changed, modules) in enumerate(results):
        assert not changed, f"rank {rank}: frozen weights changed: {changed[:4]}"
        if "vision" in modules and FROZEN[recipe].get("vision"):  # nothing trains at or above the tower
            assert modules["vision"] == {"grads": 0, "optimizer": False, "synced": 0}, (rank, modules)
        if "llm" in modules and recipe == "stage 1":
            assert modules["llm"]["grads"] == 0 and not modules["llm"]["optimizer"], (rank, modules)
    backward = {edge: sum(r.edge_bytes[edge][2] for r in records) for edge in records[0].edge_bytes}
    print(f"{case}: gradient bytes back across each edge at step 1: {backward}")
    if world_size == 4:
        assert backward["projector->llm"] > 0  # the LLM passes the projector its gradients, frozen or not
    if layouts["projector"].get("offset"):  # the tower's edge crosses ranks: forward only
        assert backward["vision->projector"] == 0


def test_globs_are_checked_before_launch_and_frozen_modules_run_forward_only():
    layouts = NOT_COLOCATED[1]
    with pytest.raises(ConfigError, match=r"llm.frozen: 'blocks.\*' matches no parameter of llm; its parameters are "
                                          r"named like tok_embeddings.weight, layers.0.attention_norm.weight"):
        build_graph(items_experiment(4, layouts, settings={"llm": {"frozen": ["layers.0.*", "blocks.*"]}}))
    graph = build_graph(items_experiment(4, layouts, settings=FROZEN["stage 1"]))
    assert [(n, graph.nodes[n].trains, graph.backward(n)) for n in graph.order] == [
        ("vision", False, False), ("projector", True, True), ("llm", False, True)]
    everything = build_graph(items_experiment(4, layouts, settings={"llm": {"frozen": ["*"]}}))
    assert not everything.nodes["llm"].trains  # every parameter frozen: as trainable=false
    for schedule in ("phased", "graph_1f1b"):
        actions = check_schedule(replace(graph, schedule=schedule), 2, True)
        tower = [str(a) for a in actions[0]]  # rank 0: the tower's first replica
        assert sorted(tower) == ["EF vision->projector 0", "EF vision->projector 1", "F vision 0", "F vision 1"], tower
        assert not any(a.op == "EB" and a.target == "vision->projector" for acts in actions.values() for a in acts)
