"""Names of the Qwen2.5-VL and Qwen3-VL vision towers' weights in Hugging Face checkpoints (transformers 5
spelling, under the tower's own prefix), mapped to ``QwenVisionTower``'s, and the one weight whose shape
changes: the Conv3d patch embedding, a linear map of the flattened patch here."""

from __future__ import annotations

import re

import torch

from hetero.errors import ConfigError
from hetero.models.vit.config import ViTConfig

_IN_BLOCK = {
    "norm1": "attention_norm", "norm2": "mlp_norm", "attn.qkv": "attention.qkv", "attn.proj": "attention.proj",
    "mlp.gate_proj": "mlp.gate", "mlp.up_proj": "mlp.up", "mlp.down_proj": "mlp.down",
    "mlp.linear_fc1": "mlp.up", "mlp.linear_fc2": "mlp.down",
}
_MERGER = {"ln_q": "norm", "mlp.0": "proj_in", "mlp.2": "proj_out", "norm": "norm", "linear_fc1": "proj_in",
           "linear_fc2": "proj_out"}
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_DEEPSTACK = re.compile(r"deepstack_merger_list\.(\d+)\.(.+)")


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


def tower_tensor(hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The checkpoint's tensor as the tower holds it: the Conv3d kernel flattened per output channel."""
    return tensor.flatten(1) if hf_name == "patch_embed.proj.weight" else tensor


def tower_state(hf_state: dict[str, torch.Tensor], config: ViTConfig) -> dict[str, torch.Tensor]:
    """A whole tower's state dict from the checkpoint's (names relative to the tower)."""
    return {tower_name(name, config): tower_tensor(name, tensor) for name, tensor in hf_state.items()}
