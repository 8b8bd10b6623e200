"""Conversations to token ids, with a loss only on the assistant's turns and image placeholders expanded.

A conversation is a sequence of ``Turn``s (role ``system``, ``user`` or ``assistant``); an ``<image>`` marker
in a turn's content stands for one image. Image k becomes ``image_tokens[k]`` copies of the image token
(the vision module decides how many), counted in order across all turns; with a Qwen-VL tokenizer (image
token ``<|image_pad|>`` beside ``<|vision_start|>`` and ``<|vision_end|>``) between those two, as its
processor writes an image. A ``<video>`` marker (Qwen-VL tokenizers) stands for a video: its items'
``<|video_pad|>`` runs between the vision tokens, each item after its stamp and in vision tokens of its own
when it has one (Qwen3-VL's timestamps), else run after run (``VideoText``).

With a Hugging Face tokenizer that has a ``chat_template`` the ids are exactly those of
``tokenizer.apply_chat_template(messages, tokenize=True)`` for the turns with their markers expanded. The
rendered text is tokenized with its character offsets, and a token carries the loss when any of its
characters lies in an assistant span. The span of assistant turn k runs from the end of
``render(turns[:k], add_generation_prompt=True)`` (its header, e.g. ``<|im_start|>assistant\\n``) to the
last non-whitespace character of ``render(turns[:k + 1])``: the content and the template's end-of-turn text
(``<|im_end|>``), without the whitespace that separates turns. Each prefix must render as a prefix of the
whole conversation, so a template that rewrites earlier turns is refused, and so is an assistant turn
first (there is no earlier turn to render its header after).

Without a chat template (and always for byte tokens, UTF-8 bytes with a vocabulary of 256) the plain
template renders each turn as ``"<|{role}|>\\n{content}{close}"``, where ``close`` is ``"\\n"``, except
for assistant turns when the tokenizer has an eos token: then it is the eos text and ``"\\n"``. The loss
is on each assistant content and the eos text that closes it (not the ``"\\n"`` after), or without eos
(bytes) on the content and its closing ``"\\n"``. E.g. bytes: ``"<|user|>\\nHi\\n<|assistant|>\\nHello\\n"``
with the loss on ``"Hello\\n"``.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetero.data.digits import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "IMAGE_MARKER", "ROLES", "VIDEO_MARKER", "ChatTokenizer", "EncodedChat", "Turn", "VideoText"]

ROLES = ("system", "user", "assistant")
IMAGE_MARKER = "<image>"
VIDEO_MARKER = "<video>"
BYTE_IMAGE_TOKEN = 0  # NUL: never in ordinary text
BYTE_VOCAB_SIZE = 256
QWEN_IMAGE_TOKEN, QWEN_VIDEO_TOKEN = "<|image_pad|>", "<|video_pad|>"
QWEN_VISION_SPAN = ("<|vision_start|>", "<|vision_end|>")
_KNOWN_IMAGE_TOKENS = ("<image>", QWEN_IMAGE_TOKEN, "<IMG_CONTEXT>")
Span = tuple[int, int]  # [start, end) in characters of the rendered text


@dataclass(frozen=True)
class Turn:
    """One message of a conversation; ``content`` may hold ``IMAGE_MARKER`` where an image stands."""

    role: str
    content: str


@dataclass(frozen=True)
class VideoText:
    """How a video is written: placeholder tokens per item (a temporal patch, or the whole video), and
    the text before each item (Qwen3-VL's timestamps; empty: the items run on without one)."""

    items: tuple[int, ...]
    stamps: tuple[str, ...] = ()


@dataclass
class EncodedChat:
    """Token ids, which of them carry a loss, where each image's placeholder run starts, and where each
    video's items start."""

    tokens: list[int]
    assistant: list[bool]
    image_starts: list[int]
    video_starts: list[list[int]]


class ChatTokenizer:
    """Encodes conversations with the Hugging Face tokenizer in ``tokenizer_dir``, or as bytes (``None``)."""

    def __init__(self, tokenizer_dir: str | os.PathLike | None, image_token: str | None = None) -> None:
        self._tokenizer: Any = None
        self._image_text = "\0"
        self._image_span = ("", "")  # the texts around an image's run (Qwen-VL's vision start and end)
        self.vocab_size = BYTE_VOCAB_SIZE
        self.image_token_id = BYTE_IMAGE_TOKEN
        self.video_token_id: int | None = None
        self.eos_id: int | None = None
        self.templated = False
        self._files = sorted(Path(tokenizer_dir).glob("*token*")) if tokenizer_dir is not None else []
        if tokenizer_dir is None:
            if image_token is not None:
                raise ValueError(f"image_token={image_token!r} needs a tokenizer: byte tokens use id 0 (NUL)")
            return
        from transformers import AutoTokenizer  # late: the byte path needs no transformers

        tokenizer = AutoTokenizer.from_pretrained(os.fspath(tokenizer_dir), local_files_only=True)
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"{tokenizer_dir}: a fast tokenizer (tokenizer.json) is needed for offsets")
        self._tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self._image_text, self.image_token_id = self._find_image_token(image_token, tokenizer_dir)
        vocab = tokenizer.get_vocab()
        if self._image_text == QWEN_IMAGE_TOKEN and all(text in vocab for text in QWEN_VISION_SPAN):
            self._image_span = QWEN_VISION_SPAN
            self.video_token_id = vocab.get(QWEN_VIDEO_TOKEN)
        self.eos_id = tokenizer.eos_token_id
        self.templated = bool(getattr(tokenizer, "chat_template", None))

    def _find_image_token(self, image_token: str | None, where: str | os.PathLike) -> tuple[str, int]:
        """The image token's text and id: the one asked for, else the tokenizer's own."""
        tokenizer = self._tokenizer
        if image_token is not None:
            ids = self.encode_text(image_token * 3)
            if len(ids) != 3 or len(set(ids)) != 1:  # repeated, it must stay one id per copy
                raise ValueError(f"image_token {image_token!r} is not one token of the tokenizer in {where}")
            return image_token, ids[0]
        vocab = tokenizer.get_vocab()
        own = getattr(tokenizer, "image_token", None)  # e.g. from extra_special_tokens={"image_token": ...}
        for text in ([str(own)] if own is not None else []) + list(_KNOWN_IMAGE_TOKENS):
            if text in vocab:
                return text, vocab[text]
        raise ValueError(
            f"the tokenizer in {where} has no image token (none of {', '.join(_KNOWN_IMAGE_TOKENS)}): "
            "add one to the tokenizer as a special token or pass image_token"
        )

    def fingerprint(self) -> str:
        """What these tokens depend on: the tokenizer's files and the image token (bytes: nothing)."""
        digest = hashlib.sha256("".join([self._image_text, *self._image_span]).encode())
        for path in self._files:
            digest.update(path.name.encode() + path.read_bytes())
        return digest.hexdigest()[:16]

    def encode_text(self, text: str) -> list[int]:
        """Token ids of plain text, without added special tokens (bytes: its UTF-8 bytes)."""
        if self._tokenizer is None:
            return list(text.encode("utf-8"))
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of token ids, special tokens included (bytes: invalid UTF-8 becomes U+FFFD)."""
        if self._tokenizer is None:
            return bytes(tokens).decode("utf-8", errors="replace")
        return self._tokenizer.decode(list(tokens), skip_special_tokens=False)

    def encode_chat(self, turns: Sequence[Turn], image_tokens: Sequence[int],
                    videos: Sequence[VideoText] = ()) -> EncodedChat:
        """Token ids of ``turns`` with a loss mask on the assistant's turns (see the module docstring)."""
        if not turns:
            raise ValueError("a conversation needs at least one turn; got none")
        for turn in turns:
            if turn.role not in ROLES:
                raise ValueError(f"unknown role {turn.role!r}; a turn's role is one of {', '.join(ROLES)}")
        for marker, count, given in ((IMAGE_MARKER, len(image_tokens), f"image_tokens has {len(image_tokens)} counts"),
                                     (VIDEO_MARKER, len(videos), f"{len(videos)} videos are given")):
            markers = sum(turn.content.count(marker) for turn in turns)
            if markers != count:
                raise ValueError(f"the conversation has {markers} {marker} markers but {given}")
        if any(count < 1 for count in image_tokens) or any(count < 1 for video in videos for count in video.items):
            raise ValueError(f"each image and video item needs at least one placeholder token; got "
                             f"{list(image_tokens)} and {[list(v.items) for v in videos]}")
        if videos and self.video_token_id is None:
            raise ValueError(f"videos are written with Qwen-VL's {QWEN_VIDEO_TOKEN} between its vision tokens, which "
                             f"this tokenizer lacks")
        contents = self._expand_markers(turns, image_tokens, videos)
        render = self._render_templated if self.templated else self._render_plain
        text, spans = render(turns, contents)
        tokens, offsets = self._tokenize(text)
        assistant = [any(start < stop and end > begin for begin, stop in spans) for start, end in offsets]
        items = [count for video in videos for count in video.items]
        starts = iter(self._run_starts(tokens, self.video_token_id, items, "video") if videos else [])
        return EncodedChat(tokens, assistant, self._run_starts(tokens, self.image_token_id, image_tokens, "image"),
                           [[next(starts) for _ in video.items] for video in videos])

    def _expand_markers(self, turns: Sequence[Turn], image_tokens: Sequence[int], videos: Sequence[VideoText]
                        ) -> list[str]:
        """Each turn's content with image k's marker replaced by ``image_tokens[k]`` image-token texts (in
        the vision span), and video k's by its items (``VideoText``)."""
        counts, clips = iter(image_tokens), iter(videos)
        opening, closing = self._image_span
        contents = []
        for turn in turns:
            pieces = re.split(f"({re.escape(IMAGE_MARKER)}|{re.escape(VIDEO_MARKER)})", turn.content)
            expanded = pieces[0]
            for marker, piece in zip(pieces[1::2], pieces[2::2]):
                if marker == IMAGE_MARKER:
                    expanded += opening + self._image_text * next(counts) + closing + piece
                    continue
                video = next(clips)
                if video.stamps:
                    runs = "".join(stamp + opening + QWEN_VIDEO_TOKEN * count + closing
                                   for stamp, count in zip(video.stamps, video.items))
                else:
                    runs = QWEN_VIDEO_TOKEN * sum(video.items)
                expanded += opening + runs + closing + piece
            contents.append(expanded)
        return contents

    def _render_templated(self, turns: Sequence[Turn], contents: list[str]) -> tuple[str, list[Span]]:
        """The tokenizer's chat template rendering and the character span of each assistant turn."""
        messages = [{"role": turn.role, "content": content} for turn, content in zip(turns, contents)]

        def render(upto: int, prompt: bool = False) -> str:
            return self._tokenizer.apply_chat_template(
                messages[:upto], tokenize=False, add_generation_prompt=prompt
            )

        text = render(len(messages))
        spans = []
        for k, turn in enumerate(turns):
            if turn.role != "assistant":
                continue
            if k == 0:
                raise ValueError("the first turn is the assistant's: the chat template needs an earlier turn "
                                 "to locate the assistant header after")
            header, whole = render(k, prompt=True), render(k + 1)
            if not (whole.startswith(header) and text.startswith(whole)):
                raise ValueError(
                    f"the tokenizer's chat template does not render turns[:{k}] as a prefix of the whole "
                    "conversation (it changes earlier text), so assistant turns cannot be located"
                )
            spans.append((len(header), len(whole.rstrip())))
        return text, spans

    def _render_plain(self, turns: Sequence[Turn], contents: list[str]) -> tuple[str, list[Span]]:
        """The plain template's rendering and the character span of each assistant turn."""
        eos = self._tokenizer.eos_token if self._tokenizer is not None else None
        text, spans = "", []
        for turn, content in zip(turns, contents):
            text += f"<|{turn.role}|>\n"
            if turn.role != "assistant":
                text += content + "\n"
                continue
            start = len(text)
            text += content + (eos or "\n")
            spans.append((start, len(text)))
            if eos:
                text += "\n"
        return text, spans

    def _tokenize(self, text: str) -> tuple[list[int], list[Span]]:
        """Token ids of rendered text and each token's character span in it."""
        if self._tokenizer is None:
            tokens, offsets = [], []
            for index, char in enumerate(text):
                for byte in char.encode("utf-8"):
                    tokens.append(byte)
                    offsets.append((index, index + 1))
            return tokens, offsets
        encoding = self._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoding["input_ids"]), [tuple(pair) for pair in encoding["offset_mapping"]]

    @staticmethod
    def _run_starts(tokens: list[int], token_id: int, counts: Sequence[int], what: str) -> list[int]:
        """Where each run of ``token_id`` starts: run k's at that id's occurrence ``sum(counts[:k])``."""
        positions = [i for i, token in enumerate(tokens) if token == token_id]
        if len(positions) != sum(counts):
            raise ValueError(
                f"the encoded conversation has {len(positions)} {what} tokens (id {token_id}) but its "
                f"{what}s ask for {sum(counts)}: does the text itself contain the {what} token?"
            )
        starts, seen = [], 0
        for count in counts:
            starts.append(positions[seen])
            seen += count
        return starts
