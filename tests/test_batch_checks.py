"""A batch the model cannot take is refused on every rank, naming the field and the fix, before any
collective: here a GPT of seq_len=10 under tp2 with sequence parallelism given batches of 9 tokens (once a
RoPE shape error on one rank and a gloo "collective mismatch" abort on the other)."""

import torch

from hetero.config import OptimizerConfig
from hetero.models.gpt.config import GPTConfig
from hetero.parallel.options import ParallelOptions
from hetero.runtime import build_runtime
from hetero.testing.experiments import experiment, module
from hetero.testing.multiprocess import run_ranks

LLM = GPTConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, seq_len=10)


def train_on_short_rows(rank, world_size):
    options = ParallelOptions(sequence_parallel=True)
    config = experiment(world_size, {"llm": module("gpt", LLM, {"tp": 2}, OptimizerConfig(), options)},
                        global_batch=4, microbatches=1)
    runtime = build_runtime(config)
    batch = {"tokens": torch.randint(0, 32, (4, 9)), "labels": torch.randint(0, 32, (4, 9))}
    try:
        runtime.train_step(batch)
    except ValueError as error:
        return str(error)
    return "trained"


def test_a_batch_of_the_wrong_sequence_length_is_refused_on_every_rank():
    messages = run_ranks(train_on_short_rows, 2, timeout_s=120)
    assert messages == ["llm: the batch's tokens hold 9 positions per row but llm.model.seq_len=10; make the "
                        "data's sequences 10 long or set llm.model.seq_len=9"] * 2
