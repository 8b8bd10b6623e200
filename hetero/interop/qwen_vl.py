"""A whole Qwen2.5-VL or Qwen3-VL Hugging Face checkpoint as the two modules of a vit → gpt graph: the
vision tower (a ``vit`` module with ``tower``, its ``vision_config``; ``hetero.models.vit.qwen_tower_hf``)
and the language model (a ``gpt`` with M-RoPE, its ``text_config``: Qwen2 for Qwen2.5-VL, Qwen3 for
Qwen3-VL, Qwen3-MoE for Qwen3-VL-MoE, whose hub files hold each layer's fused experts transposed:
``experts_transposed``). Each module names the same directory in its ``init.hf``. The weights are found by the tower's
patch embedding and the LM's token embedding wherever they sit: the hub's layout (``visual.``,
``model.``) and transformers 5's (``model.visual.``, ``model.language_model.``) both read.

Refused by name: any top-level field not modelled (``MODELLED``) and, through the modules' checks, what
their configs do not model.
"""

from __future__ import annotations

from typing import Any

from hetero.errors import ConfigError
from hetero.interop.vlm_part import VLMPart

ARCHITECTURES = {  # the VLM -> (the tower, the language model's architecture)
    "Qwen2_5_VLForConditionalGeneration": ("qwen2.5-vl", "Qwen2ForCausalLM"),
    "Qwen3VLForConditionalGeneration": ("qwen3-vl", "Qwen3ForCausalLM"),
    "Qwen3VLMoeForConditionalGeneration": ("qwen3-vl", "Qwen3MoeForCausalLM"),
}
MODELLED = {"vision_config", "text_config", "image_token_id", "video_token_id", "vision_start_token_id",
            "vision_end_token_id", "tie_word_embeddings"}
BOOKKEEPING = {"architectures", "model_type", "transformers_version", "_name_or_path", "dtype", "torch_dtype",
               "use_cache", "output_hidden_states", "output_attentions", "return_dict", "is_encoder_decoder",
               "pad_token_id", "bos_token_id", "eos_token_id", "initializer_range"}
ANCHORS = {"vision": "patch_embed.proj.weight", "text": "embed_tokens.weight"}
DEEPSTACK = "hetero_deepstack_layers"  # in a Qwen3-VL's LM config: the layers its tower's taps follow


def is_qwen_vl(config: dict) -> bool:
    return any(a in ARCHITECTURES for a in config.get("architectures") or [])


def family(config: dict) -> str:
    return next(ARCHITECTURES[a][0] for a in config["architectures"] if a in ARCHITECTURES)


def text_config(config: dict) -> dict:
    """The language model's config: ``text_config``, or, in configs saved before transformers 5, the
    top level's own fields (the vision tower's nested beside them)."""
    if "text_config" in config:
        return dict(config["text_config"])
    return {k: v for k, v in config.items() if k not in MODELLED - {"tie_word_embeddings"} | BOOKKEEPING}


MROPE_SECTIONS = {"qwen2.5-vl": [16, 24, 24], "qwen3-vl": [24, 20, 20]}  # transformers' defaults


def mrope(text: dict, tower: str) -> dict:
    """The language model's RoPE parameters with M-RoPE spelled out: its sections (transformers' default
    where the config names none) and whether they interleave, which the family decides (Qwen3-VL's always
    do, whatever its config says)."""
    params = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    params.setdefault("mrope_section", MROPE_SECTIONS[tower])
    params["mrope_interleaved"] = tower == "qwen3-vl"
    return params


class QwenVLPart(VLMPart):
    """The ``vision`` or ``text`` part of a whole Qwen2.5-VL or Qwen3-VL checkpoint (``VLMPart``)."""

    def __init__(self, whole: Any, part: str):
        self.vlm: dict = whole.config
        where = f"{whole.path}/config.json"
        if part not in ANCHORS:
            raise ConfigError(f"{where}: a Qwen-VL has a vision tower and a language model, no {part} part; its "
                              f"merger is the tower's own")
        if "text_config" in self.vlm and (extra := sorted(set(self.vlm) - MODELLED - BOOKKEEPING)):
            raise ConfigError(f"{where}: hetero does not model the Qwen-VL field(s) {', '.join(extra)}")
        tower, language_model = next(ARCHITECTURES[a] for a in self.vlm["architectures"] if a in ARCHITECTURES)
        if part == "vision":
            config = self.vlm["vision_config"] | {"architectures": [tower]}
        else:
            config = text_config(self.vlm)
            # the whole model's setting decides where it has one (Qwen3-VL-MoE's text_config says true, untied)
            config["tie_word_embeddings"] = self.vlm.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
            taps = len(self.vlm["vision_config"].get("deepstack_visual_indexes", [])) if tower == "qwen3-vl" else 0
            config |= {"architectures": [language_model], "rope_parameters": mrope(config, tower),
                       DEEPSTACK: list(range(taps))}  # Qwen3-VL adds tap k after layer k
            config.pop("rope_scaling", None)
            if language_model == "Qwen3MoeForCausalLM":  # Qwen3-VL-MoE's router renormalizes its top-k always
                config["norm_topk_prob"] = True
        super().__init__(whole, part, config, ANCHORS[part], "a whole Qwen-VL checkpoint")
        # Qwen3-VL-MoE's files as transformers 4 wrote them (the hub's): experts (E, hidden, 2·ffn), (E, ffn, hidden)
        written_by = int(str(self.vlm.get("transformers_version", "5")).split(".")[0])
        self.experts_transposed = language_model == "Qwen3MoeForCausalLM" and written_by < 5
