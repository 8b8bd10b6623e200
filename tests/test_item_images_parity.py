"""Fixed-size images as items, LLaVA-style: any number per row (0-3 here, text-only rows among them), each
at its own placeholders. A SigLIP-shaped tower of items (``items: true``, no projector of its own) feeds a
projector module of items (a row edge that treats items as rows), which routes each image's tokens to its
placeholders in the LLM's rows (``hetero.parallel.token_route``). The runtime matches one process that
encodes and projects each image on its own and places it at its positions: 4 AdamW steps, fp32, 1e-5
(``check_parity``: losses, pre-clip gradient norms, every replica's gradients at step 1), not colocated
(tower and projector dp2 on ranks 0-1, LLM tp2 on 2-3) and colocated (all on two ranks; also the tower
pipelined, the projector under TP and the LLM under CP). A CLIP-shaped
tower (class token) on replicas that split the items otherwise than the projector's; the graph errors of
what cannot work; the batch checks.
"""

import functools
from dataclasses import replace

import pytest
import torch

from hetero.config import OptimizerConfig
from hetero.data.digits import IGNORE_INDEX
from hetero.errors import ConfigError
from hetero.testing.kinds import build_graph
from hetero.models import default_registry
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.model import GPT, token_loss_sum
from hetero.models.projector.config import ProjectorConfig
from hetero.models.projector.model import MLPProjector
from hetero.models.vit.config import ViTConfig
from hetero.models.vit.model import VisionEncoder
from hetero.testing.kinds import build_runtime
from hetero.runtime.rows import StepRows
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks
from hetero.testing.parity import check_parity, record_reference, record_run

# SigLIP-shaped, without the key bias (softmax cancels it: its gradient is rounding, which no relative
# tolerance compares).
VISION = ViTConfig(image_size=12, patch_size=4, channels=3, hidden_size=32, num_layers=2, num_heads=4, out_size=32,
                   class_token=False, activation="gelu_tanh", norm_eps=1e-6, projector=False, items=True)
# CLIP-shaped: a class token (dropped from the features), a LayerNorm before the blocks, LLaVA's layer -2.
CLIP_VISION = ViTConfig(image_size=12, patch_size=4, channels=3, hidden_size=32, num_layers=2, num_heads=4,
                        out_size=32, class_token=True, patch_bias=False, pre_norm=True, activation="quick_gelu",
                        feature_layer=-2, feature_norm=False, projector=False, items=True)
TOKENS = VISION.num_patches  # 9 per image
PROJECTOR = ProjectorConfig(in_size=32, out_size=48, tokens=TOKENS, items=True)
LLM = GPTConfig(vocab_size=64, hidden_size=48, num_layers=2, num_heads=4, ffn_hidden_size=64, seq_len=40)
OPTIM = {"vision": OptimizerConfig(lr=3e-3), "projector": OptimizerConfig(lr=3e-3), "llm": OptimizerConfig(lr=1e-2)}
STEPS, ROWS, CLIP = 4, 8, 0.5
# Images per row, per step (None: drawn). Step 1's second microbatch holds one image (a tower replica
# without any), step 3's first none at all.
COUNTS = ([0, 1, 2, 3, 1, 0, 0, 0], [3, 2, 0, 1, 2, 3, 1, 0], [0, 0, 0, 0, 2, 1, 0, 3], None)


@functools.cache
def batches() -> list[dict[str, torch.Tensor]]:
    """Rows of text with 0-3 images each, at drawn positions (one may open its row); the items listed in
    a shuffled order, not row by row."""
    gen = torch.Generator().manual_seed(5)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high, (), generator=gen))

    out = []
    for counts in COUNTS:
        counts = counts or [draw(0, 4) for _ in range(ROWS)]
        rows, places = [], []
        for r, count in enumerate(counts):
            tokens = [draw(1, LLM.vocab_size) for _ in range(draw(0, 4))]
            for _ in range(count):
                places.append((r, len(tokens)))
                tokens += [0] * TOKENS + [draw(1, LLM.vocab_size) for _ in range(draw(1, 4))]
            tokens += [draw(1, LLM.vocab_size) for _ in range(LLM.seq_len - len(tokens))]
            rows.append(tokens)
        tokens = torch.tensor(rows)
        labels = torch.full_like(tokens, IGNORE_INDEX)
        labels[:, :-1] = torch.where(tokens[:, 1:] != 0, tokens[:, 1:], IGNORE_INDEX)  # the text after each token
        order = torch.randperm(len(places), generator=gen)
        places = torch.tensor(places, dtype=torch.long).reshape(-1, 2)[order]
        out.append({"tokens": tokens, "labels": labels, "image_row": places[:, 0].clone(),
                    "image_start": places[:, 1].clone(),
                    "image_pixels": torch.rand(len(places), VISION.channels, 12, 12, generator=gen)})
    return out


