"""``hetero data example --format llava|webdataset OUT``: a small dataset of your own, from real images
that install with hetero (scikit-learn's handwritten digits, scikit-image's photographs), in the forms
people bring their data in.

- ``llava``: ``OUT/conversations.json`` and ``OUT/images/``. Conversations about one digit ("what digit
  is this?"), two digits in one turn, a digit over two turns (its value, then whether it is even), and
  crops of the photographs with a line about what they show; some with a system prompt, some text-only.
- ``webdataset``: ``OUT/shard-000000.tar`` ... of ``<key>.png`` or ``<key>.jpg`` with ``<key>.txt``
  captions (a digit, or a crop of a photograph).

Everything follows from ``--seed``: the same command writes the same files.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image

PHOTOS = {  # scikit-image's photographs and what they show
    "astronaut": "an astronaut in a white suit in front of a flag",
    "coffee": "a cup of coffee on a saucer",
    "chelsea": "a tabby cat looking to the side",
    "rocket": "a rocket on its launch pad",
    "camera": "a man with a camera on a tripod",
    "coins": "old coins laid out in rows",
    "moon": "the surface of the moon",
    "page": "a printed page of text",
    "clock": "a clock on a wall",
    "hubble_deep_field": "galaxies in deep space",
}
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
SYSTEM = "You are a careful assistant who looks at images."


def _digits():
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.images * (255 / 16)).round().astype(np.uint8), digits.target.tolist()


def _photos():
    import skimage.data

    return {name: np.asarray(getattr(skimage.data, name)()) for name in PHOTOS}


def _crop(photo: np.ndarray, rng: random.Random) -> Image.Image:
    height, width = photo.shape[:2]
    h, w = rng.randint(height // 2, height), rng.randint(width // 2, width)
    top, left = rng.randint(0, height - h), rng.randint(0, width - w)
    return Image.fromarray(photo[top : top + h, left : left + w])


def _turn(who: str, text: str) -> dict:
    return {"from": who, "value": text}


def write_llava(out: Path, samples: int, seed: int) -> Path:
    """Write the LLaVA-style example into ``out``; the JSON file's path."""
    rng = random.Random(seed)
    images, labels = _digits()
    photos = _photos()
    (out / "images").mkdir(parents=True, exist_ok=True)
    written: dict[str, str] = {}

    def digit_file(i: int) -> str:
        if i not in written:
            written[i] = f"images/digit_{i:04d}.png"
            Image.fromarray(images[i]).save(out / written[i])
        return written[i]

    records = []
    for n in range(samples):
        kind = rng.choices(("one", "two", "turns", "photo", "text"), weights=(5, 2, 2, 2, 1))[0]
        i, j = rng.randrange(len(labels)), rng.randrange(len(labels))
        if kind == "one":
            record = {"image": digit_file(i), "conversations": [
                _turn("human", "<image>\nWhat digit is this?"), _turn("gpt", f"It is a {labels[i]}.")]}
        elif kind == "two":
            record = {"image": [digit_file(i), digit_file(j)], "conversations": [
                _turn("human", "<image> <image>\nWhich two digits are these?"),
                _turn("gpt", f"{labels[i]} and {labels[j]}.")]}
        elif kind == "turns":
            record = {"image": digit_file(i), "conversations": [
                _turn("human", "Look: <image>\nWhat digit is it?"), _turn("gpt", f"{WORDS[labels[i]]}."),
                _turn("human", "Is it even?"), _turn("gpt", "yes." if labels[i] % 2 == 0 else "no.")]}
        elif kind == "photo":
            name = rng.choice(sorted(PHOTOS))
            path = f"images/photo_{n:04d}.jpg"
            _crop(photos[name], rng).convert("RGB").save(out / path, quality=90)
            record = {"image": path, "conversations": [
                _turn("human", "<image>\nWhat does this show?"), _turn("gpt", PHOTOS[name] + ".")]}
        else:
            record = {"conversations": [_turn("human", f"Spell the digit {labels[i]}."), _turn("gpt", WORDS[labels[i]] + ".")]}
        if rng.random() < 0.3:
            record["conversations"].insert(0, _turn("system", SYSTEM))
        records.append({"id": f"{n:06d}"} | record)
    path = out / "conversations.json"
    path.write_text(json.dumps(records, indent=1) + "\n")
    return path


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), 0
    tar.addfile(info, io.BytesIO(data))


def write_webdataset(out: Path, samples: int, seed: int, per_shard: int = 100) -> list[Path]:
    """Write the image-caption example as tar shards in ``out``; their paths."""
    rng = random.Random(seed)
    images, labels = _digits()
    photos = _photos()
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    for first in range(0, samples, per_shard):
        shards.append(out / f"shard-{len(shards):06d}.tar")
        with tarfile.open(shards[-1], "w") as tar:
            for n in range(first, min(samples, first + per_shard)):
                buffer = io.BytesIO()
                if rng.random() < 0.8:
                    i = rng.randrange(len(labels))
                    Image.fromarray(images[i]).save(buffer, format="PNG")
                    extension, caption = "png", f"a handwritten {labels[i]}."
                else:
                    name = rng.choice(sorted(PHOTOS))
                    _crop(photos[name], rng).convert("RGB").save(buffer, format="JPEG", quality=90)
                    extension, caption = "jpg", PHOTOS[name] + "."
                _add(tar, f"{n:06d}.{extension}", buffer.getvalue())
                _add(tar, f"{n:06d}.txt", caption.encode())
    return shards


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("example", help="write an example dataset of real images (LLaVA JSON or "
                                   "WebDataset shards) to train on with train.data.format")
    parser.add_argument("out", type=Path, help="directory to write into")
    parser.add_argument("--format", choices=("llava", "webdataset"), default="llava")
    parser.add_argument("--samples", type=int, default=1200)
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> None:
    if args.format == "llava":
        path = write_llava(args.out, args.samples, args.seed)
        print(f"wrote {args.samples} conversations to {path}: train on them with train.data.format=llava "
              f"train.data.path={path}")
    else:
        shards = write_webdataset(args.out, args.samples, args.seed)
        print(f"wrote {args.samples} image-caption pairs to {len(shards)} shards in {args.out}: train on them with "
              f"train.data.format=webdataset train.data.path={args.out}")
