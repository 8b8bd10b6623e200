"""Packed training matches one process that runs each document on its own: losses and pre-clip gradient
norms for 6 AdamW steps and every replica's gradients at step 1, fp32, 1e-5 (``check_parity``).

Rows of 32 positions hold several documents of 1-20 tokens each (``hetero.data.packing``), so document
boundaries fall inside and between the CP chunks (8 positions at cp2, 4 at cp4): blocks are skipped,
plain and masked. The LLM runs at cp2 (ring and all-gather), cp4, tp2 with sequence parallelism, pp2 and
cp2·pp2; the vision-language model packs an image document (its 16 placeholders first) and text
documents in each row, colocated and non-colocated. The loss is normalized by the global count of
supervised tokens, as the reference's sum over documents is.
"""

import pytest
import torch

from hetero.config import OptimizerConfig
from hetero.data.digits import IGNORE_INDEX
from hetero.data.packing import next_token_document, pack_rows, stack_rows
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.model import GPT, token_loss_sum
from hetero.models.vit.config import ViTConfig
from hetero.parallel.options import ParallelOptions
from hetero.testing.kinds import build_runtime
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks
from hetero.testing.parity import Record, check_parity, record_reference, record_run
from hetero.testing.references import IMAGE_TOKEN, VisionLanguageModel

LLM = GPTConfig(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                seq_len=32)
VISION = ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_layers=2, num_heads=4, out_size=32)
ROWS, MICROBATCHES, STEPS, SEED, CLIP = 8, 4, 6, 1234, 0.5
OPTIM = {"llm": OptimizerConfig(lr=1e-2), "vision": OptimizerConfig(lr=3e-3)}


def text_batches(steps=STEPS):
    gen = torch.Generator().manual_seed(5)

    def stream():
        while True:
            n = int(torch.randint(1, 21, (), generator=gen))
            yield next_token_document(torch.randint(1, LLM.vocab_size, (n + 1,), generator=gen))

    rows = pack_rows(stream(), LLM.seq_len)
    return [stack_rows([next(rows) for _ in range(ROWS)]) for _ in range(steps)]


def vlm_batches(steps=STEPS):
    """Each row: an image document (16 placeholders, then 1-12 caption tokens), then text documents."""
    gen = torch.Generator().manual_seed(6)
    patches, out = VISION.num_patches, []
    for _ in range(steps):
        rows = []
        for _ in range(ROWS):
            text = torch.randint(1, LLM.vocab_size, (int(torch.randint(2, 14, (), generator=gen)),), generator=gen)
            image_doc = {"tokens": torch.cat([torch.full((patches,), IMAGE_TOKEN), text[:-1]]),
                         "labels": torch.cat([torch.full((patches - 1,), IGNORE_INDEX), text])}
            docs = [image_doc] + [next_token_document(torch.randint(1, LLM.vocab_size, (int(n) + 1,), generator=gen))
                                  for n in torch.randint(1, 8, (4,), generator=gen)]
            rows.append(next(pack_rows(docs, LLM.seq_len)))  # the first row: the image document leads it
        batch = stack_rows(rows)
        batch["images"] = torch.rand(ROWS, 1, 16, 16, generator=gen)
        out.append(batch)
    return out


def documents_of(batch, row):
    """(start, stop) of each document of a row but the padding, which supervises nothing."""
    ids = batch["documents"][row]
    spans = []
    for doc in ids.unique().tolist():
        at = torch.nonzero(ids == doc).flatten()
        start, stop = int(at[0]), int(at[-1]) + 1
        if bool((batch["labels"][row, start:stop] != IGNORE_INDEX).any()):
            spans.append((start, stop))
    return spans


def gpt_reference(steps=STEPS) -> Record:
    torch.manual_seed(SEED)
    model = GPT(LLM)

    def loss(batch, step):
        total = sum(token_loss_sum(model(batch["tokens"][r : r + 1, a:b]), batch["labels"][r : r + 1, a:b])
                    for r in range(ROWS) for a, b in documents_of(batch, r))
        return [total / int((batch["labels"] != IGNORE_INDEX).sum())]

    return record_reference({"llm": model}, {"llm": OPTIM["llm"]}, text_batches(steps), loss)


