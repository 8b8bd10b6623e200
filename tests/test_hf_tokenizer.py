"""A ``tokenizer.json`` beside an LLM's ``init.hf`` checkpoint drives ``train.data.format=stdlib_text``: the
corpus is encoded with it (HF ``tokenizers``) instead of bytes; windows decode back to the corpus's text;
a tokenizer larger than the model's vocabulary is refused before any process starts."""

import pytest
import torch
from test_hf_import import CASES, saved
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hetero.data.text import decode, load_stdlib_corpus
from hetero.errors import ConfigError
from hetero.testing.kinds import build_graph
from hetero.testing.experiments import experiment, module
from hetero.data import splits


def byte_level_bpe(path, vocab_size=300):
    """A byte-level BPE trained offline on a slice of the corpus (as GPT-2's and Llama 3's are built)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = decode(load_stdlib_corpus().train[:200_000])
    tokenizer.train_from_iterator(text.split("\n\n"), trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    return tokenizer


def text_experiment(path, seq_len=32):
    block = module("gpt", {"seq_len": seq_len}, {"dp": 1}, init={"hf": str(path)})
    return experiment(1, {"llm": block}, global_batch=4, microbatches=1, train={"data": {"format": "stdlib_text"}})


def test_the_checkpoints_tokenizer_encodes_the_text(tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_CACHE_DIR", str(tmp_path / "cache"))
    config_class, model_class, fields = CASES["qwen3 with two kv heads and tied embeddings"]
    saved(tmp_path, config_class, model_class, fields | {"vocab_size": 320})
    tokenizer = byte_level_bpe(tmp_path)
    config = text_experiment(tmp_path)
    graph = build_graph(config)
    splits.check(config, graph)
    held_out = splits.load(config, graph, "heldout").ordered_batches()
    train = splits.load(config, graph, "train").batch(0)
    corpus = decode(load_stdlib_corpus().heldout)
    for batch in (held_out[0], train):
        tokens, labels = batch["tokens"], batch["labels"]
        assert tokens.shape == (4, 32) and tokens.dtype == torch.long and int(tokens.max()) < 300
        assert torch.equal(tokens[:, 1:], labels[:, :-1])
    for row in held_out[0]["tokens"]:
        assert tokenizer.decode(row.tolist()) in corpus
    assert int(held_out[0]["tokens"].max()) >= 256  # merged pairs: not bytes


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_CACHE_DIR", str(tmp_path / "cache"))
    saved(tmp_path, *CASES["mistral: a window the sequence does not reach"])  # vocab_size 96
    byte_level_bpe(tmp_path)
    config = text_experiment(tmp_path)
    with pytest.raises(ConfigError, match=r"tokenizer\.json has 300 tokens but llm\.model\.vocab_size=96; use the "
                                          r"tokenizer that came with the weights"):
        splits.check(config, build_graph(config))
