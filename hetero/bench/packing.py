"""Sequence packing pays: useful (supervised) tokens per second, packed rows against one document per
padded row, on the same documents in one run.

    python -m hetero.bench.packing [--documents 384] [--seq-len 256] [--rows 8] [--rounds 3]

The documents are paragraphs of Python's standard library sources (``hetero.data.text``: real text and
code, byte tokens), 8 to ``seq_len`` bytes each, in file order. Both variants train the same byte-level
GPT (AdamW, fp32) over every document once per round, in batches of ``rows`` rows: packed rows
(``hetero.data.packing``: each token attending within its document, positions restarting) and padded
rows (plain causal attention over the row, padding unsupervised). Rounds alternate which goes first.
"""

from __future__ import annotations

import argparse
import time

import torch

from hetero.data.packing import next_token_document, pack_rows, padded_rows, stack_rows
from hetero.data.text import SEPARATOR, load_stdlib_corpus
from hetero.kernels.documents import Documents
from hetero.models.gpt.config import GPTConfig
from hetero.models.gpt.model import GPT, token_loss_sum


def paragraphs(count: int, seq_len: int) -> list[torch.Tensor]:
    """The first ``count`` paragraphs of the corpus with 9 to ``seq_len + 1`` bytes."""
    data = bytes(load_stdlib_corpus().train[: 4_000_000].numpy())
    out = []
    for text in data.split(SEPARATOR):
        if 9 <= len(text) <= seq_len + 1:
            out.append(torch.frombuffer(bytearray(text), dtype=torch.uint8).long())
            if len(out) == count:
                break
    return out


def batches(documents: list[torch.Tensor], seq_len: int, rows: int, packed: bool) -> list[dict[str, torch.Tensor]]:
    pairs = [next_token_document(d) for d in documents]
    made = list(pack_rows(pairs, seq_len) if packed else padded_rows(pairs, seq_len))
    return [stack_rows(made[i : i + rows]) for i in range(0, len(made), rows)]


def train_pass(model: GPT, optimizer: torch.optim.Optimizer, data: list[dict[str, torch.Tensor]], packed: bool) -> float:
    started = time.perf_counter()
    for batch in data:
        documents = Documents(batch["documents"], batch["tokens"].device) if packed else None
        positions = documents.positions() if packed else None
        logits = model(batch["tokens"], positions, documents=documents)
        loss = token_loss_sum(logits, batch["labels"]) / int((batch["labels"] != -100).sum())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return time.perf_counter() - started


def measure(documents: int, seq_len: int, rows: int, rounds: int, seed: int = 0) -> dict:
    docs = paragraphs(documents, seq_len)
    data = {name: batches(docs, seq_len, rows, name == "packed") for name in ("packed", "padded")}
    config = GPTConfig(vocab_size=256, hidden_size=128, num_layers=2, num_heads=4, ffn_hidden_size=384, seq_len=seq_len)
    models = {}
    for name in data:
        torch.manual_seed(seed)
        model = GPT(config)
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    seconds = dict.fromkeys(data, 0.0)
    for r in range(rounds):
        for name in (("packed", "padded") if r % 2 == 0 else ("padded", "packed")):
            seconds[name] += train_pass(*models[name], data[name], name == "packed")
    result = {"documents": len(docs), "useful_tokens": sum(len(d) - 1 for d in docs), "rounds": rounds}
    for name, batches_ in data.items():
        positions = sum(b["tokens"].numel() for b in batches_)
        result[name] = {"rows": sum(len(b["tokens"]) for b in batches_), "positions": positions,
                        "seconds": seconds[name],
                        "useful_per_s": result["useful_tokens"] * rounds / seconds[name],
                        "positions_per_s": positions * rounds / seconds[name]}
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=384)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    result = measure(args.documents, args.seq_len, args.rows, args.rounds)
    print(f"{result['documents']} documents, {result['useful_tokens']:,} useful tokens, rows of {args.seq_len}, "
          f"{result['rounds']} rounds each")
    print("variant | rows | useful share | positions/s | useful tokens/s")
    for name in ("packed", "padded"):
        r = result[name]
        print(f"{name:7s} | {r['rows']:4d} | {result['useful_tokens'] / r['positions']:12.3f} | "
              f"{r['positions_per_s']:11,.0f} | {r['useful_per_s']:,.0f}")
    print(f"useful tokens/s, packed / padded: {result['packed']['useful_per_s'] / result['padded']['useful_per_s']:.2f}x")


if __name__ == "__main__":
    main()
