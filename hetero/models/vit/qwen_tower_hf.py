"""Names of the Qwen2.5-VL and Qwen3-VL vision towers' weights in Hugging Face checkpoints (relative to the
tower's prefix, the same in the hub's and transformers 5's layouts), mapped to ``QwenVisionTower``'s. The
tensors keep their shapes, but for each block's fused ``attn.qkv``: hetero holds q, k and v apart (so that
TP splits each by heads), read as the fused tensor's thirds (``SplitQKV``) and joined again on export."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from hetero.errors import ConfigError
from hetero.interop.hf_checkpoint import HFExport, load_into
from hetero.models.vit.config import ViTConfig

_IN_BLOCK = {
    "norm1": "attention_norm", "norm2": "mlp_norm", "attn.q": "attention.q", "attn.k": "attention.k",
    "attn.v": "attention.v", "attn.proj": "attention.proj",
    "mlp.gate_proj": "mlp.gate", "mlp.up_proj": "mlp.up", "mlp.down_proj": "mlp.down",
    "mlp.linear_fc1": "mlp.up", "mlp.linear_fc2": "mlp.down",
}
_MERGER = {"ln_q": "norm", "mlp.0": "proj_in", "mlp.2": "proj_out", "norm": "norm", "linear_fc1": "proj_in",
           "linear_fc2": "proj_out"}
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_DEEPSTACK = re.compile(r"deepstack_merger_list\.(\d+)\.(.+)")
_FUSED_QKV = re.compile(r"(blocks\.\d+\.attn)\.qkv\.(weight|bias)")
_SPLIT_QKV = re.compile(r"(blocks\.\d+\.attn)\.([qkv])\.(weight|bias)")


def tower_name(hf_name: str, config: ViTConfig) -> str:
    """hetero's name of the tower weight ``hf_name`` (relative to the tower: ``blocks.3.attn.qkv.weight``)."""
    module, _, leaf = hf_name.rpartition(".")
    if module == "patch_embed.proj":
        return f"patch_embed.{leaf}"
    if hf_name == "pos_embed.weight":
        return "pos_embed"
    if (match := _BLOCK.fullmatch(module)) and match.group(2) in _IN_BLOCK:
        return f"layers.{match.group(1)}.{_IN_BLOCK[match.group(2)]}.{leaf}"
    if module.startswith("merger.") and module.removeprefix("merger.") in _MERGER:
        return f"merger.{_MERGER[module.removeprefix('merger.')]}.{leaf}"
    if (match := _DEEPSTACK.fullmatch(module)) and match.group(2) in _MERGER:
        tap = int(match.group(1))
        if tap < len(config.deepstack_layers):
            return f"deepstack.{config.deepstack_layers[tap]}.{_MERGER[match.group(2)]}.{leaf}"
    raise ConfigError(f"vision tower weight {hf_name!r} has no place in hetero's {config.tower} tower")


def split_qkv_names(names) -> dict[str, tuple[str, int]]:
    """Of the checkpoint's ``names``, each block's ``attn.q|k|v.weight|bias`` -> (the fused tensor's name,
    which third)."""
    split = {}
    for name in names:
        if match := _FUSED_QKV.fullmatch(name):
            for third, part in enumerate("qkv"):
                split[f"{match.group(1)}.{part}.{match.group(2)}"] = (name, third)
    return split


