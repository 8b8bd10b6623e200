"""Text data from Python's own standard library sources, byte-level or through a Hugging Face tokenizer.

Every machine with Python carries a few megabytes of real English (comments, docstrings) mixed with real
code, so a language model can be trained and evaluated on it without any download. By default token ids
are byte values, so the vocabulary is fixed at 256 and a mean loss in nats converts directly to bits per
byte. ``tokenized`` encodes the same corpus with a ``tokenizer.json`` (HF ``tokenizers``, the ``hf``
extra), e.g. the one beside a pretrained LLM's weights.
"""

import hashlib
import math
import os
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

VOCAB_SIZE = 256
SEPARATOR = b"\n\n"
SKIPPED_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages"})
MAX_FILE_BYTES = 200_000


def encode(text: str | bytes) -> torch.Tensor:
    """Token ids of ``text``: its UTF-8 bytes as a 1-D long tensor."""
    data = text.encode("utf-8") if isinstance(text, str) else text
    return _as_tensor(data).long()


def decode(tokens: torch.Tensor | list[int]) -> str:
    """Text of byte tokens; byte sequences that are not valid UTF-8 become U+FFFD."""
    values = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
    return bytes(values).decode("utf-8", errors="replace")


def bits_per_byte(mean_nat_loss: float) -> float:
    """Mean cross-entropy in nats per byte token, expressed in bits per byte."""
    return mean_nat_loss / math.log(2)


@dataclass
class TextCorpus:
    """Train and held-out byte streams (1-D uint8), split by source file, plus the files behind each."""

    train: torch.Tensor
    heldout: torch.Tensor
    train_files: tuple[str, ...] = ()
    heldout_files: tuple[str, ...] = ()

    def summary(self) -> str:
        return (
            f"train {self.train.numel():,} bytes from {len(self.train_files)} files, "
            f"held-out {self.heldout.numel():,} bytes from {len(self.heldout_files)} files"
        )


def stdlib_files(max_bytes: int = 8_000_000) -> list[Path]:
    """The standard library sources that make up the corpus, in sorted order, within ``max_bytes``.

    Tests, IDLE, lib2to3 (mostly fixtures), installed packages and very large generated files are left
    out. The list stops before the first file that would take the total past ``max_bytes``.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen, total = [], 0
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        if SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1]):
            continue
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            continue
        if total + size > max_bytes:
            break
        chosen.append(path)
        total += size
    return chosen


def load_stdlib_corpus(max_bytes: int = 8_000_000, heldout_every: int = 20) -> TextCorpus:
    """The standard library corpus, every ``heldout_every``-th file held out, cached on disk.

    The cache lives in ``$HETERO_CACHE_DIR`` (default ``~/.cache/hetero``); its name carries the Python
    version, since another interpreter ships other sources.
    """
    if heldout_every < 2:
        raise ValueError(f"heldout_every={heldout_every} must be at least 2 so both splits get files")
    cache_dir = Path(os.environ.get("HETERO_CACHE_DIR", Path.home() / ".cache" / "hetero"))
    version = ".".join(map(str, sys.version_info[:3]))
    path = cache_dir / f"stdlib-py{version}-{max_bytes}-every{heldout_every}.pt"
    if path.exists():
        return TextCorpus(**torch.load(path, weights_only=True))
    corpus = _build_corpus(max_bytes, heldout_every)
    _save_atomically(vars(corpus), path)
    return corpus


def tokenized(corpus: TextCorpus, tokenizer: Path) -> TextCorpus:
    """``corpus`` with each split encoded by the tokenizer in ``tokenizer`` (a ``tokenizer.json``): 1-D
    int32 token ids, each file encoded on its own and joined by the encoded separator. Cached beside the
    byte corpus, keyed by the tokenizer file's hash."""
    from tokenizers import Tokenizer

    digest = hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()[:16]
    cache_dir = Path(os.environ.get("HETERO_CACHE_DIR", Path.home() / ".cache" / "hetero"))
    key = hashlib.sha256(corpus.train[:4096].numpy().tobytes() + str(corpus.summary()).encode()).hexdigest()[:16]
    path = cache_dir / f"stdlib-tokens-{key}-{digest}.pt"
    if path.exists():
        return TextCorpus(**torch.load(path, weights_only=True))
    encoder = Tokenizer.from_file(str(tokenizer))

    def encode_split(data: torch.Tensor) -> torch.Tensor:
        texts = bytes(data.numpy()).split(SEPARATOR)
        separator = encoder.encode(SEPARATOR.decode(), add_special_tokens=False).ids
        ids: list[int] = []
        for i, encoding in enumerate(encoder.encode_batch([t.decode("utf-8", errors="replace") for t in texts],
                                                          add_special_tokens=False)):
            ids += (separator if i else []) + encoding.ids
        return torch.tensor(ids, dtype=torch.int32)

    result = TextCorpus(encode_split(corpus.train), encode_split(corpus.heldout), corpus.train_files,
                        corpus.heldout_files)
    _save_atomically(vars(result), path)
    return result


