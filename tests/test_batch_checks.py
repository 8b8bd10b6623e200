"""A batch a module cannot take is refused on every rank before the step's first message, naming the module,
the column, the field and the fix (``hetero.kinds.columns``; each kind declares its columns from its
config). Unit tests of each kind's columns, then one 4-rank world where the bad module's partners sit on
other ranks: once a ViT of image_size 16 given 20×20 images raised a shape error inside its position
table on ranks 0-1 while ranks 2-3 waited at the boundary until the timeout."""

import time

import pytest
import torch

from hetero.config import OptimizerConfig
from hetero.data.digits import IGNORE_INDEX
from hetero.kinds.columns import FLOATING, Column, Dim
from hetero.kinds.registry import Kind
from hetero.models import default_registry
from hetero.models.genezip.config import GeneZipConfig
from hetero.models.gpt.config import GPTConfig
from hetero.models.projector.config import ProjectorConfig
from hetero.models.video.config import VideoConfig
from hetero.models.vit.config import ViTConfig
from hetero.testing.kinds import build_runtime
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks
from hetero.data.rank_batches import compact
from hetero.train.data_agreement import agreed
from hetero.train.job import checked

KINDS = default_registry()
LLM = GPTConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, seq_len=16)
VISION = ViTConfig(image_size=16, patch_size=8, channels=3, hidden_size=16, num_layers=1, num_heads=2, out_size=16)
DNA = GeneZipConfig(seq_len=32, hidden_size=16, num_heads=2, main_layers=1, local_window=8, routing_window=16,
                    max_boundaries=2, out_size=16)
VIDEO = VideoConfig(frame_size=8, patch_size=4, hidden_size=16, num_heads=2)
PLACEHOLDERS = VISION.num_patches + DNA.max_tokens()
ROWS = 4


def text(rows: int = ROWS) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(1, LLM.vocab_size, (rows, LLM.seq_len), generator=gen, device="cpu")
    tokens[:, :PLACEHOLDERS] = 0
    labels = torch.roll(tokens, -1, 1)
    labels[:, : PLACEHOLDERS - 1] = IGNORE_INDEX
    return {"tokens": tokens, "labels": labels}


def vlm_batch(rows: int = ROWS) -> dict[str, torch.Tensor]:
    return text(rows) | {"images": torch.rand(rows, 3, 16, 16, device="cpu"),
                         "dna": torch.randint(0, 5, (rows, DNA.seq_len), device="cpu"),
                         "dna_regions": torch.randint(0, 2, (rows, DNA.seq_len), device="cpu")}


def errors(kind: str, config, batch, module_name: str = "m") -> list[str]:
    return KINDS[kind].batch_errors(module_name, config, batch)


def test_gpt_columns():
    good = text()
    assert errors("gpt", LLM, good) == []
    assert errors("gpt", LLM, good | {"tokens": good["tokens"][:, :9]}, "llm") == [
        "llm: the batch's tokens hold 9 values per row but llm.model.seq_len=16; make them 16 per row or set "
        "llm.model.seq_len=9"]
    assert errors("gpt", LLM, good | {"tokens": good["tokens"].float()}, "llm") == [
        "llm: the batch's tokens are torch.float32, but llm takes 64-bit integer ids (torch.long: embeddings and "
        "cross-entropy take no other integers); convert the column"]
    assert errors("gpt", LLM, good | {"tokens": good["tokens"] + 20}, "llm") == [
        "llm: the batch's tokens hold values 20..51, outside 0..31 (llm.model.vocab_size=32); keep them below 32 "
        "or set llm.model.vocab_size=52"]
    labels = good["labels"].clone()
    labels[0, -1] = -1
    assert errors("gpt", LLM, good | {"labels": labels}, "llm") == [
        "llm: the batch's labels hold values -1..31, outside 0..31 or -100 (ignored) (llm.model.vocab_size=32); "
        "keep them at least 0 (or -100 where ignored)"]
    assert errors("gpt", LLM, {"tokens": good["tokens"]}, "llm") == [
        "llm reads the batch column labels, which the batch lacks (it has tokens); add it to the data"]
    assert "llm: the batch's digit_position hold values -1..16, outside -1..15" in errors(
        "gpt", LLM, good | {"digit_position": torch.tensor([-1, 0, 15, 16], device="cpu")}, "llm")[0]
    falling = torch.arange(LLM.seq_len, device="cpu").flip(0).expand(ROWS, -1)
    assert errors("gpt", LLM, good | {"documents": falling}, "llm")[0].startswith(
        "llm: documents must not decrease along a row")