def fuse_qkv(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors with each block's ``attn.q|k|v`` joined into its fused ``attn.qkv`` (an
    export's ``HFExport.assemble``)."""
    out = {}
    for name, tensor in tensors.items():
        if not (match := _SPLIT_QKV.fullmatch(name)):
            out[name] = tensor
        elif match.group(2) == "q":
            block, leaf = match.group(1), match.group(3)
            out[f"{block}.qkv.{leaf}"] = torch.cat([tensors[f"{block}.{p}.{leaf}"] for p in "qkv"])
    return out


class SplitQKV:
    """A tower's checkpoint part (``QwenVLPart``) with each block's fused ``attn.qkv`` read as ``attn.q``,
    ``attn.k`` and ``attn.v``: its rows' thirds, a TP rank's slice of each read alone."""

    def __init__(self, part):
        self.part, self.path, self.config = part, part.path, part.config
        self.split = split_qkv_names(part.names())
        fused = {fused for fused, _ in self.split.values()}
        self.files = {name: None for name in part.names() if name not in fused} | dict.fromkeys(self.split)

    @property
    def bytes_read(self) -> int:
        return self.part.bytes_read

    def names(self) -> list[str]:
        return list(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.split:
            return tuple(self.part.shape(name))
        fused, _ = self.split[name]
        rows, *rest = self.part.shape(fused)
        return (rows // 3, *rest)

    def tensor(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        if name not in self.split:
            return self.part.tensor(name, index)
        fused, third = self.split[name]
        rows, *rest = self.shape(name)
        index = index or tuple(slice(None) for _ in range(1 + len(rest)))
        kept = range(rows)[index[0]]
        start = third * rows + kept.start
        return self.part.tensor(fused, (slice(start, start + len(kept)), *index[1:]))


def tower_state(hf_state: dict[str, torch.Tensor], config: ViTConfig) -> dict[str, torch.Tensor]:
    """A whole tower's state dict from the checkpoint's (names relative to the tower)."""
    state = dict(hf_state)
    for name, (fused, third) in split_qkv_names(hf_state).items():
        state[name] = hf_state[fused].chunk(3)[third]
    for fused, _ in split_qkv_names(hf_state).values():
        state.pop(fused, None)
    return {tower_name(name, config): tensor for name, tensor in state.items()}


ACTIVATIONS = {"qwen2.5-vl": "silu", "qwen3-vl": "gelu_pytorch_tanh"}
MODELLED = {"depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "in_chans", "patch_size",
            "temporal_patch_size", "spatial_merge_size", "out_hidden_size", "window_size", "fullatt_block_indexes",
            "hidden_act", "rope_parameters", "num_position_embeddings", "deepstack_visual_indexes"}
PASSED_OVER = {"tokens_per_second"}  # the data's: video positions (hetero.data.mrope_positions)
BOOKKEEPING = {"architectures", "model_type", "initializer_range", "transformers_version", "dtype", "torch_dtype",
               "_name_or_path", "output_hidden_states", "output_attentions", "return_dict", "id2label", "label2id",
               "chunk_size_feed_forward", "is_encoder_decoder", "problem_type"}
DEFAULT_MAX_PATCHES = 16384


def qwen_vit_config(vision: dict, fields: dict, module: str, path: Path | None = None) -> ViTConfig:
    """The vit config of a Qwen-VL's ``vision_config`` (``architectures`` naming the tower), at most
    ``fields["max_patches"]`` patches an image (default: the processor's ``max_pixels`` beside the weights,
    else 16384)."""
    where = f"{module}.init.hf config.json vision_config"
    tower = vision["architectures"][0]
    if extra := sorted(set(vision) - MODELLED - PASSED_OVER - BOOKKEEPING):
        raise ConfigError(f"{where}: hetero does not model the field(s) {', '.join(extra)}")
    if vision.get("hidden_act", ACTIVATIONS[tower]) != ACTIVATIONS[tower]:
        raise ConfigError(f"{where}: hidden_act={vision['hidden_act']!r} is not modelled; the {tower} tower's is "
                          f"{ACTIVATIONS[tower]}")
    rope = vision.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") not in ("axial", "default"):
        raise ConfigError(f"{where}: rope_type={rope['rope_type']!r} is not modelled (the towers' 2-D RoPE is axial)")
    patch, merge = vision.get("patch_size", 14), vision.get("spatial_merge_size", 2)
    qwen3 = tower == "qwen3-vl"
    return ViTConfig(
        tower=tower, hidden_size=vision["hidden_size"], num_layers=vision["depth"], num_heads=vision["num_heads"],
        ffn_hidden_size=vision["intermediate_size"], out_size=vision["out_hidden_size"],
        channels=vision.get("in_channels", vision.get("in_chans", 3)), patch_size=patch,
        temporal_patch=vision.get("temporal_patch_size", 2), merge=merge,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        window_size=0 if qwen3 else vision.get("window_size", 112),
        full_attention_blocks=[] if qwen3 else list(vision.get("fullatt_block_indexes", [])),
        position_grid=round(vision.get("num_position_embeddings", 0) ** 0.5) if qwen3 else 0,
        deepstack_layers=list(vision.get("deepstack_visual_indexes", [])) if qwen3 else [],
        max_patches=fields.get("max_patches") or _processor_patches(path, patch) or DEFAULT_MAX_PATCHES,
        class_token=False, projector=False, feature_norm=False,
    )


def _processor_patches(path: Path | None, patch: int) -> int | None:
    """The most patches the checkpoint's image processor makes of an image (its ``max_pixels``), if it has one."""
    processor = Path(path) / "preprocessor_config.json" if path is not None else None
    if processor is None or not processor.is_file():
        return None
    config = json.loads(processor.read_text())
    pixels = config.get("max_pixels") or (config.get("size") or {}).get("longest_edge")
    return int(pixels) // patch**2 if pixels else None


def check_tower_weights(part, config: ViTConfig, module: str) -> None:
    """Refuse a tower lacking a weight, holding one with no place, or one of another shape."""
    from hetero.models.vit.qwen_tower import QwenVisionTower

    where, part = f"{module}.init.hf ({part.path})", SplitQKV(part)
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in QwenVisionTower(config).state_dict().items()}
    have = {tower_name(name, config): name for name in part.names()}
    if missing := sorted(set(shapes) - set(have)):
        raise ConfigError(f"{where}: lacks the tower's weights {', '.join(missing[:4])}")
    for ours, theirs in have.items():
        if ours not in shapes:
            raise ConfigError(f"{where}: weight {theirs} has no place in the {config.tower} tower")
        if (stored := tuple(part.shape(theirs))) != shapes[ours]:
            raise ConfigError(f"{where}: {theirs} has shape {stored}, but its config.json gives {shapes[ours]}")


def load_tower(model, part) -> int:
    """Fill a Qwen tower (materialized) from its part of the checkpoint; the bytes read."""
    part = SplitQKV(part)
    names = {tower_name(name, model.config): name for name in part.names()}
    return load_into(model.state_dict(keep_vars=True), part, names.get)


def tower_export(config: ViTConfig, source) -> HFExport:
    """The tower's weights under their names in the whole Qwen-VL it was imported from (written back with
    the rest of it: ``hetero.interop.vlm_export``); a tower trained from scratch has no checkpoint form."""
    if source is None:
        raise ConfigError(f"a {config.tower} tower trained from scratch has no Hugging Face form; import one from a "
                          "whole Qwen-VL (init.hf) to write it back with its LLM (hetero convert --vlm)")
    from hetero.interop.parts import open_part

    part = open_part(source, "vision")
    names = {tower_name(name, config): name for name in SplitQKV(part).names()}
    return HFExport(part.config, names.get, part.raw, assemble=fuse_qkv)
