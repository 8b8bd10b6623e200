"""A whole LLaVA's projector (``multi_modal_projector``: linear_1, GELU, linear_2) as a hetero projector
and back. It has no Hugging Face form of its own: it comes from and goes into a whole LLaVA
(``hetero.interop.llava``)."""

from __future__ import annotations

from pathlib import Path

from hetero.errors import ConfigError
from hetero.interop.hf_checkpoint import HFExport, load_into
from hetero.models.projector.config import ProjectorConfig

NAMES = {"proj_in.weight": "linear_1.weight", "proj_in.bias": "linear_1.bias",
         "proj_out.weight": "linear_2.weight", "proj_out.bias": "linear_2.bias"}


def projector_config(part, fields: dict, module: str = "projector") -> ProjectorConfig:
    """The projector of ``part`` (a ``LlavaPart``), handing on one token per tower feature."""
    from hetero.interop.llava import LlavaPart, class_feature

    if not isinstance(part, LlavaPart):
        raise ConfigError(f"{module}.init.hf: {part.path} is not a whole LLaVA checkpoint; a projector imports "
                          "only from one (LlavaForConditionalGeneration)")
    if missing := sorted(set(NAMES.values()) - set(part.names())):
        raise ConfigError(f"{module}.init.hf ({part.path}): lacks projector weights {', '.join(missing)}")
    (out_size, in_size), vision = part.shape("linear_1.weight"), part.llava["vision_config"]
    if part.shape("linear_2.weight") != (out_size, out_size):
        raise ConfigError(f"{module}.init.hf ({part.path}): linear_2.weight has shape {part.shape('linear_2.weight')}; "
                          f"hetero's projector takes ({out_size}, {out_size})")
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    return ProjectorConfig(in_size=in_size, out_size=out_size, tokens=patches + int(class_feature(part.llava)),
                           items=fields.get("items", False))


def load_projector(model, path: str | Path) -> int:
    from hetero.interop.parts import open_part

    return load_into(model.state_dict(keep_vars=True), open_part(path, "projector"), NAMES.get)


def projector_export(source) -> HFExport:
    """Names only (no config: the projector is written within a whole LLaVA); of one imported from
    ``source``, each weight's name there."""
    from hetero.interop.parts import open_part

    raw = getattr(open_part(source, "projector"), "raw", None) if source is not None else None
    return HFExport({}, NAMES.get, raw or (lambda name: name))