def test_vit_columns():
    assert errors("vit", VISION, {"images": torch.rand(2, 3, 16, 16, device="cpu")}) == []
    assert errors("vit", VISION, {"images": torch.rand(2, 3, 20, 20, device="cpu")}, "vision") == [
        "vision: the batch's images hold 3×20×20 values per row but vision.model.image_size=16; make them 3×16×16 "
        "per row or set vision.model.image_size=20"]
    assert errors("vit", VISION, {"images": torch.rand(2, 1, 16, 16, device="cpu")}, "vision") == [
        "vision: the batch's images hold 1×16×16 values per row but vision.model.channels=3; make them 3×16×16 "
        "per row or set vision.model.channels=1"]
    assert errors("vit", VISION, {"images": torch.rand(2, 3, 16, 20, device="cpu")}, "vision") == [
        "vision: the batch's images hold 3×16×20 values per row but vision.model.image_size=16; make them 3×16×16 "
        "per row"]
    assert errors("vit", VISION, {"images": torch.rand(2, 16, 16, device="cpu")}, "vision") == [
        "vision: the batch's images hold 16×16 values per row but vision takes 3×16×16 per row (channels × "
        "image_size × image_size)"]
    pixels = torch.zeros(2, 3, 16, 16, dtype=torch.uint8, device="cpu")
    assert "takes floating point values" in errors("vit", VISION, {"images": pixels})[0]


def test_native_vit_columns():
    native = ViTConfig(image_size=16, patch_size=8, channels=1, class_token=False, max_patches=4)
    items = {"image_patches": torch.rand(5, 64, device="cpu"),
             "image_grid": torch.tensor([[1, 2], [1, 3]], device="cpu"), "image_row": torch.tensor([0, 1], device="cpu"), "image_start": torch.tensor([0, 0], device="cpu")}
    assert errors("vit", native, items) == []
    assert errors("vit", native, items | {"image_grid": items["image_grid"].float()})[0] == (
        "m: the batch's image_grid are torch.float32, but m takes integers (e.g. torch.long); convert the column")
    assert errors("vit", native, items | {"image_grid": torch.tensor([[1, 2], [2, 3]], device="cpu")})[0].startswith(
        "m: image 1 holds 6 patches (2×3), more than m.model.max_patches=4")


def test_video_columns():
    clips = torch.rand(2, 4, 1, 8, 8, device="cpu")
    index = torch.arange(2, device="cpu")
    assert errors("video", VIDEO, {"clips": clips, "index": index}) == []
    assert errors("video", VIDEO, {"clips": clips[:, :1], "index": index}, "video") == [
        "video: the batch's clips have 1 frames per row; video needs at least 2 frames per row"]
    assert errors("video", VIDEO, {"clips": torch.rand(2, 4, 1, 12, 12, device="cpu"), "index": index}, "video") == [
        "video: the batch's clips hold 4×1×12×12 values per row but video.model.frame_size=8; make them "
        "frames×1×8×8 per row or set video.model.frame_size=12"]
    assert errors("video", VIDEO, {"clips": clips, "index": index,
                                   "revisit": torch.zeros(2, 3, dtype=torch.bool, device="cpu")}, "video") == [
        "video: the batch's revisit have 3 frames per row but its clips have 4; give both the same frames"]
    assert "takes integers" in errors("video", VIDEO, {"clips": clips, "index": index.float()})[0]


def test_genezip_columns():
    bases = torch.randint(0, 5, (2, DNA.seq_len), device="cpu")
    regions = torch.zeros(2, DNA.seq_len, dtype=torch.long, device="cpu")
    assert errors("genezip", DNA, {"dna": bases, "dna_regions": regions}) == []
    assert errors("genezip", DNA, {"dna": bases[:, :30], "dna_regions": regions}, "dna")[0] == (
        "dna: the batch's dna hold 30 values per row but dna.model.seq_len=32; make them 32 per row or set "
        "dna.model.seq_len=30")
    assert errors("genezip", DNA, {"dna": bases + 1, "dna_regions": regions}, "dna") == [
        "dna: the batch's dna hold values 1..5, outside 0..4 (the bases ACGTN, hetero.data.genome.BASES); encode "
        "the bases with hetero.data.genome.encode (A C G T: 0..3, anything else: 4)"]
    assert errors("genezip", DNA, {"dna": bases, "dna_regions": regions + 2}, "dna")[0].startswith(
        "dna: the batch's dna_regions hold values 2..2, outside 0..1 (the regions intergenic, coding")


def test_kinds_without_columns_check_nothing():
    class Old(Kind):  # a user kind written before columns existed
        name = "old"

    class Signal(Kind):
        name = "signal"

        def columns(self, config):
            return (Column("signal", (Dim("length", 32),), FLOATING),)

    assert Old().batch_errors("old", None, {"anything": torch.zeros(1, device="cpu")}) == []
    assert errors("projector", ProjectorConfig(in_size=4, out_size=4, tokens=2), {}) == []
    assert Signal().batch_errors("audio", None, {"signal": torch.rand(2, 30, device="cpu")}) == [
        "audio: the batch's signal hold 30 values per row but audio.model.length=32; make them 32 per row or set "
        "audio.model.length=30"]


