"""A data format defined outside hetero: noisy sine waves captioned with their frequency, for the signal
encoder (``kind.py``) and an LLM.

Sample ``i`` of a split is a wave of ``frequency`` 1..``options.frequencies`` cycles over the signal's
``length`` at a random phase, plus noise, all drawn from ``(seed, split, i)``. Its row is the signal
encoder's placeholders, then the caption ``"<frequency> cycles."`` in bytes, with next-token labels on
the caption. Training step ``s`` holds samples ``s·B .. s·B + B - 1``; the held-out split is
``HELDOUT_BATCHES`` batches of its own samples. Batches are made whole and cut down to the rows a rank's
modules read (``reads``; ``compact``).

Installed packages register it under the entry point group ``hetero.datasets`` (its ``pyproject.toml``),
and a YAML trains on it with ``train.data: {format: signals, options: {frequencies: 8}}``.
"""

from __future__ import annotations

import hashlib

import torch

from hetero.data.rank_batches import compact
from hetero.data.sources.format import DataFormat
from hetero.errors import ConfigError

HELDOUT_BATCHES = 4
IGNORE_INDEX = -100


def _generator(seed: int, split: str, index: int) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{split}:{index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


class SignalBatches:
    def __init__(self, split: str, global_batch_size: int, length: int, placeholders: int, seq_len: int,
                 frequencies: int, seed: int):
        self.split, self.global_batch_size, self.seed = split, global_batch_size, seed
        self.length, self.placeholders, self.seq_len, self.frequencies = length, placeholders, seq_len, frequencies

    def _rows(self, first: int) -> dict[str, torch.Tensor]:
        size = self.global_batch_size
        signal = torch.zeros(size, self.length)
        tokens = torch.zeros(size, self.seq_len, dtype=torch.long)
        labels = torch.full((size, self.seq_len), IGNORE_INDEX, dtype=torch.long)
        time = torch.arange(self.length, dtype=torch.float32) / self.length
        for row in range(size):
            generator = _generator(self.seed, self.split, first + row)
            frequency = int(torch.randint(1, self.frequencies + 1, (), generator=generator))
            phase = float(torch.rand((), generator=generator)) * 2 * torch.pi
            noise = 0.1 * torch.randn(self.length, generator=generator)
            signal[row] = torch.sin(2 * torch.pi * frequency * time + phase) + noise
            caption = torch.tensor(list(f"{frequency} cycles.".encode()), dtype=torch.long)
            end = self.placeholders + len(caption)
            tokens[row, self.placeholders : end] = caption
            labels[row, self.placeholders - 1 : end - 1] = caption
        return {"signal": signal, "has_signal": torch.ones(size, dtype=torch.bool), "tokens": tokens, "labels": labels,
                "index": first + torch.arange(size)}

    def batch(self, step: int, reads=None) -> dict[str, torch.Tensor]:
        return compact(self._rows(step * self.global_batch_size), reads)

    def ordered_batches(self, reads=None) -> list[dict[str, torch.Tensor]]:
        return [compact(self._rows(b * self.global_batch_size), reads) for b in range(HELDOUT_BATCHES)]


class SignalFormat(DataFormat):
    name = "signals"

    def columns(self, experiment, graph, source) -> tuple[str, ...]:
        return ("signal", "has_signal", "tokens", "labels", "index")

    def _modules(self, graph):
        signal = next((n for n in graph.nodes.values() if "signal" in n.kind.data_keys(n.config)), None)
        llm = next((n for n in graph.nodes.values() if "tokens" in n.kind.data_keys(n.config)), None)
        if signal is None or llm is None:
            raise ConfigError("train.data.format=signals feeds a signal encoder (kind signal) and an LLM reading tokens")
        return signal, llm

    def check(self, experiment, graph, source) -> None:
        super().check(experiment, graph, source)
        signal, llm = self._modules(graph)
        frequencies = source.options.get("frequencies", 8)
        longest = signal.config.tokens + len(f"{frequencies} cycles.")
        if longest > llm.config.seq_len:
            raise ConfigError(f"train.data.format=signals needs {longest} positions: set {llm.name}.model.seq_len>={longest}")

    def load(self, experiment, graph, source, split) -> SignalBatches:
        signal, llm = self._modules(graph)
        return SignalBatches(split, experiment.batch.global_batch_size, signal.config.length, signal.config.tokens,
                             llm.config.seq_len, int(source.options.get("frequencies", 8)), experiment.seed)
