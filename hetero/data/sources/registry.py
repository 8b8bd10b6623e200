"""Finding data formats by name: the built-in ones and every installed package's ``hetero.datasets``
entry point."""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from hetero.data.sources.builtin import BUILT_IN
from hetero.data.sources.format import DataFormat
from hetero.data.sources.image_text import ImageTextFormat
from hetero.data.sources.llava import LlavaFormat
from hetero.data.sources.text_jsonl import TextFormat
from hetero.errors import ConfigError

ENTRY_POINT_GROUP = "hetero.datasets"


def _instance(point: Any) -> DataFormat:
    fmt = point() if isinstance(point, type) else point
    if not isinstance(fmt, DataFormat) or not fmt.name:
        raise ConfigError(f"{point!r} (entry point group {ENTRY_POINT_GROUP}) is not a named hetero DataFormat")
    return fmt


def data_formats() -> dict[str, DataFormat]:
    """The built-in formats and every installed package's ``hetero.datasets`` entry point, by name."""
    formats = {fmt.name: fmt for fmt in (*BUILT_IN, LlavaFormat(), ImageTextFormat(), TextFormat())}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        fmt = _instance(point.load())
        if fmt.name in formats:
            raise ConfigError(f"the entry point {point.name} ({point.value}) registers a data format named "
                              f"{fmt.name!r}, which is taken; rename it")
        formats[fmt.name] = fmt
    return formats


def data_format(name: str) -> DataFormat:
    formats = data_formats()
    if name not in formats:
        raise ConfigError(f"train.data.format={name} is not a data format; choose one of {', '.join(formats)} "
                          f"(or register yours under the entry point group {ENTRY_POINT_GROUP})")
    return formats[name]