# ------------------------------------------------------------------------ four ranks, partners elsewhere

def four_ranks(world_size):
    """vision dp2 on ranks 0-1 and dna dp2 on ranks 2-3 feed an LLM at tp2·cp2 on ranks 0-3."""
    layouts = {"vision": ("vit", VISION, {"dp": 2, "ranks": [0, 1]}),
               "dna": ("genezip", DNA, {"dp": 2, "ranks": [2, 3]}), "llm": ("gpt", LLM, {"tp": 2, "cp": 2})}
    config = experiment(world_size, {name: module(kind, model, layout, OptimizerConfig())
                                     for name, (kind, model, layout) in layouts.items()},
                        edges=[("vision", "llm"), ("dna", "llm")], global_batch=ROWS, microbatches=1)
    return build_runtime(config)


def bad_batches(rank, world_size):
    """Every bad batch (training and evaluation) raises on every rank at once; then a good one trains
    everywhere."""
    runtime = four_ranks(world_size)
    good = vlm_batch()
    dna = good["dna"].clone()
    dna[1, 3] = 7
    bad = [(True, good | {"images": torch.rand(ROWS, 3, 20, 20, device="cpu")}),
           (False, good | {"dna": dna}),
           (True, good | {"images": good["images"][:2]})]
    out = []
    for training, batch in bad:
        start = time.perf_counter()
        try:
            runtime.train_step(batch) if training else runtime.evaluate([batch])
        except ValueError as error:
            out.append((str(error), time.perf_counter() - start))
    out.append((runtime.train_step(good)["stepped"], 0.0))
    return out


@pytest.mark.timeout(240)
def test_bad_batches_are_refused_on_every_rank_before_any_message():
    # a rank left waiting in a collective would fail the run after collective_timeout_s
    results = run_ranks(bad_batches, 4, timeout_s=200, collective_timeout_s=60)
    messages = [[message for message, _ in rank] for rank in results]
    assert messages == [messages[0]] * 4
    assert messages[0] == [
        "vision: the batch's images hold 3×20×20 values per row but vision.model.image_size=16; make them 3×16×16 "
        "per row or set vision.model.image_size=20",
        "dna: the batch's dna hold values 0..7, outside 0..4 (the bases ACGTN, hetero.data.genome.BASES); encode "
        "the bases with hetero.data.genome.encode (A C G T: 0..3, anything else: 4)",
        "vision: the batch's images hold 2 rows but the batch has 4; give every per-row column one entry per row",
        1.0,
    ]
    assert max(seconds for rank in results for _, seconds in rank) < 10.0


def compact_batches(rank, world_size):
    """Each rank holds its own rows (``hetero.data.rank_batches``): the good batch evaluates as the global
    one does; a bad DNA window in row 1, which rank 2 alone holds, stops every rank inside the job's data
    agreement, before the step."""
    runtime = four_ranks(world_size)
    reads = runtime.rank_reads()
    good = vlm_batch()
    mine = compact(good, reads)
    held = {key: torch.nonzero(mine[f"held:{key}"]).flatten().tolist() for key in ("tokens", "images", "dna")}
    same = runtime.evaluate([mine]) == runtime.evaluate([good])
    dna = good["dna"].clone()
    dna[1, 3] = 7
    bad = good | {"dna": dna}
    bad = compact(bad, reads)
    try:
        agreed(lambda: checked(runtime, (1, bad, {})), runtime.device, "its batch for step 1")
        return held, same, None
    except Exception as error:  # noqa: BLE001 - which one each rank raises is the point
        return held, same, f"{type(error).__name__}: {error}"


@pytest.mark.timeout(240)
def test_a_bad_row_only_one_rank_holds_stops_every_rank():
    results = run_ranks(compact_batches, 4, timeout_s=200, collective_timeout_s=60)
    every = [0, 1, 2, 3]
    assert [held for held, _, _ in results] == [{"tokens": every, "images": [0, 1], "dna": []},
                                                {"tokens": every, "images": [2, 3], "dna": []},
                                                {"tokens": every, "images": [], "dna": [0, 1]},
                                                {"tokens": every, "images": [], "dna": [2, 3]}]
    assert all(same for _, same, _ in results)
    dna = ("dna: the batch's dna hold values 0..7, outside 0..4 (the bases ACGTN, hetero.data.genome.BASES); "
           "encode the bases with hetero.data.genome.encode (A C G T: 0..3, anything else: 4)")
    assert results[2][2] == f"ValueError: {dna}"
    for rank in (0, 1, 3):
        assert results[rank][2] == f"DataError: rank 2 could not build its batch for step 1, so no rank starts it: " \
                                   f"ValueError: {dna}"
