"""Conversations become the token ids of the tokenizer's own chat template (a Qwen2-style one, built offline
here), with a loss on exactly each assistant content and its ``<|im_end|>`` and one run of image tokens per
``<image>``; without a template, byte tokens follow the documented plain rendering."""

import argparse
import collections
import json
import string
import textwrap
from collections.abc import Mapping

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hetero.data.chat import IMAGE_MARKER, ChatTokenizer, Turn

QWEN2_TEMPLATE = (
    "{%- if not messages or messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

MULTI_IMAGE = [
    Turn("system", "You describe pictures briefly."),
    Turn("user", f"Compare {IMAGE_MARKER} and {IMAGE_MARKER}, please."),
    Turn("assistant", "The first is a cat; the second is a dog."),
    Turn("user", f"And this one?\n{IMAGE_MARKER}"),
    Turn("assistant", "A bird on a wire.\nIt is small."),
]
NO_SYSTEM = [
    Turn("user", f"{IMAGE_MARKER}What is shown?"),
    Turn("assistant", "A handwritten digit seven."),
    Turn("user", f"Is it neat? {IMAGE_MARKER}"),
    Turn("assistant", "Fairly neat, slightly slanted."),
]
TEXT_ONLY = [
    Turn("user", "Name a prime number."),
    Turn("assistant", "Seven."),
    Turn("user", "Another one, bigger?"),
    Turn("assistant", "Eleven, then thirteen."),
]
CASES = {
    "multi-image with a system prompt, equal counts": (MULTI_IMAGE, [4, 4, 4]),
    "no system prompt, varying counts": (NO_SYSTEM, [3, 7]),
    "text only": (TEXT_ONLY, []),
}


def save_tokenizer(path, image_token, template, named_image_token=False):
    """A byte-level BPE trained on a few stdlib docstrings, wrapped and saved like a Qwen2 tokenizer;
    ``named_image_token`` also declares ``image_token`` as the tokenizer's own (its attribute)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    docs = [source.__doc__ for source in (argparse, collections, json, string, textwrap.TextWrapper)]  # ~7 KB
    bpe.train_from_iterator(docs, trainer)
    bpe.add_special_tokens(SPECIALS + ([image_token] if image_token else []))
    named = {"extra_special_tokens": {"image_token": image_token}} if named_image_token else {}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>", **named
    )
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("qwen2"), "<|image_pad|>", QWEN2_TEMPLATE)


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    return ChatTokenizer(qwen_dir)


def template_ids(chat, turns, image_tokens):
    """apply_chat_template's ids for the turns with each marker replaced by its run of image-token texts."""
    counts = iter(image_tokens)
    messages = []
    for turn in turns:
        pieces = turn.content.split(IMAGE_MARKER)
        content = pieces[0] + "".join("<|image_pad|>" * next(counts) + piece for piece in pieces[1:])
        messages.append({"role": turn.role, "content": content})
    result = chat._tokenizer.apply_chat_template(messages, tokenize=True)
    return list(result["input_ids"] if isinstance(result, Mapping) else result)


def mask_from_tokens(chat, tokens):
    """From the ids alone: after each `<|im_start|>` whose next tokens decode to "assistant\\n", every token
    up to and including the closing `<|im_end|>`."""
    im_start, im_end = chat.encode_text("<|im_start|>")[0], chat.encode_text("<|im_end|>")[0]
    mask = [False] * len(tokens)
    for i, token in enumerate(tokens):
        if token != im_start:
            continue
        end = tokens.index(im_end, i)
        header = next((j for j in range(i + 1, end) if chat.decode(tokens[i + 1:j]) == "assistant\n"), None)
        if header is not None:
            mask[header:end + 1] = [True] * (end + 1 - header)
    return mask


@pytest.mark.parametrize("name", CASES)
def test_ids_equal_the_chat_template_and_the_loss_is_on_assistant_turns(qwen, name):
    turns, image_tokens = CASES[name]
    encoded = qwen.encode_chat(turns, image_tokens)
    assert qwen.templated and qwen.eos_id == qwen.encode_text("<|endoftext|>")[0]
    assert encoded.tokens == template_ids(qwen, turns, image_tokens)
    assert len(encoded.assistant) == len(encoded.tokens)
    assert encoded.assistant == mask_from_tokens(qwen, encoded.tokens)
    masked = [token for token, loss in zip(encoded.tokens, encoded.assistant) if loss]
    expected = "".join(turn.content + "<|im_end|>" for turn in turns if turn.role == "assistant")
    assert qwen.decode(masked) == expected
    assert max(encoded.tokens) < qwen.vocab_size
    image_id = qwen.image_token_id
    assert image_id == qwen.encode_text("<|image_pad|>")[0]
    assert len(encoded.image_starts) == len(image_tokens)
    for start, count in zip(encoded.image_starts, image_tokens):
        run = encoded.tokens[start:start + count + 1]
        assert run[:count] == [image_id] * count and run[count] != image_id
        assert encoded.tokens[start - 1] != image_id
    assert encoded.tokens.count(image_id) == sum(image_tokens)


def test_the_prefix_of_an_assistant_turn_gets_no_loss(qwen):
    encoded = qwen.encode_chat(TEXT_ONLY, [])
    first_loss = encoded.assistant.index(True)
    prompt = qwen.decode(encoded.tokens[:first_loss])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert prompt.endswith("Name a prime number.<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("turns, image_tokens, message", [
    (MULTI_IMAGE, [4, 4], r"has 3 <image> markers but image_tokens has 2 counts"),
    (TEXT_ONLY, [5], r"has 0 <image> markers but image_tokens has 1 counts"),
    ([Turn("human", "hi")], [], r"unknown role 'human'; a turn's role is one of system, user, assistant"),
    ([], [], r"at least one turn"),
])
def test_malformed_conversations_are_refused(qwen, turns, image_tokens, message):
    with pytest.raises(ValueError, match=message):
        qwen.encode_chat(turns, image_tokens)