def sample_batch(
    data: torch.Tensor, batch_size: int, seq_len: int, step: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of training step ``step``: random windows, labels shifted by one byte.

    The offsets depend only on ``(seed, step)``, so every rank and a single-process reference draw the
    same batch for a step whatever they sampled before.
    """
    return windows(data, window_starts(data, batch_size, seq_len, step, seed), seq_len)


def window_starts(data: torch.Tensor, batch_size: int, seq_len: int, step: int, seed: int) -> torch.Tensor:
    """Where step ``step``'s training windows start in ``data`` (``sample_batch``'s): each window's id."""
    _check_length(data, seq_len)
    generator = torch.Generator().manual_seed(_step_seed(seed, step))
    return torch.randint(0, data.numel() - seq_len, (batch_size,), generator=generator)


def heldout_batches(
    data: torch.Tensor, batch_size: int, seq_len: int, num_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_batches`` evaluation batches of windows spread evenly from the start to the end of ``data``."""
    return [windows(data, chunk, seq_len) for chunk in heldout_starts(data, batch_size, seq_len, num_batches)]


def heldout_starts(data: torch.Tensor, batch_size: int, seq_len: int, num_batches: int) -> list[torch.Tensor]:
    """Where each evaluation batch's windows start in ``data`` (``heldout_batches``'s)."""
    _check_length(data, seq_len)
    count = batch_size * num_batches
    last_start = data.numel() - seq_len - 1
    return list((torch.arange(count) * last_start // max(count - 1, 1)).split(batch_size))


def _build_corpus(max_bytes: int, heldout_every: int) -> TextCorpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    train: list[Path] = []
    heldout: list[Path] = []
    for index, path in enumerate(stdlib_files(max_bytes)):
        (heldout if index % heldout_every == heldout_every - 1 else train).append(path)

    def join(paths: list[Path]) -> torch.Tensor:
        return _as_tensor(SEPARATOR.join(p.read_bytes() for p in paths))

    def names(paths: list[Path]) -> tuple[str, ...]:
        return tuple(p.relative_to(root).as_posix() for p in paths)

    return TextCorpus(join(train), join(heldout), names(train), names(heldout))


def _save_atomically(obj: object, path: Path) -> None:
    """Write via a temporary file in the same directory so a reader never sees half a cache file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _as_tensor(data: bytes) -> torch.Tensor:
    # numpy accepts empty buffers, torch.frombuffer does not; the copy makes the tensor writable.
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())


def _step_seed(seed: int, step: int) -> int:
    # A hash rather than seed * K + step, which would give some distinct (seed, step) pairs one seed.
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _check_length(data: torch.Tensor, seq_len: int) -> None:
    if data.numel() < seq_len + 1:
        raise ValueError(f"data has {data.numel()} tokens; seq_len={seq_len} needs at least {seq_len + 1}")


def windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    windows = data[starts[:, None] + torch.arange(seq_len + 1)].long()
    return windows[:, :-1], windows[:, 1:]


class WindowSet:
    """A finite training set: ``count`` fixed windows of ``data``, served in a shuffled order per epoch.

    Sample ``i`` is always the same window, so a per-sample cache can key on it. ``batch(step, size)`` is
    the batch at stream position ``step * size``; epochs follow each other (a batch may span two).
    """

    def __init__(self, data: torch.Tensor, count: int, seq_len: int, seed: int):
        _check_length(data, seq_len)
        generator = torch.Generator().manual_seed(_step_seed(seed, -1))
        self.data, self.seq_len, self.seed = data, seq_len, seed
        self.starts = torch.randint(0, data.numel() - seq_len, (count,), generator=generator)

    def __len__(self) -> int:
        return self.starts.numel()

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens, labels and sample ids of the global batch of ``step``."""
        ids = []
        for position in range(step * batch_size, (step + 1) * batch_size):
            epoch, offset = divmod(position, len(self))
            order = torch.randperm(len(self), generator=torch.Generator().manual_seed(_step_seed(self.seed, epoch)))
            ids.append(int(order[offset]))
        index = torch.tensor(ids)
        tokens, labels = windows(self.data, self.starts[index], self.seq_len)
        return tokens, labels, index