def vlm_reference(steps=STEPS) -> Record:
    model = VisionLanguageModel(VISION, LLM, seed=0)

    def loss(batch, step):
        total = 0
        for r in range(ROWS):
            for a, b in documents_of(batch, r):
                tokens, labels = batch["tokens"][r : r + 1, a:b], batch["labels"][r : r + 1, a:b]
                logits = model(batch["images"][r : r + 1], tokens) if a == 0 else model.llm(tokens)
                total = total + token_loss_sum(logits, labels)
        return [total / int((batch["labels"] != IGNORE_INDEX).sum())]

    return record_reference({"vision": model.vision, "llm": model.llm}, OPTIM, vlm_batches(steps), loss, CLIP)


GPT_CASES = {
    "cp2": (2, {"cp": 2}, ParallelOptions()),
    "cp2 all-gather": (2, {"cp": 2}, ParallelOptions(cp_attention="allgather")),
    "tp2+sp": (2, {"tp": 2}, ParallelOptions(sequence_parallel=True)),
    "pp2": (2, {"pp": 2}, ParallelOptions()),
    "cp4": (4, {"cp": 4}, ParallelOptions()),
    "cp2·pp2": (4, {"cp": 2, "pp": 2}, ParallelOptions()),
}


def train_gpt_cases(rank, world_size, cases):
    results = {}
    for name in cases:
        _, layout, options = GPT_CASES[name]
        blocks = {"llm": module("gpt", LLM, layout, OPTIM["llm"], options)}
        runtime = build_runtime(experiment(world_size, blocks, global_batch=ROWS, microbatches=MICROBATCHES, seed=SEED))
        results[name] = record_run(runtime, text_batches())
    return results


@pytest.fixture(scope="module")
def gpt_runs():
    """Every GPT case, one multi-rank run per world size."""
    runs = {}
    for world_size in sorted({w for w, *_ in GPT_CASES.values()}):
        names = [name for name, (w, *_) in GPT_CASES.items() if w == world_size]
        results = run_ranks(train_gpt_cases, world_size, names, timeout_s=400)
        runs |= {name: [r[name] for r in results] for name in names}
    return runs


@pytest.fixture(scope="module")
def gpt_expected():
    return gpt_reference()


@pytest.mark.parametrize("name", list(GPT_CASES))
def test_packed_gpt_parity(name, gpt_runs, gpt_expected):
    print("\n" + check_parity(gpt_runs[name], gpt_expected, f"packed parity {name}"))


VLM_CASES = {
    "colocated vision dp2, llm cp2": (2, {"vision": {"dp": 2}, "llm": {"cp": 2}}, {}),
    "non-colocated vision (0), llm pp2 (1-2)": (3, {"vision": {"dp": 1}, "llm": {"pp": 2, "offset": 1}}, {}),
    "colocated vision dp4, llm tp2·cp2 with sequence parallelism": (
        4, {"vision": {"dp": 4}, "llm": {"tp": 2, "cp": 2}}, {"llm": ParallelOptions(sequence_parallel=True)}),
}


def train_vlm(rank, world_size, layouts, options):
    modules = {name: module(kind, config, layouts[name], OPTIM[name], options.get(name))
               for name, kind, config in (("vision", "vit", VISION), ("llm", "gpt", LLM))}
    runtime = build_runtime(experiment(world_size, modules, edges=[("vision", "llm")], global_batch=ROWS,
                                       microbatches=2, grad_clip=CLIP))
    return record_run(runtime, vlm_batches())


@pytest.fixture(scope="module")
def vlm_expected():
    return vlm_reference()


@pytest.mark.parametrize("case", list(VLM_CASES))
def test_packed_vlm_parity(case, vlm_expected):
    world_size, layouts, options = VLM_CASES[case]
    results = run_ranks(train_vlm, world_size, layouts, options, timeout_s=300)
    print("\n" + check_parity(results, vlm_expected, f"packed vlm parity {case}"))


def refuse_decreasing_documents(rank, world_size):
    blocks = {"llm": module("gpt", LLM, {"cp": 2}, OPTIM["llm"])}
    runtime = build_runtime(experiment(world_size, blocks, global_batch=ROWS, microbatches=MICROBATCHES, seed=SEED))
    batch = text_batches(1)[0]
    batch["documents"][3, 20:] = 0
    runtime.train_step(batch)


def test_a_batch_whose_document_ids_fall_is_refused_on_every_rank():
    with pytest.raises(Exception, match=r"llm: documents must not decrease along a row: row 3 falls"):
        run_ranks(refuse_decreasing_documents, 2, timeout_s=120)
