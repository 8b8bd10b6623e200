"""Sequence packing: documents of any length laid end to end in rows of ``seq_len`` positions.

A document is a pair of 1-D tensors ``tokens`` and ``labels`` of one length (its next-token pairs; a
text of n+1 tokens gives n, ``next_token_document``). The packer takes documents in stream order and
fills the current row while the next document fits; the rest of a row that cannot take it is padding (a
document of its own, labels ignored), and the document starts the next row. Rows carry ``documents``:
each token's document number in its row, counting from 0 (``hetero.kernels.documents``), so that
attention stays inside each document and positions restart per document.

A document longer than a row is refused (``overflow="error"``, the default), or cut into pieces of
``seq_len`` positions, each a document of its own (``overflow="split"``: the later pieces lose the
context of the earlier ones); a document with images (``hetero.data.native_images``) is never split.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from hetero.data.digits import IGNORE_INDEX

OVERFLOW = ("error", "split")


class PackingError(ValueError):
    pass


def next_token_document(text: torch.Tensor) -> dict[str, torch.Tensor]:
    """The next-token pairs of a 1-D token sequence: positions ``len(text) - 1``."""
    return {"tokens": text[:-1], "labels": text[1:]}


@dataclass
class Row:
    seq_len: int
    pad_id: int
    parts: list[dict[str, torch.Tensor]] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)  # the stream index of each part's document
    used: int = 0

    def room(self) -> int:
        return self.seq_len - self.used

    def add(self, document: dict[str, torch.Tensor], source: int) -> None:
        self.parts.append(document)
        self.sources.append(source)
        self.used += len(document["tokens"])

    def tensors(self) -> dict[str, torch.Tensor]:
        """tokens, labels and documents (seq_len,) of the row, its tail padded."""
        tokens = [p["tokens"] for p in self.parts]
        labels = [p["labels"] for p in self.parts]
        ids = [torch.full((len(p["tokens"]),), i, dtype=torch.long) for i, p in enumerate(self.parts)]
        if self.room():
            tokens.append(torch.full((self.room(),), self.pad_id, dtype=torch.long))
            labels.append(torch.full((self.room(),), IGNORE_INDEX, dtype=torch.long))
            ids.append(torch.full((self.room(),), len(self.parts), dtype=torch.long))
        return {"tokens": torch.cat(tokens).long(), "labels": torch.cat(labels).long(), "documents": torch.cat(ids)}


def pack_rows(
    documents: Iterable[dict[str, torch.Tensor]], seq_len: int, *, pad_id: int = 0, overflow: str = "error",
    field_name: str = "seq_len",
) -> Iterator[Row]:
    """Rows of ``seq_len`` positions filled from ``documents`` in order (see the module docstring).
    ``field_name`` is what an overflow error names (e.g. ``llm.model.seq_len``)."""
    if overflow not in OVERFLOW:
        raise PackingError(f"overflow={overflow!r} is not one of {', '.join(OVERFLOW)}")
    row = Row(seq_len, pad_id)
    for source, document in enumerate(documents):
        length = len(document["tokens"])
        if length == 0:
            continue
        if length > seq_len:
            if overflow == "error" or document.get("images"):
                split = "" if document.get("images") else ", or pack with overflow='split'"
                raise PackingError(
                    f"document {source} holds {length} positions, more than a row's {field_name}={seq_len}; "
                    f"raise {field_name}, shorten the documents (or its images' max_patches){split}"
                )
            pieces = [{k: v[start : start + seq_len] for k, v in document.items()} for start in range(0, length, seq_len)]
        else:
            pieces = [document]
        for piece in pieces:
            if len(piece["tokens"]) > row.room():
                yield row
                row = Row(seq_len, pad_id)
            row.add(piece, source)
    if row.parts:
        yield row


def stack_rows(rows: list[Row]) -> dict[str, torch.Tensor]:
    """A batch (rows, seq_len) of tokens, labels and documents."""
    tensors = [row.tensors() for row in rows]
    return {key: torch.stack([t[key] for t in tensors]) for key in ("tokens", "labels", "documents")}


def padded_rows(documents: Iterable[dict[str, torch.Tensor]], seq_len: int, *, pad_id: int = 0) -> Iterator[Row]:
    """One document per row, padded to ``seq_len`` (the unpacked baseline); longer ones are refused."""
    for source, document in enumerate(documents):
        if len(document["tokens"]) > seq_len:
            raise PackingError(f"document {source} holds {len(document['tokens'])} positions, more than seq_len={seq_len}")
        row = Row(seq_len, pad_id)
        row.add(document, source)
        yield row


def useful_fraction(batch: dict[str, torch.Tensor]) -> float:
    """The share of a batch's positions that are supervised (not padding, not ignored)."""
    return float((batch["labels"] != IGNORE_INDEX).float().mean())
