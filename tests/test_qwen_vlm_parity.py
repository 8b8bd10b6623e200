"""A Qwen-style VLM through the runtime against one process: the Qwen2.5-VL or Qwen3-VL tower (``vit`` with
``tower``) over its DP replicas (FSDP2 in one case) or split over TP, its merged tokens routed to the placeholders of an LLM
with M-RoPE under CP, TP with SP or PP, colocated and not; with DeepStack, the tower's taps ride the same edge beside the
tokens and are added after the LLM's layers 0 and 1. The one process encodes each image alone and runs
each row layer by layer with the positions of ``hetero.data.mrope_positions``. 4 AdamW steps, fp32
(``check_parity``: losses, pre-clip gradient norms, every replica's gradients at step 1), and the edge's
bytes against the ideal count."""

import functools
import random
from dataclasses import replace

import pytest
import torch

from hetero.config import OptimizerConfig
from hetero.data.digits import IGNORE_INDEX
from hetero.data.mrope_positions import VisionSpan, mrope_positions
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.model import GPT, token_loss_sum
from hetero.models.gpt.rope import mrope_of, rope_tables
from hetero.models.vit.config import ViTConfig
from hetero.models.vit.qwen_tower import QwenVisionTower
from hetero.parallel.options import ParallelOptions
from hetero.testing.experiments import experiment, module
from hetero.testing.kinds import build_runtime
from hetero.testing.multiprocess import run_ranks
from hetero.testing.parity import check_parity, record_reference, record_run

TOWER = dict(hidden_size=32, num_layers=2, num_heads=2, ffn_hidden_size=48, out_size=32, channels=3, patch_size=2,
             temporal_patch=2, merge=2, max_patches=64, class_token=False, projector=False, feature_norm=False)
VISION = {"qwen2.5-vl": ViTConfig(**TOWER, tower="qwen2.5-vl", window_size=8, full_attention_blocks=[1]),
          "qwen3-vl deepstack": ViTConfig(**TOWER, tower="qwen3-vl", position_grid=6, deepstack_layers=[0, 1])}
PLAIN = GPTConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                  seq_len=32, head_dim=16, mrope_sections=[4, 2, 2], mrope_interleaved=True)
LLM = {"qwen2.5-vl": PLAIN, "qwen3-vl deepstack": replace(PLAIN, deepstack_layers=[0, 1])}
ROWS, STEPS, MICROBATCHES = 8, 4, 2
OPTIM = {"vision": OptimizerConfig(lr=3e-3), "llm": OptimizerConfig(lr=1e-2)}
GRIDS = [(1, 2, 2), (1, 4, 2), (1, 2, 6), (1, 4, 4), (1, 6, 4), (2, 4, 2)]  # (t, h, w) patches; the last a video


