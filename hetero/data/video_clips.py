"""Video clips that revisit a scene after a gap, for KV-cache memory policies: real digits over real textures.

An autoregressive video generator with a memory budget smaller than the gap can predict the revisited
frames well only if its memory kept the first scene. Every clip is built from images that ship inside
installed wheels, so this data needs no download: scikit-learn's handwritten digits (8×8, the same ones
as ``hetero.data.digits``) move over textures from scikit-image's ``skimage.data`` (``TEXTURES``).

A clip is ``frames`` frames of 1×``size``×``size`` float32 in [0, 1], made of segments, each showing one
scene: an S×S crop of one texture (downscaled ×``TEXTURE_DOWNSCALE`` by block mean and stretched to
[0, 1] between its 1st and 99th percentile, then dimmed by ``BACKGROUND_GAIN``) with one digit, resized
(bilinear) to ``digit_size``×``digit_size``, composited on top in white with its ink as alpha. The digit
moves at a constant velocity and bounces off the frame's edges, at whole-pixel positions.

The layout is always: scene 0 ("A") for ``a_len`` frames, then ``gap`` frames of ``gap_scenes`` other
scenes (1, 2, ...; the gap split into equal runs, earlier ones one frame longer where it does not
divide), then scene 0 again until the clip ends. Each frame shows its scene at a scene time: by
default (``revisit_motion="continue"``) the clip's frame number, so every scene keeps moving while it is
off screen and the returning A continues A's motion — its background and digit are exactly A's, and the
digit's position follows from the start and velocity that A's frames show. ``"restart"`` replays A from
its first frame instead, so the revisit copies A frame for frame. Either way nothing in the gap predicts
it: the scenes of one clip use distinct textures and distinct digit classes, crops are drawn again while
flatter than ``MIN_CROP_STD`` (the sky of ``camera``), and a clip is drawn again (from the same random
stream) unless every revisit frame is nearer, in mean squared error, to some frame of A than to every
gap frame — so a generator whose memory dropped A cannot predict the revisit from what it kept.

Per frame a clip records ``revisit`` (the frame belongs to the returning A), ``scene`` (the id of the
scene it shows, 0 for A, within that clip) and ``time`` (the scene time it shows), so a benchmark can
report the error on revisited frames apart from all frames. Its ``scenes`` list describes every scene
(texture, crop offset, digit, start, velocity); ``render_frame(scenes[scene[t]], time[t], ...)``
redraws frame ``t`` from that description.

Splits use disjoint images: held-out clips take their digits from the images ``hetero.data.digits``
holds out (every 10th of each digit) and their crops from the right half of every texture; training
clips take the other digits and the left half. Clip ``i`` of a split depends only on ``(seed, split,
i)`` and the clip options, not on how many clips are made.

``write_video_shards`` stores both splits as a shard set (``hetero.data.shards``) and ``VideoClips``
serves a split as deterministic batches (``hetero.data.sample_table``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hetero.data.digits import SPLITS, heldout_mask
from hetero.data import shard_command
from hetero.data.sample_table import SampleTable
from hetero.data.shards import ShardError, ensure_shard_set, read_split, write_shard_set
from hetero.errors import ConfigError

TEXTURES = ("brick", "grass", "gravel", "camera", "coins", "text")  # files inside scikit-image's wheel
TEXTURE_DOWNSCALE = 4
BACKGROUND_GAIN = 0.7  # textures span [0, 0.7] so that the white digit (1.0) stands out on every one
MIN_CROP_STD = 0.08  # of a crop in [0, 1], before the gain
MAX_CROP_TRIES = 1000
MAX_CLIP_TRIES = 100  # about 1 clip in 200 is drawn again (see the module docstring)
SPEED_RANGE = (0.4, 1.2)  # pixels per frame, drawn for each axis with a random sign
DIGIT_CLASSES = 10
_CLI_HELP = "write video clips that revisit a scene after a gap (digits over textures) as webdataset shards"


@dataclasses.dataclass(frozen=True)
class ClipOptions:
    """The shape of every clip: ``frames`` frames of ``size``×``size``, A for ``a_len`` frames, then
    ``gap`` frames of ``gap_scenes`` other scenes, then A for the rest; digits ``digit_size`` wide
    (``None``: ``size * 5 // 8``, 10 for 16); the returning A continues its motion or restarts it
    (``revisit_motion``: ``"continue"`` or ``"restart"``)."""

    frames: int = 32
    size: int = 16
    gap: int = 16
    a_len: int = 8
    gap_scenes: int = 2
    digit_size: int | None = None
    revisit_motion: str = "continue"

    def __post_init__(self) -> None:
        if self.revisit_motion not in ("continue", "restart"):
            raise ValueError(f"revisit_motion={self.revisit_motion!r} is not 'continue' or 'restart'")
        if self.digit_size is None:
            object.__setattr__(self, "digit_size", self.size * 5 // 8)
        if not 1 <= self.digit_size < self.size:
            raise ValueError(f"digit_size={self.digit_size} must be 1 .. size - 1 = {self.size - 1}")
        if self.a_len < 1 or self.gap < 1:
            raise ValueError(f"a_len={self.a_len} and gap={self.gap} must be at least 1")
        if self.a_len + self.gap >= self.frames:
            raise ValueError(
                f"frames={self.frames} leaves no revisit after a_len={self.a_len} and gap={self.gap}"
            )
        most = min(len(TEXTURES), DIGIT_CLASSES) - 1
        if not 1 <= self.gap_scenes <= min(self.gap, most):
            raise ValueError(
                f"gap_scenes={self.gap_scenes} must be 1 .. {min(self.gap, most)} (at most gap={self.gap}, "
                f"and every scene of a clip needs its own texture and digit class)"
            )
        smallest = min(min(t.shape[0], t.shape[1] // 2) for t in textures().values())
        if self.size > smallest:
            raise ValueError(f"size={self.size} is larger than the smallest texture half ({smallest} pixels)")

    def segments(self) -> list[dict[str, int]]:
        """The clip's runs of one scene, in order: ``scene`` id, first frame ``start``, ``length``."""
        base, extra = divmod(self.gap, self.gap_scenes)
        lengths = [(0, self.a_len)]
        lengths += [(k + 1, base + (1 if k < extra else 0)) for k in range(self.gap_scenes)]
        lengths += [(0, self.frames - self.a_len - self.gap)]
        starts = np.cumsum([0] + [length for _, length in lengths])
        return [{"scene": s, "start": int(t), "length": n} for (s, n), t in zip(lengths, starts)]

    def layout(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per frame: ``scene`` id (int64), ``revisit`` (bool) and the scene ``time`` shown (int64)."""
        scene = np.zeros(self.frames, dtype=np.int64)
        for segment in self.segments():
            scene[segment["start"] : segment["start"] + segment["length"]] = segment["scene"]
        revisit = np.arange(self.frames) >= self.a_len + self.gap
        time = np.arange(self.frames, dtype=np.int64)
        if self.revisit_motion == "restart":
            time[revisit] -= self.a_len + self.gap
        return scene, revisit, time


@functools.cache
def textures() -> dict[str, np.ndarray]:
    """``TEXTURES`` as float32 in [0, 1], downscaled ×``TEXTURE_DOWNSCALE`` (block mean) and stretched
    between their 1st and 99th percentile. They are files in scikit-image's wheel: nothing is fetched."""
    from hetero.data.wheel_files import skimage_image  # skimage.data.<name>(), without importing skimage

    result = {}
    for name in TEXTURES:
        image = np.asarray(skimage_image(name), dtype=np.float64)
        f = TEXTURE_DOWNSCALE
        h, w = image.shape[0] // f, image.shape[1] // f
        image = image[: h * f, : w * f].reshape(h, f, w, f).mean(axis=(1, 3))
        low, high = np.percentile(image, [1, 99])
        result[name] = np.clip((image - low) / (high - low), 0, 1).astype(np.float32)
    return result


@functools.cache
def _digits() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's digits: images (N, 8, 8) float32 in [0, 1], labels, and True where held out."""
    from hetero.data.wheel_files import sklearn_digits  # load_digits()'s arrays, without importing sklearn

    images, target = sklearn_digits()
    return (images / 16).astype(np.float32), target, heldout_mask(target)


@functools.cache
def _digit_sprite(index: int, digit_size: int) -> np.ndarray:
    image = torch.from_numpy(_digits()[0][index])[None, None]
    sprite = torch.nn.functional.interpolate(image, size=(digit_size, digit_size), mode="bilinear")
    return sprite[0, 0].clamp(0, 1).numpy()


def digit_indices(split: str) -> np.ndarray:
    """The indices in scikit-learn's digits that ``split``'s clips draw from (disjoint between splits)."""
    _check_split(split)
    held = _digits()[2]
    return np.flatnonzero(held if split == "heldout" else ~held)


def digit_position(scene: Mapping[str, Any], t: int, size: int, digit_size: int) -> tuple[int, int]:
    """Top-left pixel of ``scene``'s digit at clip time ``t``: moving from ``start`` at ``velocity``,
    reflected off the edges (a triangle wave over 0 .. size - digit_size), rounded half up."""
    span = size - digit_size
    position = []
    for start, velocity in zip(scene["start"], scene["velocity"]):
        x = (start + velocity * t) % (2 * span)
        position.append(int(np.floor(span - abs(x - span) + 0.5)))
    return position[0], position[1]


def render_frame(scene: Mapping[str, Any], t: int, size: int, digit_size: int) -> np.ndarray:
    """``scene`` (an entry of a clip's ``scenes``) at clip time ``t``: (size, size) float32 in [0, 1]."""
    y, x = scene["offset"]
    frame = BACKGROUND_GAIN * textures()[scene["texture"]][y : y + size, x : x + size].copy()
    alpha = _digit_sprite(scene["digit_index"], digit_size)
    py, px = digit_position(scene, t, size, digit_size)
    window = frame[py : py + digit_size, px : px + digit_size]
    window[:] = (1 - alpha) * window + alpha  # the digit in white, its ink as alpha
    return frame


def make_clip(index: int, options: ClipOptions, seed: int = 0, split: str = "train") -> dict[str, Any]:
    """Clip ``index`` of ``split``: a function of ``(seed, split, index)`` and ``options`` only.

    A dict of ``index``; ``frames`` (T, 1, S, S) float32; ``revisit`` (T,) bool; ``scene`` and ``time``
    (T,) int64; ``scenes`` (descriptions, id = position) and ``segments`` (see ``ClipOptions.segments``).
    """
    _check_split(split)
    rng = np.random.default_rng([seed, SPLITS.index(split), index])
    scene, revisit, time = options.layout()
    for _ in range(MAX_CLIP_TRIES):
        scenes = _draw_scenes(rng, options, split)
        frames = np.stack(
            [render_frame(scenes[s], t, options.size, options.digit_size) for s, t in zip(scene, time)]
        )
        if revisit_is_nearest_to_a(frames, scene, revisit):
            break
    else:
        raise ValueError(f"clip {index}: no draw in {MAX_CLIP_TRIES} made the revisit nearest to A")
    return {
        "index": index,
        "frames": frames[:, None],
        "revisit": revisit,
        "scene": scene,
        "time": time,
        "scenes": scenes,
        "segments": options.segments(),
    }


def revisit_is_nearest_to_a(frames: np.ndarray, scene: np.ndarray, revisit: np.ndarray) -> bool:
    """Whether every revisit frame is strictly nearer (mean squared error) to some frame of the first A
    segment than to every frame of another scene."""
    frames = frames.reshape(len(frames), -1)
    distance = ((frames[revisit][:, None] - frames[None]) ** 2).mean(axis=-1)
    first_a = (scene == 0) & ~revisit
    return bool((distance[:, first_a].min(axis=1) < distance[:, scene != 0].min(axis=1)).all())


def _draw_scenes(rng: np.random.Generator, options: ClipOptions, split: str) -> list[dict[str, Any]]:
    count = options.gap_scenes + 1
    pool, labels = digit_indices(split), _digits()[1]
    scenes = []
    for texture, label in zip(
        rng.choice(len(TEXTURES), count, replace=False), rng.choice(DIGIT_CLASSES, count, replace=False)
    ):
        name = TEXTURES[texture]
        digit = int(rng.choice(pool[labels[pool] == label]))
        span = options.size - options.digit_size
        scenes.append(
            {
                "texture": name,
                "offset": _crop_offset(rng, textures()[name], options.size, split),
                "digit_index": digit,
                "label": int(label),
                "start": [float(v) for v in rng.uniform(0, span, 2)],
                "velocity": [float(v) for v in rng.uniform(*SPEED_RANGE, 2) * rng.choice([-1, 1], 2)],
            }
        )
    return scenes


def make_clips(
    count: int,
    frames: int = 32,
    size: int = 16,
    gap: int = 16,
    seed: int = 0,
    split: str = "train",
    *,
    a_len: int = 8,
    gap_scenes: int = 2,
    digit_size: int | None = None,
    revisit_motion: str = "continue",
) -> list[dict[str, Any]]:
    """Clips ``0 .. count - 1`` of ``split`` (see ``make_clip``); a prefix of any longer ``make_clips``."""
    options = ClipOptions(frames, size, gap, a_len, gap_scenes, digit_size, revisit_motion)
    return [make_clip(index, options, seed, split) for index in range(count)]


def video_samples(
    counts: Mapping[str, int], options: ClipOptions, seed: int = 0
) -> dict[str, list[dict[str, Any]]]:
    """``counts[split]`` clips of each split as webdataset samples: ``npy`` frames, ``revisit.npy``,
    ``scene.npy``, and ``json`` with ``index``, ``time``, ``scenes`` and ``segments``."""
    return {
        split: [_sample(make_clip(index, options, seed, split)) for index in range(count)]
        for split, count in counts.items()
    }


def write_video_shards(
    out_dir: str | Path,
    train_count: int = 1024,
    heldout_count: int = 256,
    options: ClipOptions | None = None,
    seed: int = 0,
    samples_per_shard: int = 256,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write both splits as a shard set in ``out_dir`` (see ``hetero.data.shards``); return the manifest."""
    options = options or ClipOptions()
    counts = {"train": train_count, "heldout": heldout_count}
    meta = _meta(counts, options, seed, samples_per_shard)
    return write_shard_set(out_dir, video_samples(counts, options, seed), samples_per_shard, meta, overwrite)


def video_shards(root: str | Path, train_count: int, heldout_count: int, options: ClipOptions, seed: int) -> Path:
    """Where a job or a benchmark keeps the clips made with these arguments: one set per choice under
    ``root``, so that sets of other shapes, counts or seeds never meet in one directory."""
    o = options
    return Path(root) / (f"frames{o.frames}_size{o.size}_a{o.a_len}_gap{o.gap}x{o.gap_scenes}_digit{o.digit_size}_"
                         f"{o.revisit_motion}_n{train_count}-{heldout_count}_seed{seed}")


def ensure_video_shards(
    out_dir: str | Path,
    train_count: int = 1024,
    heldout_count: int = 256,
    options: ClipOptions | None = None,
    seed: int = 0,
    samples_per_shard: int = 256,
) -> dict[str, Any]:
    """The manifest of the clip shards in ``out_dir``, writing them first if no complete set is there;
    ``ShardError`` if the set there was made with other arguments.

    Safe when several processes call it at once: one rename wins and the others read its set.
    """
    options = options or ClipOptions()
    return ensure_shard_set(
        out_dir,
        lambda: write_video_shards(out_dir, train_count, heldout_count, options, seed, samples_per_shard),
        _meta({"train": train_count, "heldout": heldout_count}, options, seed, samples_per_shard),
    )


class VideoClips(SampleTable):
    """Batches of one split's clips, in a deterministic order that depends only on ``seed`` and the epoch.

    The split is read once into memory and served as a ``SampleTable``. A batch holds ``frames``
    (B, T, 1, S, S) float32, ``revisit`` (B, T) bool, ``scene`` (B, T) long and ``index`` (B,) long (the
    clip's index in its split).
    """

    def __init__(self, shard_dir: str | Path, split: str, batch_size: int, seed: int = 0):
        samples = read_split(shard_dir, split)
        super().__init__({
            "frames": torch.from_numpy(np.stack([s["npy"] for s in samples])),
            "revisit": torch.from_numpy(np.stack([s["revisit.npy"] for s in samples])),
            "scene": torch.from_numpy(np.stack([s["scene.npy"] for s in samples])).long(),
            "index": torch.tensor([s["json"]["index"] for s in samples]),
        }, split, batch_size, seed)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``video-clips`` under ``subparsers`` (e.g. of ``hetero data``); it runs via ``args.run(args)``."""
    return shard_command.register(subparsers, "video-clips", _CLI_HELP, _add_arguments, _run)


def main(argv: list[str] | None = None) -> int:
    """``python -m hetero.data.video_clips --out DIR``."""
    return shard_command.main("hetero data video-clips", _CLI_HELP, _add_arguments, _run, argv)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="directory of the shard set")
    parser.add_argument("--train-count", type=int, default=1024, help="clips in the train split")
    parser.add_argument("--heldout-count", type=int, default=256, help="clips in the heldout split")
    for field in dataclasses.fields(ClipOptions):
        if field.name == "revisit_motion":
            parser.add_argument("--revisit-motion", choices=("continue", "restart"), default=field.default)
        else:
            parser.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=field.default)
    parser.add_argument("--seed", type=int, default=0, help="the clips are a function of the seed")
    parser.add_argument("--samples-per-shard", type=int, default=256, help="clips in each tar shard")
    parser.add_argument("--overwrite", action="store_true", help="replace a shard set already in --out")


def _run(args: argparse.Namespace) -> None:
    try:
        fields = dataclasses.fields(ClipOptions)
        options = ClipOptions(**{field.name: getattr(args, field.name) for field in fields})
        common = (args.out, args.train_count, args.heldout_count, options, args.seed, args.samples_per_shard)
        if args.overwrite:
            manifest = write_video_shards(*common, overwrite=True)
        else:
            manifest = ensure_video_shards(*common)
    except (ValueError, FileExistsError, ShardError) as err:
        raise ConfigError(str(err)) from err
    for name, split in manifest["splits"].items():
        size = sum(shard["bytes"] for shard in split["shards"])
        shards = len(split["shards"])
        print(f"{args.out}: {name} {split['count']} clips in {shards} shards, {size / 1e6:.1f} MB")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}")


def _crop_offset(rng: np.random.Generator, texture: np.ndarray, size: int, split: str) -> list[int]:
    """A crop's top-left corner: in the texture's left half for train, its right half for heldout."""
    half = texture.shape[1] // 2
    x_low, x_high = (0, half - size) if split == "train" else (half, texture.shape[1] - size)
    for _ in range(MAX_CROP_TRIES):
        y, x = int(rng.integers(0, texture.shape[0] - size + 1)), int(rng.integers(x_low, x_high + 1))
        if texture[y : y + size, x : x + size].std() >= MIN_CROP_STD:
            return [y, x]
    raise ValueError(f"no {size}x{size} crop in {MAX_CROP_TRIES} tries has std >= {MIN_CROP_STD}")


def _sample(clip: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "__key__": f"{clip['index']:06d}",
        "npy": clip["frames"],
        "revisit.npy": clip["revisit"],
        "scene.npy": clip["scene"],
        "json": {
            "index": clip["index"],
            "time": clip["time"].tolist(),
            "scenes": clip["scenes"],
            "segments": clip["segments"],
        },
    }


def _meta(
    counts: Mapping[str, int], options: ClipOptions, seed: int, samples_per_shard: int
) -> dict[str, Any]:
    return {
        "dataset": "revisiting video clips: scikit-learn digits over scikit-image textures",
        "clip": "Tx1xSxS float32 in [0, 1]: scene A, a gap of other scenes, A again",
        "textures": list(TEXTURES),
        "heldout": "digits held out by hetero.data.digits; crops from the right half of each texture",
        **dataclasses.asdict(options),
        "counts": dict(counts),
        "seed": seed,
        "samples_per_shard": samples_per_shard,
    }


if __name__ == "__main__":
    sys.exit(main())
