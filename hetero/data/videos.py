"""Videos for a Qwen-VL tower: read (PyAV, or a list of frame images), frames sampled, resized and
normalized as the family's video processor does, and shaped into temporal patches.

``probe`` reads a video's header (frame count, rate, size) without decoding a frame; ``decode`` reads the
frames a ``VideoPipeline`` samples (``indices``) as uint8 RGB. The pipeline (``from_hf``: the checkpoint's
``video_preprocessor_config.json``, else the family's defaults) then follows transformers 5.x:

- Qwen2.5-VL (``Qwen2VLVideoProcessor``): every frame unless ``do_sample_frames``; each frame resized to
  the image rule (``smart_resize``) within the video's ``shortest_edge`` .. ``longest_edge``; its positions
  move ``tokens_per_second`` × seconds per temporal patch per temporal step (``time_step``).
- Qwen3-VL (``Qwen3VLVideoProcessor``): ``fps`` frames a second, ``min_frames`` .. ``max_frames``, spread
  evenly; the pixel budget covers all frames (``video_size``); each temporal patch is its own item in the
  text, after its timestamp (``stamps``: the mean time of its frames, ``<1.5 seconds>``).

Resizing is torchvision's on uint8 video tensors, which the processors call: bicubic with antialiasing in
float32, clamped to 0..255 and rounded back to uint8; rescale and normalize are fused, ``(x - 255·mean) /
(255·std)`` in float32. A frame count that is not a multiple of ``temporal_patch`` repeats the last frame.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from hetero.data.images import ImagePipeline, header_size, smart_resize
from hetero.data.samples import SampleError, VideoRef

FAMILIES = ("qwen2.5-vl", "qwen3-vl")
UNSTAMPED_FPS = 24.0  # what transformers assumes for a video without a frame rate


@dataclass(frozen=True)
class VideoLayout:
    """How a sampled video sits in a row: its sampled frames (``indices``), their size after resizing, its
    items in the text (each temporal patch after its stamp, or the whole video as one), the temporal
    patches of each item, and Qwen2.5-VL's temporal position step."""

    indices: tuple[int, ...]
    size: tuple[int, int]
    items: int
    item_patches: int
    stamps: tuple[str, ...]
    time_step: float


@dataclass(frozen=True)
class VideoHeader:
    """What a video's header says: its frames, their rate (None: unknown) and their size."""

    frames: int
    fps: float | None
    height: int
    width: int


def probe(ref: VideoRef, where: str) -> VideoHeader:
    """``ref``'s header, no frame decoded; ``SampleError`` naming ``where`` when it cannot be read."""
    if ref.frames:
        first = ref.frames[0]
        size = header_size(first.path if first.path is not None and first.span is None else first.read(where))
        if size is None:
            first.read(where)  # names a missing file
            raise SampleError(f"{where}: video {ref.name}'s frame {first.name} is not a readable image")
        return VideoHeader(len(ref.frames), ref.fps, size[1], size[0])
    import av  # late: only videos need it

    try:
        with av.open(os.fspath(ref.path)) as container:
            stream = container.streams.video[0]
            frames = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
            rate = float(stream.average_rate) if stream.average_rate else None
            return VideoHeader(int(frames), rate, stream.height, stream.width)
    except FileNotFoundError:
        raise SampleError(f"{where}: video {ref.name} not found at {ref.path}; fix the path or "
                          f"train.data.image_root") from None
    except (av.FFmpegError, IndexError) as err:
        raise SampleError(f"{where}: video {ref.name} is not a readable video ({err})") from None


def decode(ref: VideoRef, indices: list[int], where: str) -> torch.Tensor:
    """Frames ``indices`` (ascending, repeats allowed) of ``ref`` as (frames, 3, H, W) uint8 RGB."""
    wanted = sorted(set(indices))
    found: dict[int, np.ndarray] = {}
    if ref.frames:
        for k in wanted:
            image = ImagePipeline.decode(ref.frames[k].read(where), f"{where} video {ref.name} frame {k}")
            found[k] = np.asarray(image.convert("RGB"))
    else:
        import av

        try:
            with av.open(os.fspath(ref.path)) as container:
                for k, frame in enumerate(container.decode(video=0)):
                    if k in wanted:
                        found[k] = frame.to_ndarray(format="rgb24")
                    if k >= wanted[-1]:
                        break
        except (av.FFmpegError, OSError) as err:
            raise SampleError(f"{where}: video {ref.name} cannot be decoded ({err})") from None
    if len(found) != len(wanted):
        raise SampleError(f"{where}: video {ref.name} holds {len(found)} of the frames its header promised")
    shapes = {found[k].shape for k in wanted}
    if len(shapes) != 1:
        raise SampleError(f"{where}: video {ref.name}'s frames differ in size ({sorted(shapes)})")
    frames = np.stack([found[k] for k in indices])
    return torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()