@functools.cache
def batches():
    gen, rng = torch.Generator().manual_seed(5), random.Random(5)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(1, PLAIN.vocab_size, (ROWS, PLAIN.seq_len + 1), generator=gen)
        grids, rows, starts, rope = [], [], [], []
        for r in range(ROWS):
            spans, at = [], rng.randint(0, 3)
            for grid in rng.sample(GRIDS, rng.randint(0, 2)):
                span = VisionSpan(at, (grid[0], grid[1] // 2, grid[2] // 2))
                if span.start + span.tokens > PLAIN.seq_len:
                    break
                spans.append(span)
                grids.append(grid), rows.append(r), starts.append(at)
                tokens[r, at:at + span.tokens] = 0
                at += span.tokens + rng.randint(1, 4)
            rope.append(mrope_positions(PLAIN.seq_len, spans))
        labels = tokens[:, 1:].clone()
        labels[labels == 0] = IGNORE_INDEX
        patches = sum(t * h * w for t, h, w in grids)
        out.append({"tokens": tokens[:, :-1], "labels": labels, "rope_positions": torch.stack(rope),
                    "image_patches": torch.randn(patches, VISION["qwen2.5-vl"].patch_values, generator=gen),
                    "image_grid": torch.tensor(grids).reshape(-1, 3), "image_row": torch.tensor(rows, dtype=torch.long),
                    "image_start": torch.tensor(starts, dtype=torch.long)})
    return out


def run_llm(llm: GPT, embeddings, positions, added):
    """The LLM layer by layer: ``added`` (layer -> [(start, tap)]) joins the stream after its layer."""
    config = llm.config
    cos, sin = rope_tables(config.head_size, positions, config.rope_theta, config.rope_scaling, mrope_of(config))
    h = embeddings
    for name, layer in llm.layers.items():
        h = layer(h, cos, sin)
        for start, tap in added.get(int(name), ()):
            end = start + tap.shape[1]
            h = torch.cat([h[:, :start], h[:, start:end] + tap, h[:, end:]], 1)
    return llm.output(llm.norm(h))


def reference(tower: str):
    torch.manual_seed(0)
    vision = QwenVisionTower(VISION[tower])
    torch.manual_seed(1)
    llm = GPT(LLM[tower])

    def loss(batch, step):
        sizes = batch["image_grid"].prod(1)
        offsets = (sizes.cumsum(0) - sizes).tolist()
        total = 0
        for r in range(ROWS):
            embeddings, added = llm.tok_embeddings(batch["tokens"][r:r + 1]), {}
            for i in torch.nonzero(batch["image_row"] == r).flatten().tolist():
                merged, taps = vision(batch["image_patches"][offsets[i]:offsets[i] + int(sizes[i])],
                                      [tuple(batch["image_grid"][i].tolist())])
                start = int(batch["image_start"][i])
                embeddings = torch.cat([embeddings[:, :start], merged[None], embeddings[:, start + len(merged):]], 1)
                for layer, tap in zip(llm.config.deepstack_layers, taps):
                    added.setdefault(layer, []).append((start, tap[None]))
            logits = run_llm(llm, embeddings, batch["rope_positions"][r:r + 1].transpose(0, 1), added)
            total = total + token_loss_sum(logits, batch["labels"][r:r + 1])
        return [total / int((batch["labels"] != IGNORE_INDEX).sum())]

    return record_reference({"vision": vision, "llm": llm}, OPTIM, batches(), loss)


def train(rank, world_size, tower, layouts, options):
    configs = {"vision": ("vit", VISION[tower]), "llm": ("gpt", LLM[tower])}
    modules = {name: module(kind, config, layouts[name], OPTIM[name], options.get(name))
               for name, (kind, config) in configs.items()}
    runtime = build_runtime(experiment(world_size, modules, edges=[("vision", "llm")], global_batch=ROWS,
                                       microbatches=MICROBATCHES))
    return record_run(runtime, batches())


CASES = {
    "qwen2.5-vl tower tp2, llm cp2, colocated": ("qwen2.5-vl", 2, {"vision": {"tp": 2}, "llm": {"cp": 2}}, {}),
    "deepstack: qwen3-vl tower dp2, llm cp2, colocated": ("qwen3-vl deepstack", 2, {"vision": {"dp": 2}, "llm": {"cp": 2}}, {}),
    "deepstack: qwen3-vl tower tp2 (0-1), llm tp2 with sequence parallelism (2-3)": (
        "qwen3-vl deepstack", 4, {"vision": {"tp": 2, "size": 2}, "llm": {"tp": 2, "offset": 2}},
        {"llm": ParallelOptions(sequence_parallel=True)}),
    "deepstack: qwen3-vl tower dp2 (fsdp), llm pp2 (its first stage holds layers 0-1), colocated": (
        "qwen3-vl deepstack", 2, {"vision": {"dp": 2}, "llm": {"pp": 2}}, {"vision": ParallelOptions(fsdp=True)}),
}
# where every token crosses to other ranks; under SP each LLM TP rank receives the tokens of its part of the
# sequence alone, so each token (and its taps) crosses once forward
CROSSING = {"deepstack: qwen3-vl tower tp2 (0-1), llm tp2 with sequence parallelism (2-3)"}


@pytest.mark.parametrize("case", list(CASES))
def test_qwen_vlm_parity(case):
    tower, world_size, layouts, options = CASES[case]
    results = run_ranks(train, world_size, tower, layouts, options, timeout_s=400)
    print("\n" + check_parity(results, reference(tower), f"qwen vlm {case}"))
    if case in CROSSING:  # the first step's bytes are the ideal count
        batch, taps = batches()[0], len(VISION[tower].deepstack_layers)
        ideal = int(batch["image_grid"].prod(1).sum()) // 4 * (1 + taps) * VISION[tower].out_size * 4
        forward, within, backward = (sum(r.edge_bytes["vision->llm"][k] for r in results) for k in range(3))
        # each of the tower's TP ranks holds the whole output, so each takes its whole gradient back
        tower_tp = layouts["vision"].get("tp", 1)
        assert (forward, within, backward) == (ideal, 0, ideal * tower_tp), (forward, within, backward, ideal)
        print(f"  routed bytes, step 1: forward {forward} B across, {within} B within the LLM's TP group, backward "
              f"{backward} B (tokens and taps once: {ideal} B; back to each of the tower's {tower_tp} TP ranks)")


def test_the_data_has_what_the_parity_needs():
    batch = batches()[0]
    assert len({tuple(g) for g in batch["image_grid"].tolist()}) >= 3
    assert int(torch.bincount(batch["image_row"], minlength=ROWS).max()) >= 2
    assert not torch.equal(batch["rope_positions"][:, 0], batch["rope_positions"][:, 1])  # images moved h from t


def test_deepstack_beyond_the_first_pipeline_stage_is_refused():
    from hetero.parallel.layout import Layout

    errors = replace(PLAIN, deepstack_layers=[0, 1, 2]).errors("llm", Layout(1, 1, 1, 2, (0, 1)))
    assert errors == ["llm.model.deepstack_layers=[0, 1, 2]: DeepStack's features reach the first pipeline stage "
                      "only, which holds layers 0..1 of 4 at llm.layout.pp=2; use a pp whose first stage holds "
                      "layer 2"], errors
