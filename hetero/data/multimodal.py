"""Multimodal samples for one job of four modules: a vision encoder, a DNA encoder, an LLM and a video
generator conditioned on the LLM's hidden states.

A sample is digit ``i`` of a split (``hetero.data.digits``; ``i`` is its index in scikit-learn's digits)
with up to three modalities beside its text: the digit's image; genome window ``(i · PAIR_STRIDE) mod
windows`` of the same split (as ``hetero.data.digit_dna``); and clip ``(i · CLIP_STRIDE) mod clips`` of
the same split of ``hetero.data.video_clips``. Text is always present. The image, the DNA and the clip are
each present independently with probability ``Presence.image``, ``.dna`` and ``.clip``, drawn by
``presence_flags`` from a hash of ``(seed, split, i)`` alone: not from the batch size, the order, the
epoch or the rank, so every rank and every resumed run sees the same flags. A module takes only the rows
whose ``has_*`` flag is set, so how many samples it gets varies from microbatch to microbatch.

The caption is the digit's caption; then `` gc N.`` (the window's GC-content bin, as ``DigitDnaBatches``)
only when the DNA is present; then `` clip: D on TEXTURE.`` (the digit class and texture of the clip's
scene 0, "A", which opens and closes the clip) only when the clip is present. The LLM's sequence is
``num_image_tokens`` placeholders, ``num_dna_tokens`` placeholders, the caption, then padding: the same
layout in every row, whatever is present. ``seq_len`` must hold the longest caption that any draw can give
(with every clause whose probability is above 0), so that whether it fits does not depend on the seed.

Supervision is ``vlm_sequence``'s next-token labels over the caption, less what the LLM cannot know.
Without the image, the position that predicts the digit is ``IGNORE_INDEX``: nothing else tells the digit.
Without the DNA there is no GC clause to predict (``gc_position`` and ``gc`` are -1). The clip clause is
never supervised: the LLM does not see the clip (the video generator reads the LLM's hidden states and
draws the clip from them), so the clause is the generator's prompt, and its facts are as unknowable to the
LLM as the digit without its image. So wherever the image and the DNA are present, labels equal
``DigitDnaBatches``' labels, and tokens equal its tokens up to the clip clause.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetero.data.digit_dna import DigitDnaBatches
from hetero.data.digits import IGNORE_INDEX, MAX_CAPTION_BYTES, caption, vlm_sequence
from hetero.data.shards import read_split

CLIP_STRIDE = 104729  # a prime: consecutive digits get clips far apart
MODALITIES = ("image", "dna", "clip")  # besides text, which every sample has
GC_CLAUSE_BYTES = len(" gc 0.")


@dataclasses.dataclass
class Presence:
    """The probability that a sample carries each modality besides text, drawn independently."""

    image: float = 0.75
    dna: float = 0.5
    clip: float = 0.5

    def __post_init__(self) -> None:
        for name, p in dataclasses.asdict(self).items():
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
                raise ValueError(f"presence.{name}={p!r} must be a probability in [0, 1]")


def presence_flags(seed: int, split: str, indices: Sequence[int], presence: Presence) -> torch.Tensor:
    """(len(indices), 3) bool: whether sample ``indices[k]`` carries each of ``MODALITIES``. A function of
    ``(seed, split, index)`` and ``presence`` only; the three draws are independent uniforms from one hash."""
    probabilities = [getattr(presence, name) for name in MODALITIES]
    rows = []
    for index in indices:
        digest = hashlib.blake2b(f"{seed}:{split}:{index}".encode(), digest_size=8 * len(MODALITIES)).digest()
        words = [int.from_bytes(digest[k : k + 8], "little") for k in range(0, len(digest), 8)]
        uniforms = [(word >> 11) / 2**53 for word in words]  # 53 bits: exactly representable, in [0, 1)
        rows.append([u < p for u, p in zip(uniforms, probabilities)])
    return torch.tensor(rows, dtype=torch.bool).reshape(len(indices), len(MODALITIES))


def clip_clause(scene: Mapping[str, Any]) -> str:
    """The caption's clause for a clip whose scene 0 is ``scene`` (an entry of a clip's ``scenes``)."""
    return f" clip: {scene['label']} on {scene['texture']}."


class MultimodalBatches(DigitDnaBatches):
    """``DigitDnaBatches`` where the image, DNA and clip of each sample may be absent (see the module
    docstring). A batch (the global batch, the same on every rank) holds ``images`` (B, 1, 32, 32),
    ``dna`` and ``dna_regions`` (B, window) long, ``clips`` (B, T, 1, S, S) float32 — each zero where
    absent — with ``has_image``, ``has_dna``, ``has_clip`` (B,) bool; ``clip_index`` (B,) long (the clip's
    index in its split, -1 where absent); ``tokens`` and ``labels`` (B, seq_len); ``digit_position`` (B,)
    (``labels[b, digit_position[b]]`` is the digit, or ``IGNORE_INDEX`` without the image);
    ``gc_position`` and ``gc`` (B,) (-1 without the DNA); ``label`` (B,) the digit and ``index`` (B,).
    ``clips`` is assembled per batch, so ``column("clips")`` does not exist."""

    assembled = ("clips",)

    def __init__(
        self,
        digit_dir: str | Path,
        genome_dir: str | Path,
        clip_dir: str | Path,
        split: str,
        global_batch_size: int,
        num_image_tokens: int,
        num_dna_tokens: int,
        seq_len: int,
        seed: int = 0,
        presence: Presence = Presence(),
        bad_shards: str = "error",
    ):
        placeholders = num_image_tokens + num_dna_tokens
        # The parent's sequences always hold the GC clause; give them room, then replace them below.
        parent_seq_len = max(seq_len, placeholders + MAX_CAPTION_BYTES + GC_CLAUSE_BYTES)
        super().__init__(
            digit_dir, genome_dir, split, global_batch_size, num_image_tokens, num_dna_tokens, parent_seq_len,
            seed, bad_shards,
        )
        clips = sorted(read_split(clip_dir, split, bad_shards), key=lambda s: s["json"]["index"])
        if not clips:
            raise ValueError(f"{clip_dir} holds no {split} clips")
        index, gc = self._data["index"], self._data["gc"]
        self._clip_rows = (index * CLIP_STRIDE) % len(clips)
        flags = presence_flags(seed, split, index.tolist(), presence)
        has_image, has_dna, has_clip = flags.unbind(1)

        parts = []  # per sample: the digit's caption, its digit's offset, the GC clause, the clip clause
        scenes = [clips[row]["json"]["scenes"][0] for row in self._clip_rows.tolist()]
        for i, label, gc_bin, scene in zip(index.tolist(), self._data["label"].tolist(), gc.tolist(), scenes):
            parts.append((*caption(i, label), f" gc {gc_bin}.", clip_clause(scene)))
        # The longest caption any draw can give, so that a seq_len that fits does not depend on the seed.
        longest = max(
            _bytes(text) + _bytes(gc_text) * (presence.dna > 0) + _bytes(clip_text) * (presence.clip > 0)
            for text, _, gc_text, clip_text in parts
        )
        if placeholders + longest > seq_len:
            raise ValueError(
                f"seq_len={seq_len} cannot hold the {split} captions: after num_image_tokens="
                f"{num_image_tokens} and num_dna_tokens={num_dna_tokens} placeholders come captions of up to "
                f"{longest} bytes (with {presence}), so seq_len must be at least {placeholders + longest}"
            )
        sequences = [
            _sequence(
                text, offset, gc_text if dna else "", clip_text if clip else "", image, placeholders, seq_len
            )
            for (text, offset, gc_text, clip_text), (image, dna, clip) in zip(parts, flags.tolist())
        ]
        self._clips = torch.from_numpy(np.stack([s["npy"] for s in clips]))
        clip_index = torch.tensor([s["json"]["index"] for s in clips])[self._clip_rows]
        self._data |= {
            "images": self._data["images"] * has_image[:, None, None, None],
            "has_image": has_image,
            "dna": self._data["dna"] * has_dna[:, None],
            "dna_regions": self._data["dna_regions"] * has_dna[:, None],
            "has_dna": has_dna,
            "gc": torch.where(has_dna, gc, -1),
            "has_clip": has_clip,
            "clip_index": torch.where(has_clip, clip_index, -1),
            "tokens": torch.stack([s[0] for s in sequences]),
            "labels": torch.stack([s[1] for s in sequences]),
            "digit_position": torch.tensor([s[2] for s in sequences]),
            "gc_position": torch.tensor([s[3] for s in sequences]),
        }

    def values(self, key: str, ids: torch.Tensor) -> torch.Tensor:
        if key == "clips":
            return self._clips[self._clip_rows[ids]] * self._data["has_clip"][ids][:, None, None, None, None]
        return super().values(key, ids)


def _sequence(
    text: str,
    digit_offset: int,
    gc_clause: str,
    clip_clause: str,
    has_image: bool,
    placeholders: int,
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Tokens, labels, digit position and GC position (-1 without ``gc_clause``) of one sample's caption:
    the digit's caption ``text``, ``gc_clause`` and ``clip_clause``, each possibly empty but ``text``."""
    caption_text = text + gc_clause + clip_clause
    tokens, labels, digit_position = vlm_sequence(caption_text, digit_offset, placeholders, seq_len)
    if not has_image:
        labels[digit_position] = IGNORE_INDEX
    end = placeholders + _bytes(text + gc_clause)
    labels[end - 1 :] = IGNORE_INDEX  # the clip clause: the video generator's prompt, not a fact to predict
    return tokens, labels, digit_position, end - 3 if gc_clause else -1


def _bytes(text: str) -> int:
    return len(text.encode())