def test_the_data_has_what_the_parity_needs():
    """Rows of 0, 1, 2 and 3 images, an image at a row's start, items out of row order, every image on
    placeholders inside its row."""
    for batch in batches():
        assert int((batch["labels"] != IGNORE_INDEX).sum()) > 0
        for i in range(len(batch["image_row"])):
            row, start = int(batch["image_row"][i]), int(batch["image_start"][i])
            assert start + TOKENS <= LLM.seq_len and bool((batch["tokens"][row, start : start + TOKENS] == 0).all())
        assert int((batch["tokens"] == 0).sum()) == TOKENS * len(batch["image_row"])
    first = batches()[0]
    assert set(torch.bincount(first["image_row"], minlength=ROWS).tolist()) == {0, 1, 2, 3}
    assert any(int(b["image_start"].min()) == 0 for b in batches() if len(b["image_start"]))
    assert not all(bool((b["image_row"].diff() >= 0).all()) for b in batches())


def build(modules: dict[str, torch.nn.Module], name: str, index: int, make) -> None:
    torch.manual_seed(index)  # as the runtime draws module ``index``'s weights (seed 0)
    modules[name] = make()


def reference(vision_config: ViTConfig, frozen=lambda module, parameter: False):
    """One process; ``frozen(module, parameter)``: the parameters it trains with ``requires_grad=False``."""
    modules: dict[str, torch.nn.Module] = {}
    build(modules, "vision", 0, lambda: VisionEncoder(vision_config))
    build(modules, "projector", 1, lambda: MLPProjector(PROJECTOR.in_size, PROJECTOR.out_size))
    modules["projector"].reset_parameters()
    build(modules, "llm", 2, lambda: GPT(LLM))
    for name, model in modules.items():
        for parameter, param in model.named_parameters():
            param.requires_grad_(not frozen(name, parameter))

    def loss(batch, step):
        rows = []
        for r in range(ROWS):
            h = modules["llm"].tok_embeddings(batch["tokens"][r : r + 1])
            for i in torch.nonzero(batch["image_row"] == r).flatten().tolist():
                start = int(batch["image_start"][i])
                image = modules["projector"](modules["vision"](batch["image_pixels"][i : i + 1]))
                h = torch.cat([h[:, :start], image, h[:, start + TOKENS :]], dim=1)
            rows.append(h)
        logits = modules["llm"](torch.cat(rows))
        return [token_loss_sum(logits, batch["labels"]) / int((batch["labels"] != IGNORE_INDEX).sum())]

    return record_reference(modules, OPTIM, batches(), loss, CLIP)


@pytest.fixture(scope="module")
def expected():
    return reference(VISION)


def items_experiment(world_size: int, layouts: dict, vision: ViTConfig = VISION, projector=PROJECTOR, edges=None,
                     settings=None):
    """``settings``: per module, more of its block (e.g. ``trainable``)."""
    kinds = {"vision": ("vit", vision), "projector": ("projector", projector), "llm": ("gpt", LLM)}
    modules = {name: module(kind, config, layouts[name], OPTIM[name], **(settings or {}).get(name, {}))
               for name, (kind, config) in kinds.items()}
    return experiment(world_size, modules, edges=edges or [("vision", "projector"), ("projector", "llm")],
                      global_batch=ROWS, microbatches=2, grad_clip=CLIP)


def train(rank, world_size, layouts, vision):
    runtime = build_runtime(items_experiment(world_size, layouts, vision))
    return record_run(runtime, batches())


