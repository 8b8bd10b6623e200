"""Data with one bad sample of each kind a user's files hold, for the tests and ``scripts/bad_samples.py``.

Each case is a small dataset of good samples (written by ``hetero.data.example``) with one sample
broken: a missing image file, corrupt image bytes, more ``<image>`` markers than images, an unknown
role, an empty conversation (LLaVA JSON); a caption that is not UTF-8 and a truncated tar (WebDataset).
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

from hetero.data.example import write_llava, write_webdataset

GOOD_SAMPLES = 120


@dataclass(frozen=True)
class Case:
    name: str
    format: str
    path: Path


def _llava_case(root: Path, name: str, breaks) -> Case:
    out = root / name
    path = write_llava(out, GOOD_SAMPLES, seed=0)
    records = json.loads(path.read_text())
    breaks(out, records[0])
    path.write_text(json.dumps(records))
    return Case(name, "llava", path)


def _missing_image(out: Path, record: dict) -> None:
    record.update(image="images/not_there.png", conversations=[
        {"from": "human", "value": "<image>\nWhat digit is this?"}, {"from": "gpt", "value": "It is a 1."}])


def _corrupt_image(out: Path, record: dict) -> None:
    (out / "images" / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    record.update(image="images/corrupt.png", conversations=[
        {"from": "human", "value": "<image>\nWhat digit is this?"}, {"from": "gpt", "value": "It is a 1."}])


def _extra_marker(out: Path, record: dict) -> None:
    record["conversations"][-2]["value"] += " <image>"
    record.setdefault("image", [])


def _unknown_role(out: Path, record: dict) -> None:
    record["conversations"][-1]["from"] = "robot"


def _empty(out: Path, record: dict) -> None:
    record.pop("image", None)
    record["conversations"] = []


def _shards(root: Path, name: str) -> Path:
    out = root / name
    write_webdataset(out, GOOD_SAMPLES, seed=0, per_shard=GOOD_SAMPLES // 2)
    return out


def _not_utf8(root: Path) -> Case:
    out = _shards(root, "caption not UTF-8")
    shard = out / "shard-000000.tar"
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(shard, "w") as tar:
        for k, (member, data) in enumerate(members):
            if k == 1:  # the first caption
                data = "caf\u00e9 au lait".encode("latin-1")
                member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    return Case("caption not UTF-8", "webdataset", out)


def _truncated(root: Path) -> Case:
    out = _shards(root, "truncated tar")
    shard = out / "shard-000001.tar"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    return Case("truncated tar", "webdataset", out)


def write_cases(root: Path) -> list[Case]:
    root.mkdir(parents=True, exist_ok=True)
    for child in root.iterdir():
        shutil.rmtree(child)
    return [_llava_case(root, "missing image file", _missing_image), _llava_case(root, "corrupt image bytes", _corrupt_image),
            _llava_case(root, "markers differ from images", _extra_marker), _llava_case(root, "unknown role", _unknown_role),
            _llava_case(root, "empty conversation", _empty), _not_utf8(root), _truncated(root)]
