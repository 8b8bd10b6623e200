"""Captioned digit images for the vision-language model: scikit-learn's digits, as webdataset shards.

scikit-learn's wheel ships 1797 real handwritten digits (8×8 pixels, values 0..16, from the UCI optical
recognition data set), so this data needs no download. Each image is upscaled ×4 (nearest) to 1×32×32
float32 in [0, 1] and captioned in plain English from its label with one of four templates, chosen by
the sample's index: the digit character occurs exactly once and its offset is stored with the sample.

Held-out split: for each digit, every 10th of its images in dataset order (its 10th, 20th, ...) — 176
images, 17 or 18 per digit — and the other 1621 train. Counting per digit keeps the held-out classes
balanced (taking every 10th index would not: labels in this data follow a partly regular order).

``DigitBatches`` turns a split into global batches for the LLM: ``num_image_tokens`` placeholder tokens
(where the projected image embeddings go) followed by the caption's bytes, padded to ``seq_len``, with
next-token labels on the caption only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetero.data import shard_command
from hetero.data.shards import ShardError, ensure_shard_set, read_split, write_shard_set
from hetero.data.sample_table import SampleTable
from hetero.data.text import encode
from hetero.errors import ConfigError
from hetero.kinds.batch_rows import IGNORE_INDEX

UPSCALE = 4
IMAGE_SIZE = 8 * UPSCALE
SPLITS = ("train", "heldout")
HELDOUT_EVERY = 10
CAPTION_TEMPLATES = (
    "the digit {digit}.",
    "handwritten {digit}.",
    "a scan of the number {digit}.",
    "number {digit}, by hand.",
)
MAX_CAPTION_BYTES = max(len(template.format(digit=0)) for template in CAPTION_TEMPLATES)
IMAGE_TOKEN = 0  # NUL: marks the positions the image embeddings replace; never in a caption
PAD_TOKEN = 0xFF  # never occurs in UTF-8 text
_CLI_HELP = "write scikit-learn's digits, upscaled and captioned, as webdataset shards (train and heldout)"


def caption(index: int, label: int) -> tuple[str, int]:
    """The caption of sample ``index`` showing digit ``label``, and the offset of the digit in it."""
    template = CAPTION_TEMPLATES[index % len(CAPTION_TEMPLATES)]
    return template.format(digit=label), template.index("{digit}")


def heldout_mask(labels: np.ndarray) -> np.ndarray:
    """True for every ``HELDOUT_EVERY``-th occurrence of each label, in order (the 10th, 20th, ...)."""
    seen = np.zeros(int(labels.max()) + 1, dtype=np.int64)
    mask = np.zeros(len(labels), dtype=bool)
    for i, label in enumerate(labels):
        seen[label] += 1
        mask[i] = seen[label] % HELDOUT_EVERY == 0
    return mask


def digit_samples() -> dict[str, list[dict[str, Any]]]:
    """Each split's digits as webdataset samples: ``npy`` image, ``txt`` caption, ``cls`` label, ``json``."""
    from hetero.data.wheel_files import sklearn_digits  # load_digits()'s arrays, without importing sklearn

    digit_images, target = sklearn_digits()
    images = torch.from_numpy(digit_images).float() / 16
    images = images.repeat_interleave(UPSCALE, dim=1).repeat_interleave(UPSCALE, dim=2).unsqueeze(1)
    heldout = heldout_mask(target)
    splits: dict[str, list[dict[str, Any]]] = {name: [] for name in SPLITS}
    for index, label in enumerate(target.tolist()):
        text, offset = caption(index, label)
        splits["heldout" if heldout[index] else "train"].append(
            {
                "__key__": f"{index:04d}",
                "npy": images[index].numpy(),
                "txt": text,
                "cls": label,
                "json": {"index": index, "digit_offset": offset},
            }
        )
    return splits


def write_digit_shards(
    out_dir: str | Path, samples_per_shard: int = 256, overwrite: bool = False
) -> dict[str, Any]:
    """Write the digits as a shard set in ``out_dir`` (see ``hetero.data.shards``); return the manifest."""
    return write_shard_set(out_dir, digit_samples(), samples_per_shard, _meta(samples_per_shard), overwrite)


def ensure_digit_shards(out_dir: str | Path, samples_per_shard: int = 256) -> dict[str, Any]:
    """The manifest of the digit shards in ``out_dir``, writing them first if no complete set is there.

    Safe when several processes call it at once: one rename wins and the others read its set.
    """
    return ensure_shard_set(out_dir, lambda: write_digit_shards(out_dir, samples_per_shard), _meta(samples_per_shard))


