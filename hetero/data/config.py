"""``train.data``: what a job trains on, read by the data format it names (``hetero.data.sources``).

A built-in dataset needs only ``format`` (e.g. ``digits``, ``photo_documents``); a user's files need
``format`` and ``path`` (``llava``: a JSON or JSONL file, or a directory of them; ``webdataset``: a
brace-expanded shard list, a directory or a glob; ``text``: JSONL of ``{"text": ...}``). ``mixture``
trains on several sources at once, each drawn with its weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ON_ERROR = ("error", "skip")
TOO_LONG = ("error", "truncate", "skip")


@dataclass
class SourceConfig:
    """One source of a mixture: a format, its location and its share of the samples."""

    format: str = ""
    path: str | None = None
    image_root: str | None = None
    weight: float = 1.0
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    format: str = "digits"  # a data format registered in hetero.data.sources (entry point group hetero.datasets)
    path: str | None = None  # the format's files (user data); built-in datasets write their own
    image_root: str | None = None  # where a conversation's image paths are resolved (default: the JSON's directory)
    heldout_path: str | None = None  # held-out samples of the same format (default: every heldout_every-th sample)
    heldout_every: int = 20
    mixture: list[SourceConfig] = field(default_factory=list)  # several sources instead of format/path
    caption_prompt: str = "<image>\nDescribe the image briefly."  # the user turn of an image-caption pair
    image_token: str | None = None  # the tokenizer's image token (default: its own, or bytes' 0)
    on_error: str = "error"  # a bad sample: error (name it and stop) | skip (count it, leave its row empty)
    max_skip_fraction: float = 0.01  # skip: the job stops once more than this share of a split is skipped
    too_long: str = "error"  # a sample longer than the LLM's seq_len: error | truncate | skip
    pack: bool = False  # users' conversations: several to a row (documents), or one a row, padded
    options: dict[str, Any] = field(default_factory=dict)  # a user format's own options
    per_rank: bool = True  # each rank holds only the rows and images its modules read (false: the global batch)
    workers: int = 0  # processes that build the next steps' batches while one trains (0: the loop builds them)

    def errors(self) -> list[str]:
        errors = []
        if self.on_error not in ON_ERROR:
            errors.append(f"train.data.on_error={self.on_error!r} is not one of {', '.join(ON_ERROR)}")
        if self.too_long not in TOO_LONG:
            errors.append(f"train.data.too_long={self.too_long!r} is not one of {', '.join(TOO_LONG)}")
        if not 0 <= self.max_skip_fraction <= 1:
            errors.append(f"train.data.max_skip_fraction={self.max_skip_fraction} must lie in [0, 1]")
        if self.workers < 0:
            errors.append(f"train.data.workers={self.workers} must be >= 0 (0: the training loop builds its batches)")
        if self.heldout_every < 2:
            errors.append(f"train.data.heldout_every={self.heldout_every} must be at least 2 (every Nth sample held out)")
        for i, source in enumerate(self.mixture):
            if source.weight <= 0:
                errors.append(f"train.data.mixture[{i}].weight={source.weight} must be > 0")
            if not source.format:
                errors.append(f"train.data.mixture[{i}].format is empty; name a data format")
        return errors

    def sources(self) -> list[SourceConfig]:
        """The mixture's sources, or this config's one source."""
        if self.mixture:
            return list(self.mixture)
        return [SourceConfig(self.format, self.path, self.image_root, 1.0, dict(self.options))]