def test_a_template_that_rewrites_earlier_turns_is_refused(qwen_dir):
    chat = ChatTokenizer(qwen_dir)
    # Marks the last message: every earlier rendering changes once a turn is added.
    last_marked = "'<|im_end|>' + ('!' if loop.last else '') + '\\n' }}"
    chat._tokenizer.chat_template = QWEN2_TEMPLATE.replace("'<|im_end|>\\n' }}", last_marked)
    with pytest.raises(ValueError, match=r"does not render turns\[:1\] as a prefix of the whole"):
        chat.encode_chat(TEXT_ONLY, [])


def test_bytes_follow_the_plain_template():
    chat = ChatTokenizer(None)
    assert (chat.vocab_size, chat.image_token_id, chat.eos_id, chat.templated) == (256, 0, None, False)
    turns, image_tokens = NO_SYSTEM, [3, 7]
    encoded = chat.encode_chat(turns, image_tokens)
    assert chat.decode(encoded.tokens) == (
        "<|user|>\n\0\0\0What is shown?\n<|assistant|>\nA handwritten digit seven.\n"
        "<|user|>\nIs it neat? \0\0\0\0\0\0\0\n<|assistant|>\nFairly neat, slightly slanted.\n"
    )
    masked = bytes(token for token, loss in zip(encoded.tokens, encoded.assistant) if loss)
    assert masked.decode() == "A handwritten digit seven.\nFairly neat, slightly slanted.\n"
    runs = [encoded.tokens[start:start + count] for start, count in zip(encoded.image_starts, image_tokens)]
    assert runs == [[0] * 3, [0] * 7]
    assert encoded.tokens.count(0) == 10
    assert chat.encode_text("héllo") == list("héllo".encode())


def test_a_tokenizer_without_a_template_uses_the_plain_one_with_its_eos(tmp_path):
    chat = ChatTokenizer(save_tokenizer(tmp_path, "<img>", None, named_image_token=True))
    assert not chat.templated and chat.image_token_id == chat.encode_text("<img>")[0]
    encoded = chat.encode_chat([Turn("user", f"{IMAGE_MARKER} digit?"), Turn("assistant", "Seven.")], [2])
    assert chat.decode(encoded.tokens) == "<|user|>\n<img><img> digit?\n<|assistant|>\nSeven.<|endoftext|>\n"
    masked = [token for token, loss in zip(encoded.tokens, encoded.assistant) if loss]
    assert chat.decode(masked) == "Seven.<|endoftext|>" and masked[-1] == chat.eos_id
    assert encoded.image_starts == [len(chat.encode_text("<|user|>\n"))]


def test_a_tokenizer_without_an_image_token_needs_one(tmp_path):
    path = save_tokenizer(tmp_path, None, QWEN2_TEMPLATE)
    with pytest.raises(ValueError, match=r"has no image token .*add one to the tokenizer as a special token "
                                         r"or pass image_token"):
        ChatTokenizer(path)
    with pytest.raises(ValueError, match=r"image_token '<picture>' is not one token of the tokenizer"):
        ChatTokenizer(path, image_token="<picture>")
    chat = ChatTokenizer(path, image_token="<|endoftext|>")
    assert chat.image_token_id == chat.eos_id