def vlm_sequence(
    text: str, digit_offset: int, num_image_tokens: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """LLM tokens and next-token labels of one captioned image, and the position that predicts the digit.

    ``tokens`` are ``num_image_tokens`` × ``IMAGE_TOKEN``, the caption's bytes, then ``PAD_TOKEN`` up to
    ``seq_len``. ``labels[i] = tokens[i + 1]`` where that is the second caption byte or later, else
    ``IGNORE_INDEX``: the first caption byte is not predicted (the template is not in the image), and
    neither is padding. The returned position ``p`` has ``labels[p]`` = the digit character.
    """
    data = encode(text)
    if not 1 <= digit_offset < data.numel() or not chr(int(data[digit_offset])).isdigit():
        raise ValueError(f"caption {text!r} has no digit after its first character at offset {digit_offset}")
    if bool((data == IMAGE_TOKEN).any()):
        raise ValueError(f"caption {text!r} contains byte {IMAGE_TOKEN}, reserved for image tokens")
    start, end = num_image_tokens, num_image_tokens + data.numel()
    if end > seq_len:
        raise ValueError(
            f"seq_len={seq_len} cannot hold {num_image_tokens} image tokens and the caption {text!r}"
        )
    tokens = torch.full((seq_len,), PAD_TOKEN, dtype=torch.long)
    tokens[:start] = IMAGE_TOKEN
    tokens[start:end] = data
    labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.long)
    labels[start : end - 1] = data[1:]
    return tokens, labels, start + digit_offset - 1


class DigitBatches(SampleTable):
    """The digits split as a ``SampleTable``, read once through webdataset into memory.

    A batch is a dict of tensors with batch dim B: ``images`` (B, 1, 32, 32) float32, ``tokens`` and
    ``labels`` (B, seq_len) long, ``digit_position`` (B,) long (``labels[b, digit_position[b]]`` is the
    digit character), ``label`` (B,) long (the digit 0..9) and ``index`` (B,) long (the sample's index
    in scikit-learn's digits).
    """

    def __init__(
        self,
        shard_dir: str | Path,
        split: str,
        global_batch_size: int,
        num_image_tokens: int,
        seq_len: int,
        seed: int = 0,
        bad_shards: str = "error",
    ):
        """``bad_shards``: what a corrupt shard does, ``error`` or ``skip`` (see ``read_split``)."""
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size={global_batch_size} must be at least 1")
        if num_image_tokens < 0:
            raise ValueError(f"num_image_tokens={num_image_tokens} must not be negative")
        samples = read_split(shard_dir, split, bad_shards)
        super().__init__(digit_columns(samples, num_image_tokens, seq_len, split), split, global_batch_size, seed)


def digit_columns(samples: list[dict[str, Any]], num_image_tokens: int, seq_len: int, split: str) -> dict[str, torch.Tensor]:
    """The batch columns of decoded digit samples (``DigitBatches``'s)."""
    longest = max(len(encode(s["txt"])) for s in samples)
    if num_image_tokens + longest > seq_len:
        raise ValueError(
            f"seq_len={seq_len} with num_image_tokens={num_image_tokens}: the {split} captions are up to "
            f"{longest} bytes, so seq_len must be at least num_image_tokens + {longest}"
        )
    sequences = [vlm_sequence(s["txt"], s["json"]["digit_offset"], num_image_tokens, seq_len) for s in samples]
    return {
        "images": torch.from_numpy(np.stack([s["npy"] for s in samples])),
        "tokens": torch.stack([tokens for tokens, _, _ in sequences]),
        "labels": torch.stack([labels for _, labels, _ in sequences]),
        "digit_position": torch.tensor([position for _, _, position in sequences]),
        "label": torch.tensor([s["cls"] for s in samples]),
        "index": torch.tensor([s["json"]["index"] for s in samples]),
    }


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``digits`` under ``subparsers`` (e.g. of ``hetero data``); it runs via ``args.run(args)``."""
    return shard_command.register(subparsers, "digits", _CLI_HELP, _add_arguments, _run)


def main(argv: list[str] | None = None) -> int:
    """``python -m hetero.data.digits --out DIR``: the same command without the ``hetero`` wrapper."""
    return shard_command.main("hetero data digits", _CLI_HELP, _add_arguments, _run, argv)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="directory of the shard set")
    parser.add_argument("--samples-per-shard", type=int, default=256, help="samples in each tar shard")
    parser.add_argument("--overwrite", action="store_true", help="replace a shard set already in --out")


def _run(args: argparse.Namespace) -> None:
    try:
        if args.overwrite:
            manifest = write_digit_shards(args.out, args.samples_per_shard, overwrite=True)
        else:
            manifest = ensure_digit_shards(args.out, args.samples_per_shard)
    except (FileExistsError, ShardError) as err:
        raise ConfigError(str(err)) from err
    for name, split in manifest["splits"].items():
        size = sum(shard["bytes"] for shard in split["shards"])
        shards = len(split["shards"])
        print(f"{args.out}: {name} {split['count']} samples in {shards} shards, {size / 1e6:.1f} MB")


def _meta(samples_per_shard: int) -> dict[str, Any]:
    return {
        "dataset": "scikit-learn digits",
        "image": f"1x{IMAGE_SIZE}x{IMAGE_SIZE} float32 in [0, 1], 8x8 upscaled x{UPSCALE} (nearest)",
        "heldout": f"every {HELDOUT_EVERY}th occurrence of each digit in dataset order",
        "caption_templates": list(CAPTION_TEMPLATES),
        "samples_per_shard": samples_per_shard,
    }


if __name__ == "__main__":
    sys.exit(main())
