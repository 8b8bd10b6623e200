"""A module kind defined outside hetero (``examples/signal_encoder``: a 1-D convolutional encoder of a
signal), registered by user code, trains with parity in a three-module graph: a vision encoder and the
signal encoder feed one LLM, the signal present in only some rows, on two placements (colocated, phased;
and every module on its own ranks: one pipeline over the graph with two branches into the LLM's first
stage). Against one process running the same modules written out here: per step the loss and the
gradient norm, every replica's gradients at the first step (``hetero.testing.parity``)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from signal_encoder.kind import SignalConfig, SignalEncoder, SignalKind  # noqa: E402

from hetero.config import OptimizerConfig  # noqa: E402
from hetero.models import default_registry  # noqa: E402
from hetero.models.gpt.config import GPTConfig  # noqa: E402
from hetero.models.gpt.model import GPT, token_loss_sum  # noqa: E402
from hetero.models.vit.config import ViTConfig  # noqa: E402
from hetero.models.vit.model import VisionEncoder  # noqa: E402
from hetero.testing.kinds import build_runtime  # noqa: E402
from hetero.testing.experiments import experiment, module  # noqa: E402
from hetero.testing.multiprocess import run_ranks  # noqa: E402
from hetero.testing.parity import Record, check_parity, record_reference, record_run  # noqa: E402

VISION = ViTConfig(image_size=16, patch_size=8, hidden_size=32, num_layers=1, num_heads=4, out_size=32)
SIGNAL = SignalConfig(length=32, stride=8, channels=8, out_size=32)
PLACEHOLDERS = VISION.num_patches + SIGNAL.tokens
LLM = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=64, seq_len=PLACEHOLDERS + 8)
OPTIM = {"vision": OptimizerConfig(lr=3e-3), "llm": OptimizerConfig(lr=1e-2), "audio": OptimizerConfig(lr=3e-3)}
STEPS, BATCH, CLIP = 4, 8, 0.5


def batches():
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        text = torch.randint(1, LLM.vocab_size, (BATCH, LLM.seq_len - PLACEHOLDERS + 1), generator=gen)
        out.append({
            "images": torch.rand(BATCH, 1, 16, 16, generator=gen),
            "signal": torch.randn(BATCH, SIGNAL.length, generator=gen),
            "has_signal": torch.rand(BATCH, generator=gen) < 0.6,
            "tokens": torch.cat([torch.zeros(BATCH, PLACEHOLDERS, dtype=torch.long), text[:, :-1]], dim=1),
            "labels": torch.cat([torch.full((BATCH, PLACEHOLDERS - 1), -100), text], dim=1),
        })
    return out


def reference() -> Record:
    modules = {}
    for index, (name, build) in enumerate((("vision", lambda: VisionEncoder(VISION)), ("llm", lambda: GPT(LLM)),
                                           ("audio", lambda: SignalEncoder(SIGNAL)))):
        torch.manual_seed(index)
        modules[name] = build()

    def loss(batch, step):
        h = modules["llm"].tok_embeddings(batch["tokens"]).clone()
        h[:, : VISION.num_patches] = modules["vision"](batch["images"])
        rows = torch.nonzero(batch["has_signal"]).flatten()
        h[rows, VISION.num_patches : PLACEHOLDERS] = modules["audio"](batch["signal"][rows])
        return [token_loss_sum(modules["llm"](h), batch["labels"]) / int((batch["labels"] != -100).sum())]

    return record_reference(modules, OPTIM, batches(), loss, CLIP)


def train(rank, world_size, layouts, microbatches, registry):
    kinds = {"vision": ("vit", VISION), "llm": ("gpt", LLM), "audio": ("signal", SIGNAL)}
    modules = {name: module(kind, config, layouts[name], OPTIM[name]) for name, (kind, config) in kinds.items()}
    config = experiment(world_size, modules, edges=[("vision", "llm"), ("audio", "llm")], global_batch=BATCH,
                        microbatches=microbatches, grad_clip=CLIP)
    runtime = build_runtime(config, registry)
    return record_run(runtime, batches()), runtime.graph.schedule


CASES = {
    "colocated on 2 ranks: vision dp2, audio dp2, llm tp2": (
        {"vision": {"dp": 2}, "audio": {"dp": 2}, "llm": {"tp": 2}}, 2, 2, "phased"),
    "each on its own ranks: vision (0), audio (1), llm pp2 (2-3)": (
        {"vision": {"dp": 1}, "audio": {"dp": 1, "offset": 1}, "llm": {"pp": 2, "dp": 1, "offset": 2}}, 4, 4,
        "graph_1f1b"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_kind_registered_by_user_code_trains_with_parity(case):
    layouts, world_size, microbatches, schedule = CASES[case]
    registry = default_registry()
    registry.register(SignalKind())
    results = run_ranks(train, world_size, layouts, microbatches, registry, timeout_s=300)
    assert {s for _, s in results} == {schedule}
    print("\n" + check_parity([r for r, _ in results], reference(), f"user kind {case}"))