def video_size(frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int,
               max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's size for a video's frames: each side a multiple of ``factor``, the pixels of every frame
    together within ``min_pixels`` .. ``max_pixels`` (frames rounded to whole temporal patches), a frame
    smaller than one block first scaled up to one."""
    if frames < temporal_factor:
        raise ValueError(f"a video of {frames} sampled frames is shorter than one temporal patch of "
                         f"{temporal_factor}; the Qwen3-VL processor refuses it")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"a video of {width}x{height} pixels is more than 200 times as long as it is wide; the "
                         f"Qwen-VL processor refuses it")
    rows, cols = round(height / factor) * factor, round(width / factor) * factor
    depth = round(frames / temporal_factor) * temporal_factor
    if depth * rows * cols > max_pixels:
        shrink = math.sqrt(frames * height * width / max_pixels)
        rows = max(factor, math.floor(height / shrink / factor) * factor)
        cols = max(factor, math.floor(width / shrink / factor) * factor)
    elif depth * rows * cols < min_pixels:
        grow = math.sqrt(min_pixels / (frames * height * width))
        rows, cols = math.ceil(height * grow / factor) * factor, math.ceil(width * grow / factor) * factor
    return rows, cols


# Each family's video processor defaults (transformers 5.x class attributes) for what its config leaves out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2.5-vl": {"size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}, "patch_size": 14,
                   "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
                   "do_sample_frames": False, "fps": None},
    "qwen3-vl": {"size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}, "patch_size": 16,
                 "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "do_sample_frames": True, "fps": 2},
}
_COMMON = {"temporal_patch_size": 2, "merge_size": 2, "min_frames": 4, "max_frames": 768, "resample": 3,
           "rescale_factor": 1 / 255, "do_resize": True, "do_rescale": True, "do_normalize": True,
           "do_convert_rgb": True}
_INERT = {"video_processor_type", "processor_class", "image_processor_type", "default_to_square", "data_format",
          "return_metadata", "video_metadata", "max_video_tokens", "num_frames", "max_image_size", "max_duration",
          "input_data_format", "device", "return_tensors", "do_center_crop", "crop_size", "min_pixels", "max_pixels"}


@dataclass(frozen=True)
class VideoPipeline:
    """How a family's video processor makes a video's pixels and its text (see the module docstring)."""

    stamped: bool  # Qwen3-VL: each temporal patch its own item after its timestamp
    patch_size: int
    merge: int
    temporal_patch: int
    min_pixels: int
    max_pixels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale: float
    sample: bool
    fps: float | None
    min_frames: int
    max_frames: int
    tokens_per_second: float = 1.0  # Qwen2.5-VL's temporal positions per second

    @classmethod
    def from_hf(cls, directory: str | os.PathLike | None, family: str, tokens_per_second: float = 1.0
                ) -> VideoPipeline:
        """The video processor of a checkpoint directory (``video_preprocessor_config.json``, or the
        ``video_processor`` of its ``processor_config.json``), else ``family``'s defaults. ValueError names
        a field hetero does not follow."""
        if family not in FAMILIES:
            raise ValueError(f"videos are read for {' and '.join(FAMILIES)} towers, not {family!r}")
        config, where = {}, f"{family}'s video processor"
        if directory is not None:
            path = Path(directory) / "video_preprocessor_config.json"
            if path.is_file():
                config, where = json.loads(path.read_text()), str(path)
            elif (Path(directory) / "processor_config.json").is_file():
                whole = json.loads((Path(directory) / "processor_config.json").read_text())
                config, where = whole.get("video_processor") or {}, str(Path(directory) / "processor_config.json")
        c = {**_COMMON, **_DEFAULTS[family], **{k: v for k, v in config.items() if v is not None}}
        for field, value in config.items():
            if field not in c and field not in _INERT and value not in (None, False):  # an option off is harmless
                raise ValueError(f"{where}: field {field!r} = {value!r} is not supported")
        if not (c["do_resize"] and c["do_rescale"] and c["do_normalize"]) or int(c["resample"]) != 3:
            raise ValueError(f"{where}: hetero reads videos resized (bicubic), rescaled and normalized")
        size = c["size"]
        return cls(stamped=family == "qwen3-vl", patch_size=int(c["patch_size"]), merge=int(c["merge_size"]),
                   temporal_patch=int(c["temporal_patch_size"]),
                   min_pixels=int(config.get("min_pixels") or size["shortest_edge"]),
                   max_pixels=int(config.get("max_pixels") or size["longest_edge"]),
                   mean=tuple(map(float, c["image_mean"])), std=tuple(map(float, c["image_std"])),
                   rescale=float(c["rescale_factor"]), sample=bool(c["do_sample_frames"]),
                   fps=None if c["fps"] is None else float(c["fps"]), min_frames=int(c["min_frames"]),
                   max_frames=int(c["max_frames"]), tokens_per_second=float(tokens_per_second))

    def indices(self, header: VideoHeader) -> list[int]:
        """The frames the processor samples, in order."""
        total = header.frames
        if not self.sample or self.fps is None:
            return list(range(total))
        rate = header.fps or UNSTAMPED_FPS
        if self.stamped:
            count = min(max(int(total / rate * self.fps), self.min_frames), self.max_frames, total)
            return np.linspace(0, total - 1, count).round().astype(int).tolist()
        tp = self.temporal_patch
        most = math.floor(min(self.max_frames, total) / tp) * tp
        count = math.floor(min(max(total / rate * self.fps, self.min_frames), most, total) / tp) * tp
        if count < 1:
            raise ValueError(f"a video of {total} frames holds no whole temporal patch of {tp} frames")
        return torch.arange(0, total, total / count).int().tolist()

    def size(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """(height, width) of each of ``frames`` sampled frames of a ``height`` × ``width`` video."""
        factor = self.patch_size * self.merge
        if self.stamped:
            return video_size(frames, height, width, self.temporal_patch, factor, self.min_pixels, self.max_pixels)
        return smart_resize(height, width, factor, self.min_pixels, self.max_pixels)

    def place(self, ref: VideoRef, where: str) -> VideoLayout:
        """``ref``'s layout from its header; ``SampleError`` naming ``where`` when it cannot be had."""
        header = probe(ref, where)
        try:
            return self.layout(header)
        except ValueError as err:
            raise SampleError(f"{where}: video {ref.name}: {err}") from None

    def layout(self, header: VideoHeader) -> VideoLayout:
        """Where ``header``'s video goes once sampled (``VideoLayout``)."""
        if header.frames < 1:
            raise ValueError("the video holds no frame")
        indices = self.indices(header)
        patches = -(-len(indices) // self.temporal_patch)
        size = self.size(len(indices), header.height, header.width)
        if self.stamped:
            return VideoLayout(tuple(indices), size, patches, 1, tuple(self.stamps(header)), 1.0)
        return VideoLayout(tuple(indices), size, 1, patches, (), self.time_step(header))

    def stamps(self, header: VideoHeader) -> list[str]:
        """Qwen3-VL's text before each temporal patch: the mean time of its first and last frame."""
        chosen = self.indices(header)
        chosen += [chosen[-1]] * (-len(chosen) % self.temporal_patch)
        rate = header.fps or UNSTAMPED_FPS
        times = [k / rate for k in chosen]
        return [f"<{(times[i] + times[i + self.temporal_patch - 1]) / 2:.1f} seconds>"
                for i in range(0, len(times), self.temporal_patch)]

    def time_step(self, header: VideoHeader) -> float:
        """Qwen2.5-VL's temporal position step: ``tokens_per_second`` × seconds per temporal patch."""
        rate = header.fps or UNSTAMPED_FPS
        sampled_rate = len(self.indices(header)) / header.frames * rate
        return self.tokens_per_second * self.temporal_patch / sampled_rate

    def __call__(self, frames: torch.Tensor) -> torch.Tensor:
        """(n, 3, H, W) uint8 frames as (n rounded up to whole temporal patches, 3, h, w) float32."""
        height, width = self.size(frames.shape[0], frames.shape[2], frames.shape[3])
        if (height, width) != tuple(frames.shape[2:]):
            resized = F.interpolate(frames.float(), size=(height, width), mode="bicubic", align_corners=False,
                                    antialias=True)
            frames = resized.clamp_(0, 255).round_().to(torch.uint8)
        mean = torch.tensor(self.mean, dtype=torch.float32, device=frames.device) * (1.0 / self.rescale)
        std = torch.tensor(self.std, dtype=torch.float32, device=frames.device) * (1.0 / self.rescale)
        x = (frames.float() - mean[:, None, None]) / std[:, None, None]
        if pad := -x.shape[0] % self.temporal_patch:
            x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
        return x

