"""``format: webdataset``: image-caption pairs in WebDataset tar shards (LAION, CC3M, DataComp style).

A sample is the tar members that share a key (the member name up to its first dot): an image (``jpg``,
``jpeg``, ``png`` or ``webp``) and a caption (``txt``, or ``json`` with a ``caption`` or ``text``
field). It becomes a conversation of two turns: the user's ``train.data.caption_prompt`` (holding the
``<image>`` marker) and the caption as the assistant's answer, as in LLaVA's stage-1 alignment.

``path`` is a brace-expanded shard list (``shards/shard-{000000..000099}.tar``), a directory of
``*.tar`` files or a glob. The shards are indexed from their tar headers (member offsets and sizes) once
per process; a sample's bytes are read from its offsets. A truncated tar keeps the samples before the
cut; the one it broke is a bad sample naming the shard.
"""

from __future__ import annotations

import glob
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from webdataset.shardlists import expand_urls

from hetero.data.chat import IMAGE_MARKER, Turn
from hetero.data.config import SourceConfig
from hetero.data.samples import ImageRef, Sample, SampleError, SampleInfo
from hetero.data.sources.sample_format import SampleFormat
from hetero.errors import ConfigError

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
CAPTION_EXTENSIONS = ("txt", "json")


def shard_files(path: str) -> list[Path]:
    """The shards ``path`` names: braces expanded, a directory's ``*.tar``, or a glob; in order."""
    if Path(path).is_dir():
        files = sorted(Path(path).glob("*.tar"))
    elif any(c in path for c in "*?["):
        files = [Path(p) for p in sorted(glob.glob(path))]
    else:
        files = [Path(p) for p in expand_urls(path)]
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise ConfigError(f"train.data.path={path}: " + (f"no shard {missing[0]} ({len(missing)} of {len(files)} "
                                                         f"missing)" if missing else "names no tar shards"))
    return files


@dataclass
class Entry:
    """A sample's members in its shard: extension -> (offset of the data, size)."""

    shard: Path
    key: str
    members: dict[str, tuple[int, int]] = field(default_factory=dict)
    broken: str = ""  # what a truncated shard did to it


def index_shard(shard: Path) -> list[Entry]:
    entries: dict[str, Entry] = {}
    try:
        with tarfile.open(shard, "r:") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                name = Path(member.name)
                key = str(name.parent / name.name.split(".", 1)[0])
                extension = name.name.split(".", 1)[1].lower() if "." in name.name else ""
                entries.setdefault(key, Entry(shard, key)).members[extension] = (member.offset_data, member.size)
        size = shard.stat().st_size
        for entry in entries.values():  # tarfile stops quietly at a cut inside a member's data
            for extension, (offset, length) in entry.members.items():
                if offset + length > size:
                    entry.broken = f"shard {shard} is truncated inside member {entry.key}.{extension}"
    except tarfile.TarError as err:  # the sample being read when the shard broke stands for what was lost
        last = entries.pop(list(entries)[-1]).key if entries else "its first sample"
        return list(entries.values()) + [Entry(shard, last, broken=f"shard {shard} is truncated or corrupt at "
                                                                   f"{last} ({err})")]
    return list(entries.values())


class ImageCaptions:
    def __init__(self, path: str, prompt: str):
        if prompt.count(IMAGE_MARKER) != 1:
            raise ConfigError(f"train.data.caption_prompt={prompt!r} must hold one {IMAGE_MARKER} marker")
        self.name, self.prompt = path, prompt
        self.shards = shard_files(path)
        self.entries = [entry for shard in self.shards for entry in index_shard(shard)]

    def __len__(self) -> int:
        return len(self.entries)

    def files(self) -> list[Path]:
        return self.shards

    def _read(self, entry: Entry, extension: str) -> bytes:
        offset, size = entry.members[extension]
        with entry.shard.open("rb") as f:
            f.seek(offset)
            return f.read(size)

    def sample(self, index: int) -> Sample:
        entry = self.entries[index]
        where = f"{entry.shard} sample {entry.key}"
        if entry.broken:
            raise SampleError(f"{where}: {entry.broken}")
        image = next((e for e in IMAGE_EXTENSIONS if e in entry.members), None)
        text = next((e for e in CAPTION_EXTENSIONS if e in entry.members), None)
        if image is None or text is None:
            raise SampleError(f"{where}: members {', '.join(sorted(entry.members))}; a sample needs an image "
                              f"({'/'.join(IMAGE_EXTENSIONS)}) and a caption ({'/'.join(CAPTION_EXTENSIONS)})")
        raw = self._read(entry, text)
        try:
            caption = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise SampleError(f"{where}: the caption {entry.key}.{text} is not UTF-8 ({err.reason} at byte "
                              f"{err.start})") from None
        if text == "json":
            try:
                fields = json.loads(caption)
                caption = fields.get("caption", fields.get("text")) if isinstance(fields, dict) else None
            except json.JSONDecodeError:
                caption = None
            if not isinstance(caption, str):
                raise SampleError(f"{where}: {entry.key}.json has no caption or text field")
        member = f"{entry.key}.{image}"
        turns = [Turn("user", self.prompt), Turn("assistant", caption.strip())]
        return Sample(entry.key, where, turns, [ImageRef(member, entry.shard, span=entry.members[image])])

    def describe(self, index: int) -> SampleInfo:
        entry = self.entries[index]
        return SampleInfo(entry.members.get("txt", (0, 0))[1], int(any(e in entry.members for e in IMAGE_EXTENSIONS)))


class ImageTextFormat(SampleFormat):
    name = "webdataset"

    def source(self, experiment, config: SourceConfig, path: str) -> ImageCaptions:
        return ImageCaptions(path, experiment.train.data.caption_prompt)
