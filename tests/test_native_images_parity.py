"""Images at native resolution, several per document, packed with text: the runtime matches one process
that encodes each image on its own and runs each document on its own. 6 AdamW steps, fp32, 1e-5
(``check_parity``: losses, pre-clip gradient norms, every replica's gradients at step 1).

Real photographs (scikit-image's, random crops of many aspect ratios) fitted to at most 12 patches of
4×4 each, so their grids vary (1×12 to 3×4); 0-2 images per document, documents packed into rows of
48 positions. The encoder runs each replica's images packed (no padding, each patch attending to its
own image), its replicas split the images by patch count, and the routed edge takes each image's tokens
to its own placeholders, under the LLM's CP, SP, TP and PP, colocated and not.
"""

import functools

import pytest
import torch

from hetero.config import OptimizerConfig
from hetero.data.native_images import (NativeImage, image_patches, image_places, load_photos, multimodal_document,
                                       photo_crops)
from hetero.data.packing import pack_rows, stack_rows
from hetero.data.digits import IGNORE_INDEX
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.model import token_loss_sum
from hetero.models.vit.config import ViTConfig
from hetero.parallel.options import ParallelOptions
from hetero.testing.kinds import build_runtime
from hetero.runtime.rows import StepRows
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks
from hetero.testing.parity import check_parity, record_reference, record_run
from hetero.testing.references import VisionLanguageModel

from test_packed_parity import documents_of

VISION = ViTConfig(image_size=16, patch_size=4, channels=1, hidden_size=32, num_layers=2, num_heads=4, out_size=32,
                   class_token=False, max_patches=12)
LLM = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                seq_len=48)
ROWS, STEPS, CLIP = 8, 6, 0.5
OPTIM = {"vision": OptimizerConfig(lr=3e-3), "llm": OptimizerConfig(lr=1e-2)}


@functools.cache
def batches(steps=STEPS):
    gen = torch.Generator().manual_seed(11)
    photos = load_photos(1)

    def text(low, high):
        return torch.randint(1, LLM.vocab_size, (int(torch.randint(low, high, (), generator=gen)),), generator=gen)

    def stream():
        while True:
            count = int(torch.randint(0, 3, (), generator=gen))
            images = [NativeImage(c, VISION.patch_size, VISION.max_patches) for c in photo_crops(photos, count, gen)]
            segments = [text(1, 4)] if bool(torch.rand((), generator=gen) < 0.5) else []
            for image in images:
                segments += [image, text(2, 6)]
            if not images:
                segments.append(text(3, 12))
            yield multimodal_document(segments)

    rows, out = pack_rows(stream(), LLM.seq_len), []
    width = VISION.channels * VISION.patch_size**2
    for _ in range(steps):
        chosen = [next(rows) for _ in range(ROWS)]
        places, images = image_places(chosen)
        out.append(stack_rows(chosen) | places | {"image_patches": image_patches(images, width)})
    return out


def encode_alone(vision, patches):
    """One image through the encoder on its own, without any mask: (patches, out_size)."""
    grid = patches[1]
    x = vision.patch_embed(patches[0]) + vision.grid_positions(*grid)
    x = x[None]
    for block in vision.layers.values():
        x = block(x)
    return vision.features(x[0])


def reference(steps=STEPS):
    model = VisionLanguageModel(VISION, LLM, seed=0)
    width = VISION.channels * VISION.patch_size**2

    def loss(batch, step):
        sizes = batch["image_grid"].prod(1)
        offsets = (sizes.cumsum(0) - sizes).tolist()
        total = 0
        for r in range(ROWS):
            for a, b in documents_of(batch, r):
                embeddings = model.llm.tok_embeddings(batch["tokens"][r : r + 1, a:b])
                for i in torch.nonzero(batch["image_row"] == r).flatten().tolist():
                    start = int(batch["image_start"][i])
                    if a <= start < b:
                        patches = batch["image_patches"][offsets[i] : offsets[i] + int(sizes[i])].view(-1, width)
                        tokens = encode_alone(model.vision, (patches, tuple(batch["image_grid"][i].tolist())))
                        embeddings = torch.cat([embeddings[:, : start - a], tokens[None],
                                                embeddings[:, start - a + len(tokens) :]], dim=1)
                logits = model.llm(embeddings)
                total = total + token_loss_sum(logits, batch["labels"][r : r + 1, a:b])
        return [total / int((batch["labels"] != IGNORE_INDEX).sum())]

    return record_reference({"vision": model.vision, "llm": model.llm}, OPTIM, batches(steps), loss, CLIP)


@pytest.fixture(scope="module")
def expected():
    return reference()


def test_the_data_has_what_the_parity_needs():
    """Several images per row at several grid shapes, documents of 0-2 images, every image inside its row."""
    batch = batches()[0]
    grids = {tuple(g) for g in batch["image_grid"].tolist()}
    per_row = torch.bincount(batch["image_row"], minlength=ROWS)
    assert len(grids) >= 3 and int(per_row.max()) >= 3 and int((per_row == 0).sum()) <= ROWS // 2, (grids, per_row)
    assert bool((batch["image_start"] + batch["image_grid"].prod(1) <= LLM.seq_len).all())
    for i in range(len(batch["image_row"])):
        row, start, n = int(batch["image_row"][i]), int(batch["image_start"][i]), int(batch["image_grid"][i].prod())
        assert bool((batch["tokens"][row, start : start + n] == 0).all())


