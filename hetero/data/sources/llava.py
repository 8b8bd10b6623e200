"""``format: llava``: LLaVA-style conversations in JSON (a list of records) or JSONL (a record a line).

A record holds ``id``, ``image`` (one path, a list of paths, or absent for a text-only sample) and
``conversations``: turns ``{"from": "system" | "human" | "gpt", "value": ...}`` (``user`` and
``assistant`` are taken too), each image standing at an ``<image>`` marker; and ``video`` (a video file,
or a list of its frames' image files, at ``fps`` frames a second when the record gives it) standing at a
``<video>`` marker. Paths are relative to ``train.data.image_root`` (default: the JSON file's directory). ``path`` is a file or a directory of
``*.json`` and ``*.jsonl`` files, read in name order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hetero.data.chat import IMAGE_MARKER, Turn
from hetero.data.config import SourceConfig
from hetero.data.samples import ImageRef, Sample, SampleError, SampleInfo, VideoRef
from hetero.data.sources.sample_format import SampleFormat
from hetero.errors import ConfigError

ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


def data_files(path: str, suffixes: tuple[str, ...], field: str) -> list[Path]:
    """``path`` itself, or the files with ``suffixes`` in the directory ``path``, in name order."""
    root = Path(path)
    if root.is_file():
        return [root]
    if root.is_dir():
        files = sorted(p for p in root.iterdir() if p.suffix in suffixes)
        if files:
            return files
        raise ConfigError(f"{field}={path} is a directory without {' or '.join(suffixes)} files")
    raise ConfigError(f"{field}={path} does not exist")


class Conversations:
    """The records of LLaVA JSON/JSONL files, each with where it came from."""

    def __init__(self, path: str, image_root: str | None):
        self.name = path
        self.records: list[tuple[dict[str, Any] | None, str, Path]] = []  # (record or None if not an object, where, file)
        self.data_files = data_files(path, (".json", ".jsonl"), "train.data.path")
        for file in self.data_files:
            self.records += self._read(file)
        if not self.records:
            raise ConfigError(f"train.data.path={path} holds no conversations")
        self.image_root = Path(image_root) if image_root is not None else None

    @staticmethod
    def _read(file: Path) -> list[tuple[dict[str, Any] | None, str, Path]]:
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            line = file.read_bytes()[: err.start].count(b"\n") + 1
            raise ConfigError(f"{file} line {line} is not UTF-8 ({err.reason} at byte {err.start}); re-encode it") from None
        if file.suffix == ".jsonl":
            out = []
            for number, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ConfigError(f"{file} line {number} is not JSON ({err.msg}); fix or remove it") from None
                out.append((record if isinstance(record, dict) else None, f"{file} line {number}", file))
            return out
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{file} is not JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
        if not isinstance(records, list):
            raise ConfigError(f"{file} holds a JSON {type(records).__name__}; LLaVA data is a list of records "
                              f"(or JSONL, one record per line)")
        return [(r if isinstance(r, dict) else None, f"{file} sample {i}", file) for i, r in enumerate(records)]

    def __len__(self) -> int:
        return len(self.records)

    def files(self) -> list[Path]:
        """The JSON files and every image and video file they name that exists."""
        media = set()
        for index in range(len(self.records)):
            try:
                sample = self.sample(index)
            except SampleError:
                continue
            media.update(ref.path for ref in sample.images)
            for video in sample.videos:
                media.update([video.path] if video.path is not None else [frame.path for frame in video.frames])
        return self.data_files + sorted(p for p in media if p.is_file())

    def sample(self, index: int) -> Sample:
        record, where, file = self.records[index]
        if record is None:
            raise SampleError(f"{where}: a record is a JSON object with id, image and conversations")
        sample_id = str(record.get("id", index))
        where = f"{where} (id {sample_id})"
        images = record.get("image")
        paths = [] if images is None else [images] if isinstance(images, str) else images
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise SampleError(f"{where}: image is {images!r}; give a path, a list of paths, or leave it out")
        root = self.image_root or file.parent
        turns = []
        for k, turn in enumerate(record.get("conversations") or []):
            role = turn.get("from") if isinstance(turn, dict) else None
            if role not in ROLES:
                raise SampleError(f"{where}: turn {k} is from {role!r}; a turn is from one of {', '.join(ROLES)}")
            if not isinstance(turn.get("value"), str):
                raise SampleError(f"{where}: turn {k} has no text value")
            turns.append(Turn(ROLES[role], turn["value"]))
        return Sample(sample_id, where, turns, [ImageRef(p, root / p) for p in paths],
                      videos=self._videos(record, root, where))

    @staticmethod
    def _videos(record: dict[str, Any], root: Path, where: str) -> list[VideoRef]:
        video, fps = record.get("video"), record.get("fps")
        if video is None:
            return []
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or fps <= 0):
            raise SampleError(f"{where}: fps is {fps!r}; give the frames' rate as a positive number")
        if isinstance(video, str):
            return [VideoRef(video, root / video, fps=fps)]
        if isinstance(video, list) and video and all(isinstance(p, str) for p in video):
            return [VideoRef(video[0], frames=tuple(ImageRef(p, root / p) for p in video), fps=fps)]
        raise SampleError(f"{where}: video is {video!r}; give a video file or a list of its frames' image files")

    def describe(self, index: int) -> SampleInfo:
        record = self.records[index][0] or {}
        turns = [t for t in record.get("conversations") or [] if isinstance(t, dict)]
        text = sum(len(str(t.get("value", ""))) for t in turns)
        return SampleInfo(text, sum(str(t.get("value", "")).count(IMAGE_MARKER) for t in turns))


class LlavaFormat(SampleFormat):
    name = "llava"

    def source(self, experiment, config: SourceConfig, path: str) -> Conversations:
        return Conversations(path, config.image_root)
