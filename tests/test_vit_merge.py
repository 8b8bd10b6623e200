"""Spatial patch merging in the ``vit`` kind (``merge: 2``, Qwen2-VL's merger): each 2×2 block of
neighbouring patches becomes one token (a LayerNorm per patch, the four side by side, Linear-GELU-Linear
into the LLM's width), so an image of 4×4 patches hands on 4 tokens. A merging tower of items at dp2
(ranks 0-1) routes straight into the placeholders of an LLM at tp2 (ranks 2-3), against one process
(``check_parity``: 4 AdamW steps, fp32, 1e-5, every replica). The blocks are the ones merged, the FLOP
count matches a hand count and torch's counter, and the cost model hands on the merged tokens."""

import functools

import pytest
import torch

from hetero.config import OptimizerConfig
from hetero.data.digits import IGNORE_INDEX
from hetero.errors import ConfigError
from hetero.testing.kinds import build_graph
from hetero.kinds.flops import counted_forward_flops
from hetero.models.vit.flops import vit_forward_flops_per_image
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.model import GPT, token_loss_sum
from hetero.models.vit.config import ViTConfig
from hetero.models.vit.model import VisionEncoder
from hetero.plan.cost import describe
from hetero.testing.kinds import build_runtime
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks
from hetero.testing.parity import check_parity, record_reference, record_run

VISION = ViTConfig(image_size=16, patch_size=4, channels=3, hidden_size=32, num_layers=2, num_heads=4, out_size=48,
                   class_token=False, activation="gelu_tanh", norm_eps=1e-6, projector=False, items=True, merge=2)
LLM = GPTConfig(vocab_size=64, hidden_size=48, num_layers=2, num_heads=4, ffn_hidden_size=64, seq_len=32)
TOKENS = VISION.feature_tokens  # 4 per image, from 16 patches
OPTIM = {"vision": OptimizerConfig(lr=3e-3), "llm": OptimizerConfig(lr=1e-2)}
ROWS, CLIP = 8, 0.5


@functools.cache
def batches() -> list[dict[str, torch.Tensor]]:
    """Rows of text with 0-2 images each, at drawn positions."""
    gen = torch.Generator().manual_seed(3)

    def draw(low: int, high: int) -> int:
        return int(torch.randint(low, high, (), generator=gen))

    out = []
    for _ in range(4):
        rows, places = [], []
        for r in range(ROWS):
            tokens = [draw(1, LLM.vocab_size) for _ in range(draw(0, 3))]
            for _ in range(draw(0, 3)):
                places.append((r, len(tokens)))
                tokens += [0] * TOKENS + [draw(1, LLM.vocab_size) for _ in range(draw(1, 4))]
            rows.append(tokens + [draw(1, LLM.vocab_size) for _ in range(LLM.seq_len - len(tokens))])
        tokens = torch.tensor(rows)
        labels = torch.full_like(tokens, IGNORE_INDEX)
        labels[:, :-1] = torch.where(tokens[:, 1:] != 0, tokens[:, 1:], IGNORE_INDEX)
        places = torch.tensor(places, dtype=torch.long).reshape(-1, 2)
        out.append({"tokens": tokens, "labels": labels, "image_row": places[:, 0].clone(),
                    "image_start": places[:, 1].clone(),
                    "image_pixels": torch.rand(len(places), 3, 16, 16, generator=gen)})
    return out


def reference():
    torch.manual_seed(0)
    vision = VisionEncoder(VISION)
    torch.manual_seed(1)
    llm = GPT(LLM)

    def loss(batch, step):
        rows = []
        for r in range(ROWS):
            h = llm.tok_embeddings(batch["tokens"][r : r + 1])
            for i in torch.nonzero(batch["image_row"] == r).flatten().tolist():
                start = int(batch["image_start"][i])
                h = torch.cat([h[:, :start], vision(batch["image_pixels"][i : i + 1]), h[:, start + TOKENS :]], dim=1)
            rows.append(h)
        logits = llm(torch.cat(rows))
        return [token_loss_sum(logits, batch["labels"]) / int((batch["labels"] != IGNORE_INDEX).sum())]

    return record_reference({"vision": vision, "llm": llm}, OPTIM, batches(), loss, CLIP)


def merged_experiment(vision: ViTConfig = VISION):
    modules = {"vision": module("vit", vision, {"dp": 2}, OPTIM["vision"]),
               "llm": module("gpt", LLM, {"tp": 2, "offset": 2}, OPTIM["llm"])}
    return experiment(4, modules, edges=[("vision", "llm")], global_batch=ROWS, microbatches=2, grad_clip=CLIP)


def train(rank, world_size):
    return record_run(build_runtime(merged_experiment()), batches())


def test_a_merging_tower_trains_with_parity():
    results = run_ranks(train, 4, timeout_s=300)
    print("\n" + check_parity(results, reference(), "vit merge 2 at dp2 -> llm tp2"))
    images = len(batches()[0]["image_row"])
    forward = sum(r.edge_bytes["vision->llm"][0] for r in results)
    assert forward == 2 * images * TOKENS * LLM.hidden_size * 4  # the merged tokens, to both LLM TP ranks


def test_the_merger_groups_neighbouring_patches_and_counts_its_flops():
    model = VisionEncoder(VISION)
    seen = {}
    hook = model.merger.proj_in.register_forward_pre_hook(lambda module, inputs: seen.update(merged=inputs[0]))
    features = torch.randn(1, 16, 32)
    model.merger(features)
    hook.remove()
    normed = model.merger.norm(features)
    for token, block in enumerate(([0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15])):
        assert torch.equal(seen["merged"][0, token], normed[0, block].flatten())
    images = torch.randn(3, 3, 16, 16)
    assert model(images).shape == (3, TOKENS, 48)
    width, patches = 4 * 32, 16
    blocks = 2 * (patches * (2 * 4 * 32 * 32 + 2 * 2 * 32 * VISION.ffn_size) + 2 * 2 * patches * patches * 32)
    by_hand = 2 * patches * 48 * 32 + blocks + 2 * TOKENS * (width * width + width * 48)
    assert vit_forward_flops_per_image(VISION) == by_hand
    assert counted_forward_flops(model, images) == 3 * by_hand
    cost = describe("vision", "vit", VISION)
    assert (cost.out_tokens, cost.out_width, cost.merge) == (4, 48, 2)
    assert cost.outer_params == 48 * 32 + width * width + width * 48 + 16 * 32


@pytest.mark.parametrize("change,message", [
    (dict(merge=3), "vision.model.merge=3 does not divide the 4×4 patch grid"),
    (dict(projector=True), "the merger projects into out_size in place of the projector"),
])
def test_a_merge_that_cannot_work_is_refused_by_name(change, message):
    from dataclasses import replace

    with pytest.raises(ConfigError, match=message):
        build_graph(merged_experiment(replace(VISION, **change)))
