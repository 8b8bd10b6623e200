"""The part of a checkpoint a module reads: a whole LLaVA's or Qwen-VL's tower, projector or language model,
or a checkpoint of that module alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hetero.interop.hf_checkpoint import HFCheckpoint
from hetero.interop.llava import LlavaPart, is_llava
from hetero.interop.qwen_vl import QwenVLPart, is_qwen_vl


def open_part(source: str | Path | Any, part: str) -> Any:
    """The checkpoint at ``source`` (a path, or an opened ``HFCheckpoint``/``KeptSource``) as module
    ``part`` reads it: itself, or its ``part`` where it is a whole LLaVA or Qwen-VL."""
    checkpoint = source if hasattr(source, "names") else HFCheckpoint(source)
    if is_llava(checkpoint.config):
        return LlavaPart(checkpoint, part)
    if is_qwen_vl(checkpoint.config):
        return QwenVLPart(checkpoint, part)
    return checkpoint
