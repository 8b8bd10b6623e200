"""Hugging Face SigLIP and CLIP vision towers as hetero ViTs and back: the config mapped field by field,
the weights renamed.

Architectures: ``SiglipVisionModel`` and ``CLIPVisionModel``, and the vision tower of ``SiglipModel`` and
``CLIPModel`` (its ``vision_config``, its weights under ``vision_model.``; the text tower is passed over).
SigLIP has no class token and a LayerNorm of the last block's output (``post_layernorm``, hetero's
``feature_norm``); CLIP has a class token, a LayerNorm before the blocks and no patch bias. Both have a
key bias, and their activation and LayerNorm eps carry over. The features are per patch, as a LLaVA-style
VLM takes them: the block ``feature_layer`` (``model.feature_layer``, set by the YAML as ``items`` is; -1:
the last, HF's ``last_hidden_state`` for SigLIP), class token dropped. The projector is a module of its own
(kind ``projector``).

Passed over, by name (``PASSED_OVER``): what only the pooled image embedding uses (SigLIP's attention-pool
``head``, CLIP's ``post_layernorm`` of the class token, ``projection_dim``, ``vision_use_head``) and the
blocks after the feature layer. An export of an imported tower copies them back from its source.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from hetero.errors import ConfigError
from hetero.interop.hf_checkpoint import HFCheckpoint, HFExport, load_into, renamed
from hetero.models.vit.config import ViTConfig
from hetero.models.vit.model import VisionEncoder

VISION_MODELS = {"SiglipVisionModel": "siglip", "CLIPVisionModel": "clip"}
WITH_TEXT = {"SiglipModel": "siglip", "CLIPModel": "clip"}  # a vision tower beside a text tower
MODEL_TYPES = {"siglip": "siglip_vision_model", "clip": "clip_vision_model"}
PREFIX = "vision_model."

BOOKKEEPING = {
    "architectures", "model_type", "transformers_version", "_name_or_path", "dtype", "torch_dtype",
    "initializer_range", "initializer_factor", "output_hidden_states", "output_attentions", "return_dict",
    "chunk_size_feed_forward", "id2label", "label2id", "problem_type", "is_encoder_decoder",
}
PASSED_OVER = {"projection_dim", "vision_use_head"}  # the pooled embedding's
MODELLED = {
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels", "image_size",
    "patch_size", "hidden_act", "layer_norm_eps", "attention_dropout",
}
ACTIVATIONS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "quick_gelu": "quick_gelu"}


def tower(hf: dict, module: str = "vision") -> tuple[str, dict]:
    """The family (siglip, clip) and the vision config of HF config ``hf``."""
    where = f"{module}.init.hf config.json"
    architectures = hf.get("architectures") or []
    known = VISION_MODELS | WITH_TEXT
    if len(architectures) != 1 or architectures[0] not in known:
        raise ConfigError(f"{where}: architectures={architectures} is not one hetero imports as a vision tower; "
                          f"it imports {', '.join(known)}")
    architecture = architectures[0]
    return known[architecture], hf["vision_config"] if architecture in WITH_TEXT else hf


def vit_config(hf: dict, fields: dict, module: str = "vision", llava: dict | None = None) -> ViTConfig:
    """The ViT config of HF config ``hf``, features taken at ``fields["feature_layer"]`` (default -1); of
    the tower of a whole LLaVA (its config ``llava``), at its ``vision_feature_layer``, without a final
    LayerNorm, and with the class token under the ``full`` strategy (``hetero.interop.llava``)."""
    where = f"{module}.init.hf config.json"
    family, vision = tower(hf, module)
    if extra := sorted(set(vision) - MODELLED - BOOKKEEPING - PASSED_OVER):
        raise ConfigError(f"{where}: hetero does not model the vision field(s) {', '.join(extra)}; "
                          "import a checkpoint without them")
    act = vision.get("hidden_act", "gelu_pytorch_tanh" if family == "siglip" else "quick_gelu")
    if act not in ACTIVATIONS:
        raise ConfigError(f"{where}: hidden_act={act!r} is not modelled; hetero models {', '.join(ACTIVATIONS)}")
    if vision.get("attention_dropout", 0.0):
        raise ConfigError(f"{where}: attention_dropout={vision['attention_dropout']!r} is not modelled "
                          "(hetero's attention has no dropout)")
    layers = vision["num_hidden_layers"]
    feature_layer = fields.get("feature_layer", -1)
    feature_norm = family == "siglip" and feature_layer % layers == layers - 1
    if llava is not None:
        from hetero.interop.llava import class_feature, feature_layer as llava_layer

        feature_layer, feature_norm = llava_layer(llava, where), False
    hidden = vision["hidden_size"]
    return ViTConfig(
        image_size=vision["image_size"], patch_size=vision["patch_size"], channels=vision.get("num_channels", 3),
        hidden_size=hidden, num_layers=layers, num_heads=vision["num_attention_heads"],
        ffn_hidden_size=vision["intermediate_size"], feature_layer=feature_layer, out_size=hidden,
        class_token=family == "clip", patch_bias=family == "siglip", key_bias=True, pre_norm=family == "clip",
        activation=ACTIVATIONS[act], norm_eps=vision.get("layer_norm_eps", 1e-6 if family == "siglip" else 1e-5),
        feature_norm=feature_norm, projector=False, items=fields.get("items", False),
        class_feature=llava is not None and class_feature(llava),
    )


_IN_LAYER = {
    "attention_norm": "layer_norm1", "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.out_proj", "mlp_norm": "layer_norm2",
    "mlp.w1": "mlp.fc1", "mlp.w2": "mlp.fc2",
}
_TOP = {"patch_embed": "embeddings.patch_embedding", "pre_norm": "pre_layrnorm", "feature_norm": "post_layernorm"}
_PARAMETERS = {"pos_embed": "embeddings.position_embedding.weight", "cls_token": "embeddings.class_embedding"}


def hf_name(name: str) -> str:
    """HF's name (within the tower) of hetero ViT weight ``name``."""
    if name in _PARAMETERS:
        return _PARAMETERS[name]
    if (hf := renamed(name, "encoder.layers", _IN_LAYER, _TOP)) is not None:
        return hf
    raise ConfigError(f"ViT weight {name!r} has no place in a Hugging Face vision tower (a projector is a module "
                      "of its own: set projector: false)")


