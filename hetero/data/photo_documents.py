"""Long packed rows of documents that mix photographs and text: ``train.data.format=photo_documents``.

A document alternates text and images: a passage of Python's standard-library sources (byte tokens,
``hetero.data.text``; the held-out split from its held-out files), then 1-4 photographs (random crops
of scikit-image's, at native resolution up to the encoder's ``max_patches``), each followed by another
passage. Documents pack into rows of the LLM's ``seq_len`` (4k-16k tokens in
``long_context_native_vlm``); a document too long for the rest of a row starts the next one.

Every step's batch is drawn from ``(seed, step)`` alone (the held-out batches from the held-out seed),
so it is the same on every rank and under any layout. ``index`` numbers the rows of the stream
(``step * rows + r``; the held-out batches' likewise). Every rank packs the step's rows (text and image
sizes); it cuts the tokens of the rows and resizes the images its modules read, and no others.
"""

from __future__ import annotations


import torch

from hetero.data.native_images import (NativeImage, image_patches, image_places, load_photos, multimodal_document,
                                       photo_crops)
from hetero.data.packing import pack_rows, stack_rows
from hetero.data.rank_batches import Reads, rank_columns
from hetero.data.text import load_stdlib_corpus
from hetero.kinds.batch_rows import IGNORE_INDEX


HELDOUT_BATCHES = 2
HELDOUT_SEED = 1_000_003


class PhotoDocuments:
    def __init__(self, split: str, global_batch_size: int, seq_len: int, patch_size: int, max_patches: int,
                 channels: int, seed: int = 0):
        corpus = load_stdlib_corpus()
        self.text = corpus.train if split == "train" else corpus.heldout
        self.photos = load_photos(channels)
        self.split, self.global_batch_size, self.seq_len, self.seed = split, global_batch_size, seq_len, seed
        self.patch_size, self.max_patches, self.channels = patch_size, max_patches, channels

    def _passage(self, generator: torch.Generator, longest: int) -> torch.Tensor:
        length = int(torch.randint(16, max(17, longest), (), generator=generator))
        start = int(torch.randint(0, self.text.numel() - length, (), generator=generator))
        return self.text[start : start + length].long()

    def _documents(self, generator: torch.Generator):
        longest = max(32, self.seq_len // 8)
        while True:
            crops = photo_crops(self.photos, int(torch.randint(1, 5, (), generator=generator)), generator)
            segments = [self._passage(generator, longest)]
            for crop in crops:
                segments += [NativeImage(crop, self.patch_size, self.max_patches), self._passage(generator, longest)]
            document = multimodal_document(segments)
            if len(document["tokens"]) <= self.seq_len:
                yield document

    def _rows(self, seed: int, first: int, reads: Reads | None) -> dict[str, torch.Tensor]:
        """The batch of ``seed``'s rows, numbered from ``first``, as rank ``reads`` holds it."""
        generator = torch.Generator().manual_seed(seed)
        rows = pack_rows(self._documents(generator), self.seq_len)
        chosen = [next(rows) for _ in range(self.global_batch_size)]
        text = stack_rows(chosen)
        places, images = image_places(chosen)
        bookkeeping = {"index": first + torch.arange(self.global_batch_size, device="cpu")} | places
        if reads is not None:
            bookkeeping["label_counts"] = (text["labels"] != IGNORE_INDEX).sum(1)
        width = self.channels * self.patch_size**2

        def items(held: torch.Tensor | None) -> dict[str, torch.Tensor]:
            if held is None:
                return {"image_patches": image_patches(images, width)}
            return {"image_patches": image_patches([images[i] for i in held.tolist()], width), "image_held": held}

        return rank_columns(bookkeeping, tuple(text), lambda key, rows: text[key][rows], reads, items)

    def batch(self, step: int, reads: Reads | None = None) -> dict[str, torch.Tensor]:
        return self._rows(self.seed * 1_000_033 + step, step * self.global_batch_size, reads)

    def ordered_batches(self, reads: Reads | None = None) -> list[dict[str, torch.Tensor]]:
        return [self._rows(HELDOUT_SEED + self.seed * 1_000_033 + b, b * self.global_batch_size, reads)
                for b in range(HELDOUT_BATCHES)]
