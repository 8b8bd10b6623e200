"""The byte-level standard library corpus: real text, split by file, cached, and sampled deterministically."""

import math
import sysconfig
from pathlib import Path

import pytest
import torch

from hetero.data import text
from hetero.data.text import (
    VOCAB_SIZE,
    bits_per_byte,
    decode,
    encode,
    heldout_batches,
    load_stdlib_corpus,
    sample_batch,
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HETERO_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return load_stdlib_corpus()


def test_encode_decode_round_trip():
    sample = "def f(x):\n    return x  # naïve → ok ✓\n"
    tokens = encode(sample)
    assert tokens.dtype == torch.long
    assert tokens.tolist() == list(sample.encode("utf-8"))
    assert int(tokens.max()) < VOCAB_SIZE
    assert decode(tokens) == sample
    assert encode(b"\x00\xff").tolist() == [0, 255]
    assert encode("").numel() == 0
    assert decode([0xFF, 0x41]) == "\ufffdA"


def test_bits_per_byte():
    assert bits_per_byte(math.log(2)) == pytest.approx(1.0)
    assert bits_per_byte(math.log(VOCAB_SIZE)) == pytest.approx(8.0)


def test_corpus_is_real_and_split_by_file(corpus):
    print(corpus.summary())
    assert corpus.train.dtype == corpus.heldout.dtype == torch.uint8
    assert corpus.train.numel() >= 1_000_000
    assert corpus.heldout.numel() >= 50_000
    assert corpus.train.numel() + corpus.heldout.numel() <= 8_000_000
    assert set(corpus.train_files).isdisjoint(corpus.heldout_files)
    assert len(corpus.heldout_files) >= 10
    assert all(f.endswith(".py") and "test" not in f.split("/")[:-1] for f in corpus.train_files)
    # Real English and real code, not filler.
    train_text = decode(corpus.train[:200_000])
    assert "def " in train_text and "the " in train_text and "import " in train_text


def test_heldout_bytes_come_from_heldout_files_only(corpus):
    root = Path(sysconfig.get_paths()["stdlib"])
    first_heldout = (root / corpus.heldout_files[0]).read_bytes()
    assert corpus.heldout[: len(first_heldout)].tolist() == list(first_heldout)
    train_bytes = corpus.train.numpy().tobytes()
    assert first_heldout[:2000] not in train_bytes


def test_cache_is_written_then_read(tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_CACHE_DIR", str(tmp_path))
    first = load_stdlib_corpus(max_bytes=300_000, heldout_every=5)
    cached = list(tmp_path.iterdir())
    assert len(cached) == 1 and "300000" in cached[0].name and "every5" in cached[0].name
    assert not any(p.suffix == ".tmp" for p in tmp_path.iterdir())

    def no_rebuild(*args):
        raise AssertionError("the corpus was rebuilt instead of read from the cache")

    monkeypatch.setattr(text, "_build_corpus", no_rebuild)
    second = load_stdlib_corpus(max_bytes=300_000, heldout_every=5)
    assert torch.equal(first.train, second.train) and torch.equal(first.heldout, second.heldout)
    assert first.train_files == second.train_files and first.heldout_files == second.heldout_files
    with pytest.raises(AssertionError, match="rebuilt"):
        load_stdlib_corpus(max_bytes=300_000, heldout_every=4)  # other arguments, other cache entry


def test_sample_batch_is_a_function_of_seed_and_step():
    data = torch.arange(10_000, dtype=torch.int64).remainder(251).to(torch.uint8)
    inputs, labels = sample_batch(data, batch_size=8, seq_len=32, step=3, seed=0)
    assert inputs.shape == labels.shape == (8, 32)
    assert inputs.dtype == labels.dtype == torch.long
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    assert torch.equal(labels[:, -1], (inputs[:, -1] + 1) % 251)

    sample_batch(data, 8, 32, step=7, seed=0)  # history must not matter
    torch.manual_seed(1234)  # nor the global generator
    again = sample_batch(data, 8, 32, step=3, seed=0)
    assert torch.equal(again[0], inputs) and torch.equal(again[1], labels)
    assert not torch.equal(sample_batch(data, 8, 32, step=4, seed=0)[0], inputs)
    assert not torch.equal(sample_batch(data, 8, 32, step=3, seed=1)[0], inputs)


def test_sample_batch_stays_in_range():
    data = torch.arange(17, dtype=torch.uint8)
    for step in range(50):
        inputs, labels = sample_batch(data, batch_size=4, seq_len=16, step=step, seed=0)
        assert torch.equal(inputs, torch.arange(16).expand(4, 16))
        assert torch.equal(labels, torch.arange(1, 17).expand(4, 16))
    with pytest.raises(ValueError, match="seq_len=17"):
        sample_batch(data, 4, 17, step=0, seed=0)


def test_heldout_batches_are_fixed_and_span_the_data(corpus):
    batches = heldout_batches(corpus.heldout, batch_size=4, seq_len=128, num_batches=5)
    again = heldout_batches(corpus.heldout, batch_size=4, seq_len=128, num_batches=5)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again))
    assert len(batches) == 5
    for inputs, labels in batches:
        assert inputs.shape == labels.shape == (4, 128)
        assert torch.equal(inputs[:, 1:], labels[:, :-1])
    data = corpus.heldout.long()
    assert torch.equal(batches[0][0][0], data[:128])
    assert torch.equal(batches[-1][1][-1], data[-128:])

    tiny = torch.arange(9, dtype=torch.uint8)
    (inputs, labels), = heldout_batches(tiny, batch_size=3, seq_len=8, num_batches=1)
    assert torch.equal(inputs, torch.arange(8).expand(3, 8))
