"""``hetero tiny-llava OUT``: a tiny random ``LlavaForConditionalGeneration`` directory, built offline with
``transformers``, to try the LLaVA recipe on (``init.hf: OUT`` for the vision, projector and llm
modules) and to test the import and export against.

Two pairs: ``clip-llama`` (a CLIP tower with a class token, features of its second-to-last block
without the class token: ``default``) and ``siglip-qwen2`` (a SigLIP tower, its last block's features,
``full``; Qwen2 with q/k/v biases and tied embeddings). Both come with a byte-level BPE tokenizer
trained on the example dataset's words and a few standard-library docstrings, an ``<image>`` token, a
ChatML chat template, the tower's image processor and a ``LlavaProcessor`` config. Every weight is
drawn from the seed (norms off 1, biases off 0).
"""

from __future__ import annotations

import argparse
from pathlib import Path

PAIRS = ("clip-llama", "siglip-qwen2")
IMAGE_TOKEN = "<image>"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", IMAGE_TOKEN]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
IMAGE_SIZE, PATCH = 32, 8


def write_tiny_llava(out: str | Path, pair: str = "clip-llama", seed: int = 0) -> Path:
    """Write the tiny LLaVA of ``pair`` to directory ``out``; the directory."""
    import torch
    import transformers

    if pair not in PAIRS:
        raise ValueError(f"pair={pair!r} is not one of {', '.join(PAIRS)}")
    out = Path(out)
    tokenizer = tiny_tokenizer(SPECIALS, IMAGE_TOKEN, CHAT_TEMPLATE)
    vocab, image_token = len(tokenizer), tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text = dict(vocab_size=vocab, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
                bos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, image_size=IMAGE_SIZE,
                  patch_size=PATCH)
    if pair == "clip-llama":
        config = transformers.LlavaConfig(
            vision_config=transformers.CLIPVisionConfig(num_hidden_layers=3, projection_dim=32, **vision),
            text_config=transformers.LlamaConfig(**text), image_token_index=image_token, vision_feature_layer=-2,
            vision_feature_select_strategy="default", image_seq_length=(IMAGE_SIZE // PATCH) ** 2)
        images = transformers.CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                                 crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
        additional = 1  # the class token, which "default" then drops
    else:
        config = transformers.LlavaConfig(
            vision_config=transformers.SiglipVisionConfig(num_hidden_layers=2, **vision),
            text_config=transformers.Qwen2Config(tie_word_embeddings=True, **text), image_token_index=image_token,
            vision_feature_layer=-1, vision_feature_select_strategy="full", tie_word_embeddings=True,
            image_seq_length=(IMAGE_SIZE // PATCH) ** 2)
        images = transformers.SiglipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
        additional = 0
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    processor = transformers.LlavaProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=PATCH, chat_template=CHAT_TEMPLATE,
        vision_feature_select_strategy=config.vision_feature_select_strategy, image_token=IMAGE_TOKEN,
        num_additional_image_tokens=additional)
    processor.save_pretrained(out)
    return out


def tiny_tokenizer(specials: list[str], image_token: str, chat_template: str):
    """A byte-level BPE of 512 tokens, trained on the example dataset's words and a few standard-library
    docstrings (no download), with ``specials`` (``<|im_end|>`` its eos, ``<|endoftext|>`` its padding,
    ``image_token`` its image token) and ``chat_template``."""
    import argparse as argparse_module
    import collections
    import json
    import textwrap

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from hetero.data.example import PHOTOS, SYSTEM, WORDS

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [m.__doc__ for m in (argparse_module, collections, json, textwrap)]
    texts += list(PHOTOS.values()) + list(WORDS) + [SYSTEM]
    bpe.train_from_iterator(texts, trainer)
    bpe.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        extra_special_tokens={"image_token": image_token})
    tokenizer.chat_template = chat_template
    return tokenizer


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("tiny-llava", help="write a tiny random LLaVA checkpoint (built offline) to start "
                                 "the LLaVA recipe from with init.hf")
    parser.add_argument("out", type=Path, help="directory to write into")
    parser.add_argument("--pair", choices=PAIRS, default="clip-llama", help="vision tower and LM")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> None:
    path = write_tiny_llava(args.out, args.pair, args.seed)
    print(f"wrote a tiny {args.pair} LLaVA to {path}: start from it with vision.init.hf, projector.init.hf and "
          f"llm.init.hf={path}")
