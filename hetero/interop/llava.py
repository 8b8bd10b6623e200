"""A whole-VLM Hugging Face checkpoint (``LlavaForConditionalGeneration``) as the three modules of a
vit → projector → gpt graph, and those three written back as one such directory.

Each module names the same directory in its ``init.hf`` and reads its part of it (``LlavaPart``): the
vision tower (CLIP or SigLIP, its ``vision_config``), the 2-layer projector (``multi_modal_projector``)
or the language model (Llama, Mistral, Qwen2 or Qwen3, its ``text_config``). A part looks like the
checkpoint of that module alone: the per-module import code reads it unchanged. The tower hands on
the hidden states of ``vision_feature_layer`` (no final LayerNorm, as LLaVA takes them), with the class
token under the ``full`` strategy and without it under ``default``. The LLM's tokenizer, chat template
and image token, and the tower's image processor, sit in the same directory.

Refused by name (``REFUSED``, each naming the piece hetero lacks): LLaVA-NeXT's anyres tiling,
LLaVA-OneVision, Qwen2-VL's tower, Gemma 3, PaliGemma, InternVL, Idefics3, SmolVLM, Llama 3.2
Vision and Llama 4; several feature layers at once, and any top-level field not modelled. Qwen2.5-VL and Qwen3-VL are
``hetero.interop.qwen_vl``'s.
"""

from __future__ import annotations

from pathlib import Path

from hetero.errors import ConfigError
from hetero.interop.hf_checkpoint import HFCheckpoint
from hetero.interop.vlm_part import VLMPart

ARCHITECTURE = "LlavaForConditionalGeneration"
REFUSED = {
    "LlavaNextForConditionalGeneration": "LLaVA-NeXT's anyres tiling (image_grid_pinpoints) is not modelled",
    "LlavaNextVideoForConditionalGeneration": "LLaVA-NeXT's anyres tiling and video pooling are not modelled",
    "LlavaOnevisionForConditionalGeneration": "LLaVA-OneVision's anyres tiling is not modelled",
    "Qwen2VLForConditionalGeneration": "Qwen2-VL's vision tower (LayerNorm, quick-GELU, no windows) is not modelled; "
                                       "Qwen2.5-VL and Qwen3-VL are (hetero.interop.qwen_vl)",
    "Gemma3ForConditionalGeneration": "Gemma 3 is not modelled: its projector average-pools the SigLIP patches to "
                                      "mm_tokens_per_image, and its LM interleaves sliding-window and global layers "
                                      "and attends bidirectionally within each image's tokens",
    "PaliGemmaForConditionalGeneration": "PaliGemma's prefix-LM attention (bidirectional over the image and the "
                                         "prompt) and its Gemma LM are not modelled",
    "InternVLForConditionalGeneration": "InternVL's pixel-shuffle projector (downsample_ratio) and dynamic tiling "
                                        "are not modelled",
    "Idefics3ForConditionalGeneration": "Idefics3's pixel-shuffle connector and image splitting are not modelled",
    "SmolVLMForConditionalGeneration": "SmolVLM's pixel-shuffle connector and image splitting are not modelled",
    "MllamaForConditionalGeneration": "Llama 3.2 Vision's cross-attention layers are not modelled (hetero places "
                                      "image tokens in the LM's sequence)",
    "Llama4ForConditionalGeneration": "Llama 4's MoE language model and pixel-shuffle projector are not modelled",
}
TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM"}
VISION_ARCHITECTURES = {"clip_vision_model": "CLIPVisionModel", "siglip_vision_model": "SiglipVisionModel"}
STRATEGIES = ("default", "full")
MODELLED = {
    "vision_config", "text_config", "image_token_index", "image_token_id", "projector_hidden_act",
    "vision_feature_select_strategy", "vision_feature_layer", "multimodal_projector_bias", "tie_word_embeddings",
    "image_seq_length",
}
BOOKKEEPING = {"architectures", "model_type", "transformers_version", "_name_or_path", "dtype", "torch_dtype",
               "ignore_index", "pad_token_id", "use_cache", "output_hidden_states", "output_attentions",
               "return_dict", "is_encoder_decoder"}
PARTS = ("vision", "projector", "text")
# the end of a name that marks where each part's weights sit
_ANCHORS = {"vision": "embeddings.patch_embedding.weight", "projector": "linear_1.weight", "text": "embed_tokens.weight"}


