"""``format: text``: plain-text JSONL (``{"text": ...}`` a line), packed into rows.

Each split's documents are tokenized by the LLM's tokenizer (``hetero.data.chat.ChatTokenizer``: its
``init.hf`` tokenizer, else bytes), each followed by the tokenizer's end-of-text token when it has one,
and laid end to end. A row is a window of ``seq_len`` positions of that stream: training windows start
where ``(seed, step)`` draws them, held-out windows tile the held-out stream in order (at most
``HELDOUT_BATCHES`` batches). Rows carry ``documents`` (``hetero.kernels.documents``), so attention and
positions stay inside each document, and no label crosses from one document into the next.

The held-out split is ``train.data.heldout_path``, or every ``heldout_every``-th line. A line that is not
a JSON object with a string ``text`` is a bad sample (``train.data.on_error``).
"""

from __future__ import annotations

import hashlib
import json

import torch

from hetero.config import ExperimentConfig
from hetero.data.chat import ChatTokenizer
from hetero.data.collate import readers, tokenizer_dir
from hetero.data.config import SourceConfig
from hetero.data.digits import IGNORE_INDEX
from hetero.data.rank_batches import Reads, made_together, rank_columns
from hetero.data.sample_batches import DataError
from hetero.data.sources.format import DataFormat
from hetero.data.sources.llava import data_files
from hetero.errors import ConfigError
from hetero.graph.graph import Graph


HELDOUT_BATCHES = 16


def read_lines(path: str) -> list[tuple[bytes, str]]:
    """Every non-empty line of the JSONL files at ``path``, with where it is."""
    lines = []
    for file in data_files(path, (".jsonl",), "train.data.path"):
        for number, line in enumerate(file.read_bytes().splitlines(), 1):
            if line.strip():
                lines.append((line, f"{file} line {number}"))
    if not lines:
        raise ConfigError(f"train.data.path={path} holds no lines of text")
    return lines


def document_text(line: bytes, where: str) -> str:
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{where}: not UTF-8 ({err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not JSON ({err.msg})") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise ValueError(f"{where}: a line is a JSON object with a string text field")
    return record["text"]


class TextStream:
    """One split's documents as a token stream cut into windows (see the module docstring)."""

    def __init__(self, lines: list[tuple[bytes, str]], tokenizer: ChatTokenizer, split: str, global_batch_size: int,
                 seq_len: int, seed: int, on_error: str, max_skip_fraction: float):
        tokens, owners, self.skipped = [], [], 0
        for number, (line, where) in enumerate(lines):
            try:
                ids = tokenizer.encode_text(document_text(line, where))
            except ValueError as err:
                if on_error == "error":
                    raise DataError(f"{err} (train.data.on_error=skip skips bad samples)") from None
                self.skipped += 1
                if self.skipped > max_skip_fraction * len(lines):
                    raise DataError(f"{self.skipped} of the {len(lines)} {split} lines were skipped, more than "
                                    f"train.data.max_skip_fraction={max_skip_fraction}; the last: {err}") from None
                continue
            ids = ids + ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
            tokens += ids
            owners += [number] * len(ids)
        if len(tokens) < seq_len + 1:
            raise DataError(f"the {split} split holds {len(tokens)} tokens, fewer than a row of seq_len={seq_len} "
                            f"needs ({seq_len + 1}); add text or shorten the rows")
        self.tokens, self.owners = torch.tensor(tokens, dtype=torch.long), torch.tensor(owners, dtype=torch.long)
        self.global_batch_size, self.seq_len, self.seed = global_batch_size, seq_len, seed
        ends = (self.owners[1:] != self.owners[:-1]).long()  # ends[i]: position i + 1 starts another document
        self._ends = torch.cat([torch.zeros(1, dtype=torch.long, device="cpu"), ends.cumsum(0)])  # ends before each position

    def _rows(self, starts: torch.Tensor, reads: Reads | None) -> dict[str, torch.Tensor]:
        def made(rows: torch.Tensor) -> dict[str, torch.Tensor]:
            span = starts[rows, None] + torch.arange(self.seq_len + 1, device="cpu")
            tokens, owners = self.tokens[span], self.owners[span]
            same = owners[:, 1:] == owners[:, :-1]
            first = torch.zeros(len(rows), 1, dtype=torch.long, device="cpu")
            return {"tokens": tokens[:, :-1], "labels": torch.where(same, tokens[:, 1:], IGNORE_INDEX),
                    "documents": torch.cat([first, (~same[:, :-1]).long().cumsum(1)], 1)}

        bookkeeping = {"index": starts}
        if reads is not None:  # a window's labels less the document ends it crosses
            bookkeeping["label_counts"] = self.seq_len - (self._ends[starts + self.seq_len] - self._ends[starts])
        return rank_columns(bookkeeping, ("tokens", "labels", "documents"), made_together(made), reads)

    def batch(self, step: int, reads: Reads | None = None) -> dict[str, torch.Tensor]:
        digest = hashlib.blake2b(f"{self.seed}:{step}".encode(), digest_size=8).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
        return self._rows(torch.randint(0, len(self.tokens) - self.seq_len, (self.global_batch_size,),
                                        generator=generator), reads)

    def ordered_batches(self, reads: Reads | None = None) -> list[dict[str, torch.Tensor]]:
        windows = (len(self.tokens) - 1) // self.seq_len
        batches = min(HELDOUT_BATCHES, max(1, windows // self.global_batch_size))
        starts = torch.arange(batches * self.global_batch_size) * self.seq_len % (len(self.tokens) - self.seq_len)
        return [self._rows(chunk, reads) for chunk in starts.split(self.global_batch_size)]


class TextFormat(DataFormat):
    name = "text"

    def columns(self, experiment, graph, source) -> tuple[str, ...]:
        return ("tokens", "labels", "documents", "index")

    def _lines(self, experiment: ExperimentConfig, source: SourceConfig, split: str) -> list[tuple[bytes, str]]:
        data = experiment.train.data
        if source.path is None:
            raise ConfigError("train.data.format=text reads your JSONL files: set train.data.path")
        if split == "heldout" and data.heldout_path is not None:
            return read_lines(data.heldout_path)
        lines, every = read_lines(source.path), data.heldout_every
        chosen = [line for i, line in enumerate(lines) if (i % every == every - 1) == (split == "heldout")]
        if not chosen:
            raise ConfigError(f"train.data.path={source.path} has {len(lines)} lines: none for the {split} split "
                              f"with train.data.heldout_every={every}; add lines or give train.data.heldout_path")
        return chosen

    def open(self, experiment: ExperimentConfig, graph: Graph, source: SourceConfig) -> None:
        lines = self._lines(experiment, source, "train")
        if experiment.train.data.on_error == "error":
            for line, where in lines[:4]:
                try:
                    document_text(line, where)
                except ValueError as err:
                    raise ConfigError(str(err)) from None

    def load(self, experiment: ExperimentConfig, graph: Graph, source: SourceConfig, split: str) -> TextStream:
        llm, _ = readers(graph)
        data = experiment.train.data
        tokenizer = ChatTokenizer(tokenizer_dir(llm), data.image_token)
        return TextStream(self._lines(experiment, source, split), tokenizer, split, experiment.batch.global_batch_size,
                          llm.config.seq_len, experiment.seed, data.on_error, data.max_skip_fraction)
