"""A GPT with M-RoPE sections, its rows carrying ``rope_positions`` (images of several grids, packed
documents), under CP, TP with SP, PP and DP against one process (``hetero.testing.parity``): each rank
must take the three positions of exactly the tokens it holds."""

import random
from dataclasses import replace

import pytest
import torch

from hetero.config import OptimizerConfig
from hetero.data.mrope_positions import VisionSpan, mrope_positions
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.model import GPT, token_loss_sum
from hetero.parallel.options import ParallelOptions
from hetero.testing.experiments import experiment, module
from hetero.testing.kinds import build_runtime
from hetero.testing.multiprocess import run_ranks
from hetero.testing.parity import check_parity, record_reference, record_run

CONFIG = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                   head_dim=16, seq_len=32, mrope_sections=[4, 2, 2], mrope_interleaved=True)
GLOBAL_BATCH, MICROBATCHES, STEPS, LR, SEED = 8, 2, 3, 1e-2, 7
LAYOUTS = {
    "cp2": ({"cp": 2}, ParallelOptions()),
    "tp2+sp": ({"tp": 2}, ParallelOptions(sequence_parallel=True)),
    "pp2": ({"pp": 2}, ParallelOptions()),
    "dp2": ({"dp": 2}, ParallelOptions()),
}


def rope_row(rng: random.Random, length: int) -> torch.Tensor:
    """A packed row's positions: two documents, each with an image of a random grid after some text."""
    starts, spans = [0, length // 2], []
    for start in starts:
        t, h, w = 1, rng.randint(1, 3), rng.randint(1, 4)
        spans.append(VisionSpan(start + rng.randint(0, 4), (t, h, w)))
    return mrope_positions(length, spans, starts)


def batches():
    gen, rng = torch.Generator().manual_seed(3), random.Random(3)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.seq_len + 1), generator=gen)
        rope = torch.stack([rope_row(rng, CONFIG.seq_len) for _ in range(GLOBAL_BATCH)])
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "rope_positions": rope})
    return out


def reference():
    torch.manual_seed(SEED)
    model = GPT(CONFIG)

    def loss(batch, step):
        logits = model(batch["tokens"], batch["rope_positions"].transpose(0, 1))
        return [token_loss_sum(logits, batch["labels"]) / batch["tokens"].numel()]

    return record_reference({"llm": model}, {"llm": OptimizerConfig(lr=LR)}, batches(), loss)


def train_cases(rank, world_size, config=CONFIG, layouts=LAYOUTS):
    results = {}
    for name, (layout, options) in layouts.items():
        blocks = {"llm": module("gpt", config, layout, OptimizerConfig(lr=LR), options)}
        runtime = build_runtime(experiment(world_size, blocks, global_batch=GLOBAL_BATCH,
                                           microbatches=MICROBATCHES, seed=SEED))
        results[name] = record_run(runtime, batches())
    return results


@pytest.fixture(scope="module")
def runs():
    return run_ranks(train_cases, 2, timeout_s=400)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mrope_parity_with_one_process(name, runs):
    print("\n" + check_parity([r[name] for r in runs], reference(), f"M-RoPE parity {name}"))


def train_on_megatron(rank, world_size):
    from hetero.testing.megatron_cpu import megatron_on_cpu

    with megatron_on_cpu():
        return train_cases(rank, world_size, replace(CONFIG, backend="megatron"),
                           {"tp2+sp": LAYOUTS["tp2+sp"], "pp2": LAYOUTS["pp2"]})


def test_mrope_on_the_megatron_backend_matches_one_process():
    """megatron-core's attention takes hetero's rotary angles (``MegatronGPT.rotary``), M-RoPE's included."""
    pytest.importorskip("megatron.core")
    runs, expected = run_ranks(train_on_megatron, 2, timeout_s=400), reference()
    for name in ("tp2+sp", "pp2"):
        print("\n" + check_parity([r[name] for r in runs], expected, f"M-RoPE parity, megatron backend, {name}"))


def test_the_positions_matter():
    """The same model and data with plain positions: step 1's attention gradients differ far beyond the
    parity bound (at initialization the loss barely feels positions, the gradients do), so a rank that
    dropped the column would fail the test above."""
    plain = [{k: v for k, v in batch.items() if k != "rope_positions"} for batch in batches()]
    torch.manual_seed(SEED)
    model = GPT(CONFIG)

    def loss(batch, step):
        return [token_loss_sum(model(batch["tokens"]), batch["labels"]) / batch["tokens"].numel()]

    theirs, ours = record_reference({"llm": model}, {"llm": OptimizerConfig(lr=LR)}, plain, loss), reference()
    worst = max(((ours.grads[k] - theirs.grads[k]).norm() / ours.grads[k].norm()).item() for k in ours.grads)
    assert worst > 1e-2