CASES = {
    "not colocated: vision dp2 and projector dp2 (0-1), llm tp2 (2-3)": (
        4, {"vision": {"dp": 2}, "projector": {"dp": 2}, "llm": {"tp": 2, "offset": 2}}),
    "colocated on 2 ranks: vision dp2, projector dp2, llm tp2": (
        2, {"vision": {"dp": 2}, "projector": {"dp": 2}, "llm": {"tp": 2}}),
    "colocated on 2 ranks: vision pp2, projector tp2 (routes from both TP ranks), llm cp2": (
        2, {"vision": {"pp": 2}, "projector": {"tp": 2}, "llm": {"cp": 2}}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_images_as_items_train_with_parity(case, expected):
    world_size, layouts = CASES[case]
    results = run_ranks(train, world_size, layouts, VISION, timeout_s=300)
    print("\n" + check_parity(results, expected, f"item images {case}"))
    if world_size == 4:  # every routed token crosses: to both LLM TP ranks, its gradient back from one
        ideal = len(batches()[0]["image_row"]) * TOKENS * PROJECTOR.out_size * 4
        forward = sum(r.edge_bytes["projector->llm"][0] for r in results)
        backward = sum(r.edge_bytes["projector->llm"][2] for r in results)
        assert (forward, backward) == (2 * ideal, ideal), (forward, backward, ideal)


def test_a_clip_tower_of_items_feeds_a_projector_of_other_replicas():
    """A class token (dropped) and block -2's features; the tower's two replicas hand their runs of each
    microbatch's images to one projector replica (rank 0), which routes them to the LLM's two replicas."""
    layouts = {"vision": {"dp": 2}, "projector": {"dp": 1}, "llm": {"dp": 2}}
    results = run_ranks(train, 2, layouts, CLIP_VISION, timeout_s=300)
    print("\n" + check_parity(results, reference(CLIP_VISION), "item images, CLIP tower"))


@pytest.mark.parametrize("vision_dp,projector_dp", [(2, 2), (2, 1), (1, 2), (4, 2)])
def test_both_ends_of_a_row_edge_of_items_agree(vision_dp, projector_dp):
    """Each replica holds a contiguous run of the microbatch's items (all of one cost), so a row edge
    between two modules of items carries the same items in the same order on both sides."""
    layouts = {"vision": {"dp": vision_dp}, "projector": {"dp": projector_dp}, "llm": {"dp": 4}}
    graph = build_graph(items_experiment(4, layouts))
    tower_edge, routed = graph.edges
    assert not tower_edge.routed and routed.routed and routed.tokens == 0
    for batch in batches():
        rows = StepRows(graph, batch, 2)
        for m in range(2):
            items = rows.module("vision", m)
            assert torch.equal(items, rows.module("projector", m)) and torch.equal(rows.edge(tower_edge, m), items)
            assert sorted(items.tolist()) == sorted(torch.nonzero(batch["image_row"] // 4 == m).flatten().tolist())
            split = rows.split(tower_edge, m)
            sides = (("vision", vision_dp, split.source), ("projector", projector_dp, split.destination))
            for name, dp, counts in sides:
                held = [rows.carried(tower_edge, m, name, d) for d in range(dp)]
                assert torch.equal(torch.cat(held), items) and counts == tuple(len(h) for h in held)
                assert max(counts) - min(counts) <= 1


def test_a_row_edge_of_items_split_by_unequal_costs_is_refused_before_the_step():
    """Replicas that split items by cost hold them out of the order a row edge carries them in: every rank
    refuses the batch when it lays out the step's rows, before any message."""
    graph = build_graph(items_experiment(4, {"vision": {"dp": 2}, "projector": {"dp": 1}, "llm": {"dp": 4}}))

    class Varying(type(graph.nodes["vision"].kind)):
        def item_costs(self, config, batch):
            return torch.arange(len(batch["image_row"])) + 1

    graph = replace(graph, nodes=graph.nodes | {"vision": replace(graph.nodes["vision"], kind=Varying())})
    with pytest.raises(ValueError, match="vision->projector: vision's replicas split the edge's items by unequal"):
        StepRows(graph, batches()[1], 2)


def graph_error(world_size: int = 2, **change) -> str:
    layouts = {"vision": {"dp": 2}, "projector": {"dp": 2}, "llm": {"tp": 2}}
    with pytest.raises(ConfigError) as error:
        build_graph(items_experiment(world_size, layouts, **change))
    return str(error.value)


def test_what_cannot_carry_items_is_refused_at_graph_build():
    row_projector = ProjectorConfig(in_size=32, out_size=48, tokens=TOKENS)
    assert ("edges[0] (vision -> projector): vision hands on images as items, any number per row, but projector's "
            "input features takes one per row; set projector.model.items=true") in graph_error(projector=row_projector)
    row_vision = replace(VISION, items=False)
    assert ("edges[0] (vision -> projector): projector takes images as items, any number per row, but vision hands "
            "on one per row; set vision.model.items=true") in graph_error(vision=row_vision)
    native = replace(VISION, max_patches=9)
    assert ("edges[0] (vision -> projector): vision hands on each image's own number of tokens "
            "(vision.model.max_patches=9), which only placeholders take, not projector's input features; route "
            "vision straight into placeholders") in graph_error(vision=native)
    compressed = {"src": "projector", "dst": "llm", "compression": {"forward": {"method": "int8", "block_size": 16}}}
    assert ("edges[1] (projector -> llm): images' tokens routed to their placeholders travel uncompressed; turn "
            "edges[1].compression off") in graph_error(edges=[("vision", "projector"), compressed])
    fewer = ProjectorConfig(in_size=32, out_size=48, tokens=4, items=True)
    assert ("edges[0] (vision -> projector): vision hands on 9 tokens per image but projector's input features "
            "takes 4") in graph_error(projector=fewer)


def test_towers_of_items_route_straight_into_placeholders():
    """A tower with its own projector into the LLM: native resolution (which implies items: ``items`` there
    changes nothing) and fixed-size images as items both route."""
    for max_patches, items in ((9, False), (9, True), (0, True)):
        vision = replace(VISION, max_patches=max_patches, items=items, projector=True, out_size=LLM.hidden_size)
        modules = {"vision": module("vit", vision, {"dp": 2}, OPTIM["vision"]),
                   "llm": module("gpt", LLM, {"tp": 2}, OPTIM["llm"])}
        graph = build_graph(experiment(2, modules, edges=[("vision", "llm")], global_batch=ROWS, microbatches=2))
        assert graph.edges[0].routed


def test_item_columns():
    kinds, batch = default_registry(), batches()[0]
    vit, projector = kinds["vit"], kinds["projector"]
    assert vit.data_keys(VISION) == ("image_pixels",) and vit.per_item(VISION) and projector.per_item(PROJECTOR)
    assert vit.batch_errors("vision", VISION, batch) == projector.batch_errors("projector", PROJECTOR, batch) == []
    count = len(batch["image_row"])
    assert vit.item_tokens(VISION, batch).tolist() == [TOKENS] * count
    assert projector.item_tokens(PROJECTOR, batch).tolist() == [TOKENS] * count
    assert vit.item_costs(VISION, batch).tolist() == [TOKENS] * count  # every image its patches
    assert projector.item_costs(PROJECTOR, batch).tolist() == [1] * count
    assert vit.batch_errors("vision", VISION, batch | {"image_pixels": torch.rand(count, 3, 16, 16)}) == [
        "vision: the batch's image_pixels hold 3×16×16 values per item but vision.model.image_size=12; make them "
        "3×12×12 per item or set vision.model.image_size=16"]
    assert vit.batch_errors("vision", VISION, batch | {"image_pixels": torch.rand(count, 12, 12)}) == [
        "vision: the batch's image_pixels hold 12×12 values per item but vision takes 3×12×12 per item (channels × "
        "image_size × image_size)"]
    assert vit.batch_errors("vision", VISION, batch | {"image_start": batch["image_start"][1:]}) == [
        f"vision: the batch holds {count} images (image_pixels) but {count - 1} image_start entries; give every "
        f"image one"]
    assert vit.batch_errors("vision", VISION, {k: v for k, v in batch.items() if k != "image_row"}) == [
        "vision: images as items (vision.model.items=true) need the batch columns image_row: per image its pixels, "
        "its row and its first placeholder's position"]
    assert projector.batch_errors("projector", PROJECTOR, {"tokens": batch["tokens"]}) == [
        "projector reads the batch column image_row, which the batch lacks (it has tokens); add it to the data"]


def past_the_row(batch):
    batch["image_start"][0] = LLM.seq_len - 2


def outside_the_batch(batch):
    batch["image_row"][0] = ROWS


def one_place_short(batch):
    batch["image_row"] = batch["image_row"][1:]


def refused(rank, world_size, changes):
    """Each bad batch's error on this rank (every rank raises before any message: the same runtime goes on)."""
    layouts = {"vision": {"dp": 2}, "projector": {"dp": 2}, "llm": {"tp": 2}}
    runtime = build_runtime(items_experiment(world_size, layouts))
    messages = []
    for change in changes:
        batch = {key: value.clone() for key, value in batches()[0].items()}
        change(batch)
        with pytest.raises(ValueError) as error:
            runtime.train_step(batch)
        messages.append(str(error.value))
    return messages


def test_a_batch_whose_images_do_not_fit_is_refused_on_every_rank():
    batch = batches()[0]
    row, count = int(batch["image_row"][0]), len(batch["image_row"])
    results = run_ranks(refused, 2, [past_the_row, outside_the_batch, one_place_short], timeout_s=120)
    assert results[0] == results[1] == [
        f"projector->llm: image 0 (row {row}) has its 9 placeholders at positions 38..46, outside the 40 positions "
        f"of llm's rows; pack its document into a row that holds it",
        f"projector->llm: image 0 belongs to row {ROWS}, outside the batch's rows 0..{ROWS - 1}; give image_row "
        f"values below {ROWS}",
        f"vision: the batch holds {count} images (image_pixels) but {count - 1} image_row entries; give every "
        f"image one",
    ]