def is_llava(config: dict) -> bool:
    """Whether ``config`` (a ``config.json``) is a whole VLM's; refuses the VLMs hetero does not model."""
    architectures = config.get("architectures") or []
    for architecture in architectures:
        if architecture in REFUSED:
            raise ConfigError(f"{architecture}: {REFUSED[architecture]}; hetero imports {ARCHITECTURE} "
                              "(a CLIP or SigLIP tower, the 2-layer projector, a Llama-family or Qwen2 LM)")
    return ARCHITECTURE in architectures


def check_llava(config: dict, where: str) -> None:
    """Refuse the top-level fields and values hetero does not model."""
    if extra := sorted(set(config) - MODELLED - BOOKKEEPING):
        raise ConfigError(f"{where}: hetero does not model the LLaVA field(s) {', '.join(extra)}")
    layer = config.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ConfigError(f"{where}: vision_feature_layer={layer!r}: features of several layers concatenated are "
                          "not modelled; one layer is")
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in STRATEGIES:
        raise ConfigError(f"{where}: vision_feature_select_strategy={strategy!r} is not one of {', '.join(STRATEGIES)}")
    vision_type = config["vision_config"].get("model_type")
    if vision_type not in VISION_ARCHITECTURES:
        raise ConfigError(f"{where}: vision_config.model_type={vision_type!r} is not modelled; hetero imports "
                          f"{', '.join(VISION_ARCHITECTURES)}")
    if vision_type == "siglip_vision_model" and strategy == "default":
        raise ConfigError(f"{where}: vision_feature_select_strategy='default' drops the first token, which in a "
                          "SigLIP tower (no class token) is an image patch; hetero models 'full' for SigLIP")
    text_type = config["text_config"].get("model_type")
    if text_type not in TEXT_ARCHITECTURES:
        raise ConfigError(f"{where}: text_config.model_type={text_type!r} is not modelled; hetero imports "
                          f"{', '.join(TEXT_ARCHITECTURES)}")
    if config.get("projector_hidden_act", "gelu") != "gelu":
        raise ConfigError(f"{where}: projector_hidden_act={config['projector_hidden_act']!r} is not modelled "
                          "(hetero's projector is Linear-GELU-Linear)")
    if not config.get("multimodal_projector_bias", True):
        raise ConfigError(f"{where}: multimodal_projector_bias=false is not modelled (hetero's projector has biases)")


def image_token_id(config: dict) -> int:
    return config["image_token_index"] if "image_token_index" in config else config["image_token_id"]


def feature_layer(config: dict, where: str) -> int:
    """hetero's ``feature_layer`` (a block) of LLaVA's ``vision_feature_layer`` (an index into the tower's
    hidden states, the first of which is the embeddings, before any block)."""
    layer, blocks = config.get("vision_feature_layer", -2), config["vision_config"]["num_hidden_layers"]
    if not -blocks <= layer <= blocks or layer == 0:
        raise ConfigError(f"{where}: vision_feature_layer={layer} takes no block's output of a {blocks}-block tower")
    return layer if layer < 0 else layer - 1


def class_feature(config: dict) -> bool:
    """Whether the features keep the class token (``full`` on a CLIP tower)."""
    clip = config["vision_config"].get("model_type") == "clip_vision_model"
    return clip and config.get("vision_feature_select_strategy", "default") == "full"


class LlavaPart(VLMPart):
    """One part of a LLaVA checkpoint (``HFCheckpoint`` or ``KeptSource``): ``vision``, ``projector`` or
    ``text`` (``VLMPart``)."""

    def __init__(self, whole: HFCheckpoint, part: str):
        self.llava: dict = whole.config
        check_llava(self.llava, f"{whole.path}/config.json")
        if part == "vision":
            vision = self.llava["vision_config"]
            config = vision | {"architectures": [VISION_ARCHITECTURES[vision["model_type"]]]}
        elif part == "text":
            text = self.llava["text_config"]
            config = text | {"architectures": [TEXT_ARCHITECTURES[text["model_type"]]]}
        else:
            config = {}
        super().__init__(whole, part, config, _ANCHORS[part], "a whole LLaVA checkpoint")


def image_token_text(path: str | Path) -> str | None:
    """The image token of the whole LLaVA at ``path`` (None for any other checkpoint): the text its
    ``tokenizer.json`` gives the config's ``image_token_index``."""
    import json

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    if not is_llava(config) or not (path / "tokenizer.json").is_file():
        return None
    wanted = image_token_id(config)
    added = json.loads((path / "tokenizer.json").read_text()).get("added_tokens", [])
    text = next((token["content"] for token in added if token["id"] == wanted), None)
    if text is None:
        raise ConfigError(f"{path}: image_token_index={wanted} is not an added token of its tokenizer.json")
    return text
