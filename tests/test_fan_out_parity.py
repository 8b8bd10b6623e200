"""A graph the earlier trainers could not express: one encoder feeding two consumers. A vision encoder's
embeddings go to an LLM and to a second, smaller LLM (a captioner), each with its own loss and weight; the
encoder learns from the gradients both return, summed. Two placements: shared ranks (the captioner on
half of them), under either schedule, and every module on its own ranks (one pipeline over the graph,
fanning out from the encoder's stage). Against one process
running the three modules: per step the combined loss, each module's loss and the gradient norm, every
replica's gradients at the first step (``hetero.testing.parity``)."""

import pytest
import torch

from hetero.config import OptimizerConfig
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.model import GPT, token_loss_sum
from hetero.models.vit.config import ViTConfig
from hetero.models.vit.model import VisionEncoder
from hetero.testing.kinds import build_runtime
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks
from hetero.testing.parity import Record, check_parity, record_reference, record_run

VISION = ViTConfig(image_size=16, patch_size=8, hidden_size=32, num_layers=1, num_heads=4, out_size=32)
PATCHES = VISION.num_patches
LLM = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64, seq_len=PATCHES + 8)
CAPTIONER = GPTConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, ffn_hidden_size=32, seq_len=PATCHES + 8)
WEIGHTS = {"llm": 1.0, "captioner": 0.5}
OPTIM = {"vision": OptimizerConfig(lr=3e-3), "llm": OptimizerConfig(lr=1e-2), "captioner": OptimizerConfig(lr=5e-3)}
STEPS, BATCH, CLIP = 4, 8, 0.5


def batches():
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(STEPS):
        text = torch.randint(1, LLM.vocab_size, (BATCH, LLM.seq_len - PATCHES + 1), generator=gen)
        out.append({
            "images": torch.rand(BATCH, 1, 16, 16, generator=gen),
            "tokens": torch.cat([torch.zeros(BATCH, PATCHES, dtype=torch.long), text[:, :-1]], dim=1),
            "labels": torch.cat([torch.full((BATCH, PATCHES - 1), -100), text], dim=1),
        })
    return out


def reference() -> Record:
    modules = {}
    for index, (name, build) in enumerate((("vision", lambda: VisionEncoder(VISION)), ("llm", lambda: GPT(LLM)),
                                           ("captioner", lambda: GPT(CAPTIONER)))):
        torch.manual_seed(index)  # each module from seed + its index in the experiment
        modules[name] = build()

    def losses(batch, step):
        images = modules["vision"](batch["images"])
        supervised = int((batch["labels"] != -100).sum())
        each = {}
        for name in ("llm", "captioner"):
            h = modules[name].tok_embeddings(batch["tokens"]).clone()
            h[:, :PATCHES] = images
            each[name] = token_loss_sum(modules[name](h), batch["labels"]) / supervised
        return [sum(WEIGHTS[n] * loss for n, loss in each.items()), each["llm"], each["captioner"]]

    return record_reference(modules, OPTIM, batches(), losses, CLIP)


def train(rank, world_size, layouts, microbatches, schedule):
    kinds = {"vision": ("vit", VISION), "llm": ("gpt", LLM), "captioner": ("gpt", CAPTIONER)}
    modules = {name: module(kind, config, layouts[name], OPTIM[name],
                            **({"loss_weight": WEIGHTS[name]} if name in WEIGHTS else {}))
               for name, (kind, config) in kinds.items()}
    config = experiment(world_size, modules, edges=[("vision", "llm"), ("vision", "captioner")],
                        global_batch=BATCH, microbatches=microbatches, grad_clip=CLIP, schedule=schedule)
    runtime = build_runtime(config)
    return record_run(runtime, batches(), ("loss", "llm.loss", "captioner.loss")), runtime.graph.schedule


SHARED = {"vision": {"dp": 4}, "llm": {"tp": 2, "dp": 2}, "captioner": {"dp": 2, "pp": 1, "ranks": [0, 1]}}
CASES = {  # layouts, world size, microbatches, schedule asked for, schedule run
    "shared ranks: vision dp4 and llm tp2·dp2 on 0-3, captioner dp2 on 0-1, phased": (SHARED, 4, 2, "phased", "phased"),
    "the same, auto (one 1F1B over the graph: the captioner's ranks are not all)": (SHARED, 4, 2, "auto", "graph_1f1b"),
    "each on its own ranks: vision (0), llm pp2 (1-2), captioner (3)": (
        {"vision": {"dp": 1}, "llm": {"pp": 2, "dp": 1, "offset": 1}, "captioner": {"dp": 1, "offset": 3}},
        4, 4, "auto", "graph_1f1b"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_encoder_feeding_two_consumers_trains_with_parity(case):
    layouts, world_size, microbatches, asked, schedule = CASES[case]
    results = run_ranks(train, world_size, layouts, microbatches, asked, timeout_s=300)
    assert {s for _, s in results} == {schedule}
    print("\n" + check_parity([r for r, _ in results], reference(), f"fan-out {case}"))