_LAYER = re.compile(r"encoder\.layers\.(\d+)\..+")


def passed_over(name: str, config: ViTConfig) -> bool:
    """Whether tower weight ``name`` (without the prefix) is one the ViT of ``config`` does not use."""
    if match := _LAYER.fullmatch(name):
        return int(match.group(1)) >= config.used_layers
    return name.startswith("head.") or (name.startswith("post_layernorm.") and not config.feature_norm)


def prefix_of(checkpoint: HFCheckpoint) -> str:
    """Where the tower's weights sit: under ``vision_model.`` (a model with a text tower, or saved by
    transformers 4) or at the top."""
    return PREFIX if any(name.startswith(PREFIX) for name in checkpoint.names()) else ""


def check_weights(checkpoint: HFCheckpoint, config: ViTConfig, module: str = "vision") -> None:
    """Refuse a checkpoint whose tower holds a weight the ViT neither uses nor passes over, lacks one it
    needs, or holds one in another shape than the config gives (read from the files' headers)."""
    where = f"{module}.init.hf ({checkpoint.path})"
    prefix = prefix_of(checkpoint)
    have = {name.removeprefix(prefix) for name in checkpoint.names() if name.startswith(prefix)}
    shapes = vit_shapes(config)
    need = {hf_name(name): shape for name, shape in shapes.items()}
    if extra := sorted(n for n in have - set(need) if not passed_over(n, config)):
        raise ConfigError(f"{where}: weights {', '.join(extra[:4])} have no place in this ViT")
    if missing := sorted(set(need) - have):
        raise ConfigError(f"{where}: lacks weights {', '.join(missing[:4])}")
    for name, shape in need.items():
        if (stored := checkpoint.shape(prefix + name)) != shape:
            raise ConfigError(f"{where}: {prefix + name} has shape {stored}, but its config.json gives {shape}")


def vit_shapes(config: ViTConfig) -> dict[str, tuple[int, ...]]:
    """Every weight of a ViT of ``config`` and its shape (built on the meta device: no memory)."""
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in VisionEncoder(config).state_dict().items()}


def load_vit(model, path: str | Path) -> int:
    """Fill ``model`` (a ViT, whole or parallelized and materialized) from the HF checkpoint at ``path``
    (a tower, or a whole LLaVA's), each rank reading only the slices it holds; the bytes read."""
    from hetero.interop.parts import open_part

    checkpoint = open_part(path, "vision")
    prefix = prefix_of(checkpoint)
    return load_into(model.state_dict(keep_vars=True), checkpoint, lambda name: prefix + hf_name(name))


def vit_export(config: ViTConfig, source: HFCheckpoint | None) -> HFExport:
    """A vision-model checkpoint (``SiglipVisionModel`` or ``CLIPVisionModel``) of a ViT: of an imported
    one, its source's tower config and passed-over weights; of one trained from scratch, a SigLIP tower
    of its blocks up to the feature layer, without a pooling head."""
    if config.projector:
        raise ConfigError("a ViT with its projector has no Hugging Face vision-tower form; set projector: false "
                          "and put the projector in a module of kind projector")
    if source is not None:
        from hetero.interop.parts import open_part

        part = open_part(source, "vision")  # a tower, or a whole LLaVA's
        raw = getattr(part, "raw", lambda name: name)  # the name in ``source``
        family, vision = tower(part.config)
        prefix = prefix_of(part)
        architecture = next(name for name, f in VISION_MODELS.items() if f == family)
        hf_config = vision | {"architectures": [architecture], "model_type": MODEL_TYPES[family]}
        carried = {name.removeprefix(prefix): raw(name) for name in part.names()
                   if name.startswith(prefix) and passed_over(name.removeprefix(prefix), config)}
        return HFExport(hf_config, hf_name, lambda name: raw(prefix + name), carried)
    siglip = (not config.class_token and config.patch_bias and config.key_bias and not config.pre_norm
              and config.feature_norm and config.used_layers == config.num_layers)
    if not siglip:
        raise ConfigError("only a ViT shaped as a SigLIP tower (class_token, pre_norm false; patch_bias, key_bias, "
                          "feature_norm true; feature_layer -1) exports without the checkpoint it was imported from")
    act = {ours: theirs for theirs, ours in ACTIVATIONS.items()}[config.activation]
    hf_config = {
        "architectures": ["SiglipVisionModel"], "model_type": MODEL_TYPES["siglip"], "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_channels": config.channels, "image_size": config.image_size,
        "patch_size": config.patch_size, "hidden_act": act, "layer_norm_eps": config.norm_eps,
        "attention_dropout": 0.0, "vision_use_head": False, "dtype": "float32",
    }
    return HFExport(hf_config, hf_name)
