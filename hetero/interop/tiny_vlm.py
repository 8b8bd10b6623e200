"""``hetero tiny-vlm OUT --family qwen2.5-vl|qwen3-vl``: a tiny random Qwen2.5-VL or Qwen3-VL directory,
built offline with ``transformers``, to start the Qwen-VL recipe from (``init.hf: OUT`` for the vision and
llm modules) and to test the import against.

Each comes with a byte-level BPE tokenizer (``hetero.interop.tiny_llava.tiny_tokenizer``) holding the
Qwen-VL special tokens, a ChatML chat template that writes an image item as
``<|vision_start|><|image_pad|><|vision_end|>`` (and a string content as it is), the family's image
processor (patch 14 and CLIP's mean and std for Qwen2.5-VL, patch 16 and 0.5 for Qwen3-VL, at most
``MAX_PIXELS``) and its video processor's config (``VIDEO_PROCESSORS``: small frames, so that a few seconds
of video fit a row of 256). No processor config: transformers' Qwen-VL processors need torchvision, whose
wheels here are CUDA builds that do not load beside the CPU torch (so the video processor's file is written
as JSON, not by its class). Every weight is drawn from the seed (norms off 1,
biases off 0).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FAMILIES = ("qwen2.5-vl", "qwen3-vl")
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", VISION_START, VISION_END, IMAGE_TOKEN, VIDEO_TOKEN]
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- else %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MAX_PIXELS = 28 * 28 * 64  # at most 64 merged tokens an image at patch 14
VIDEO_PROCESSORS = {
    "qwen2.5-vl": {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 14,
                   "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16},  # a frame: at most 16 tokens
                   "image_mean": [0.48145466, 0.4578275, 0.40821073],
                   "image_std": [0.26862954, 0.26130258, 0.27577711], "do_sample_frames": False},
    "qwen3-vl": {"video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 16,
                 "size": {"shortest_edge": 64 * 64, "longest_edge": 32 * 32 * 64},  # every frame together
                 "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "do_sample_frames": True, "fps": 2,
                 "min_frames": 4, "max_frames": 16},
}


def write_tiny_vlm(out: str | Path, family: str = "qwen2.5-vl", seed: int = 0) -> Path:
    """Write the tiny VLM of ``family`` to directory ``out``; the directory."""
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from hetero.interop.tiny_llava import tiny_tokenizer

    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is not one of {', '.join(FAMILIES)}")
    out = Path(out)
    tokenizer = tiny_tokenizer(SPECIALS, IMAGE_TOKEN, CHAT_TEMPLATE)
    ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(text) for name, text in
           (("image", IMAGE_TOKEN), ("video", VIDEO_TOKEN), ("vision_start", VISION_START), ("vision_end", VISION_END))}
    # the vocabulary padded to a multiple of 64, as Qwen's are (151,936 for 151,665 tokens): TP divides it
    text = dict(vocab_size=-(-len(tokenizer) // 64) * 64, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    vision = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                  temporal_patch_size=2, spatial_merge_size=2)
    torch.manual_seed(seed)
    if family == "qwen2.5-vl":
        config = transformers.Qwen2_5_VLConfig(
            vision_config=dict(vision, patch_size=14, window_size=56, fullatt_block_indexes=[1]),
            text_config=dict(text, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                    "mrope_section": [2, 3, 3]}), **ids)
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
        images = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=MAX_PIXELS)
    else:
        config = transformers.Qwen3VLConfig(
            vision_config=dict(vision, patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0, 1]),
            text_config=dict(text, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                                                 "mrope_section": [4, 2, 2], "mrope_interleaved": True}),
            **ids)
        model = transformers.Qwen3VLForConditionalGeneration(config)
        images = Qwen2VLImageProcessorPil(size={"shortest_edge": 64 * 64, "longest_edge": 32 * 32 * 64},
                                          patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    model.eval().save_pretrained(out)
    # each part on its own: the processor classes need torchvision for their video processor
    tokenizer.save_pretrained(out)
    images.save_pretrained(out)
    video = VIDEO_PROCESSORS[family] | {"temporal_patch_size": 2, "merge_size": 2}
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    return out


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("tiny-vlm", help="write a tiny random Qwen2.5-VL or Qwen3-VL checkpoint (built "
                                 "offline) to start from with init.hf")
    parser.add_argument("out", type=Path, help="directory to write into")
    parser.add_argument("--family", choices=FAMILIES, default="qwen2.5-vl")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> None:
    path = write_tiny_vlm(args.out, args.family, args.seed)
    print(f"wrote a tiny {args.family} to {path}: start from it with vision.init.hf and llm.init.hf={path}")