def vlm_experiment(world_size, layouts, options, microbatches=2):
    modules = {name: module(kind, config, layouts[name], OPTIM[name], options.get(name))
               for name, kind, config in (("vision", "vit", VISION), ("llm", "gpt", LLM))}
    return experiment(world_size, modules, edges=[("vision", "llm")], global_batch=ROWS, microbatches=microbatches,
                      grad_clip=CLIP)


def train(rank, world_size, layouts, options):
    runtime = build_runtime(vlm_experiment(world_size, layouts, options))
    return record_run(runtime, batches())


CASES = {
    "colocated vision dp2, llm cp2": (2, {"vision": {"dp": 2}, "llm": {"cp": 2}}, {}),
    "colocated vision dp2, llm tp2 (TP replicas each receive)": (2, {"vision": {"dp": 2}, "llm": {"tp": 2}}, {}),
    "colocated vision dp4 (fsdp), llm tp2·cp2 with sequence parallelism": (
        4, {"vision": {"dp": 4}, "llm": {"tp": 2, "cp": 2}},
        {"vision": ParallelOptions(fsdp=True), "llm": ParallelOptions(sequence_parallel=True)}),
    "non-colocated vision dp2 (0-1), llm pp2 (2-3)": (4, {"vision": {"dp": 2}, "llm": {"pp": 2, "offset": 2}}, {}),
    "non-colocated vision tp2 (0-1), llm dp2 (2-3)": (4, {"vision": {"tp": 2, "dp": 1}, "llm": {"dp": 2, "offset": 2}}, {}),
}


# Receivers of each token and source TP ranks (each takes the full gradient) of the non-colocated cases,
# where every message crosses: the first step's bytes are then exactly these multiples of the tokens.
CROSSING = {"non-colocated vision dp2 (0-1), llm pp2 (2-3)": (1, 1), "non-colocated vision tp2 (0-1), llm dp2 (2-3)": (1, 2)}


@pytest.mark.parametrize("case", list(CASES))
def test_native_resolution_parity(case, expected):
    world_size, layouts, options = CASES[case]
    results = run_ranks(train, world_size, layouts, options, timeout_s=300)
    print("\n" + check_parity(results, expected, f"native images {case}"))
    if case in CROSSING:
        receivers, source_tp = CROSSING[case]
        ideal = int(batches()[0]["image_grid"].prod(1).sum()) * VISION.out_size * 4
        forward = sum(r.edge_bytes["vision->llm"][0] for r in results)
        backward = sum(r.edge_bytes["vision->llm"][2] for r in results)
        assert (forward, backward) == (ideal * receivers, ideal * source_tp), (forward, backward, ideal)
        print(f"  routed bytes, step 1: forward {forward} B, backward {backward} B (image tokens once: {ideal} B)")


def test_vision_replicas_split_images_by_patch_count():
    """Each microbatch's images over vision dp4: by patch count the largest replica holds at most the
    mean plus one image's patches (greedy largest-first), and the split covers every image once."""
    from hetero.testing.kinds import build_graph

    graph = build_graph(vlm_experiment(4, {"vision": {"dp": 4}, "llm": {"dp": 4}}, {}))
    for batch in batches():
        rows = StepRows(graph, batch, 2)
        sizes = batch["image_grid"].prod(1)
        for m in range(2):
            parts = [rows.local("vision", m, d) for d in range(4)]
            assert sorted(torch.cat(parts).tolist()) == rows.module("vision", m).tolist()
            loads = [int(sizes[p].sum()) for p in parts]
            assert max(loads) <= sum(loads) / 4 + int(sizes.max()), loads


def train_on_a_bad_batch(rank, world_size, change):
    runtime = build_runtime(vlm_experiment(2, {"vision": {"dp": 2}, "llm": {"cp": 2}}, {}))
    batch = {key: value.clone() for key, value in batches()[0].items()}
    change(batch)
    runtime.train_step(batch)


def larger_than_allowed(batch):
    """Image 0 regridded to 4×4 = 16 patches (its patches padded out), past max_patches=12."""
    sizes = batch["image_grid"].prod(1)
    extra = torch.zeros(16 - int(sizes[0]), batch["image_patches"].shape[1])
    batch["image_patches"] = torch.cat([batch["image_patches"][: int(sizes[0])], extra, batch["image_patches"][int(sizes[0]):]])
    batch["image_grid"][0] = torch.tensor([4, 4])


def past_the_row(batch):
    batch["image_start"][-1] = LLM.seq_len - 2


@pytest.mark.parametrize("change,message", [
    (larger_than_allowed, r"vision: image 0 holds 16 patches \(4×4\), more than vision\.model\.max_patches=12; shrink it"),
    (past_the_row, r"vision->llm: image \d+ \(row \d+\) has its \d+ placeholders at positions 46\.\.\d+, outside the 48 "
                   r"positions of llm's rows"),
])
def test_a_batch_the_images_do_not_fit_is_refused_on_every_rank(change, message):
    with pytest.raises(Exception, match=message):
        run_ranks(train_on_a_bad_batch, 2, change, timeout_s=120)
