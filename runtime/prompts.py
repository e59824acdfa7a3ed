"""Chat messages -> prompt rows (text token, audio token) in the MOSS-Speech chat format.

Format (facts sheet, "Audio output prompt"), and the choices made where the sheet is silent:

- A text turn is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, tokenized as IM_START, then
  ``tokenizer.encode(f"{role}\\n{content}")``, then IM_END, then ``tokenizer.encode("\\n")``. Every text row
  carries AUDIO_PAD (512) on the audio channel.
- An audio turn is ``<|im_start|>{role}\\n`` rows, then the audio segment, then ``<|im_end|>\\n`` rows. The
  audio segment of ``n`` codes is ``n + 2`` rows: text channel ``[SOSP, MODALITY_PAD x (n + 1)]`` over audio
  channel ``[AUDIO_PAD, codes..., EOSP]``. Audio content is allowed for user turns (speech input) and for
  assistant turns (earlier spoken replies in a multi-turn chat, same layout); not for system turns.
- A turn of several parts (text and audio in order, our choice: the sheet shows one or the other) is the
  header, then each part in order (text tokenized as one string with the header when it comes first, else
  on its own; adjacent text parts joined first), then ``<|im_end|>\\n``. One text part or one audio part
  gives exactly the turns above.
- The generation prefix is ``<|im_start|>assistant\\n`` rows; for audio output it is followed by the row
  ``[SOSP, AUDIO_PAD]`` so generation starts in audio mode. Nothing else is added: no default system prompt,
  no implicit turns; roles may come in any order.
- Text content must not contain the control tokens of the format (``<|im_start|>``, ``<|im_end|>``,
  ``<|endoftext|>``, the SOSP and modality-pad tokens): the tokenizer would map them to their special ids
  and let a message forge turn or modality boundaries, so they are rejected.
- Every validation failure raises :class:`PromptError`, a ValueError.
"""
from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from runtime.config import (
    AUDIO_PAD_ID,
    ENDOFTEXT_ID,
    EOSP_ID,
    IM_END_ID,
    IM_START_ID,
    MODALITY_PAD_ID,
    NUM_AUDIO_CODES,
    SOSP_ID,
    Row,
)
from runtime.tokenizer import TINY_SPECIAL_TOKENS

ROLES = ("system", "user", "assistant")
# The system prompt of a read-aloud (text-to-speech) request, as the Serve ingress builds it.
READ_ALOUD_PROMPT = ("You are a text-to-speech voice. Read the user's message aloud exactly as written, "
                     "without adding or leaving out any words.")
OutputModality = Literal["audio", "text"]
_CONTROL_IDS = frozenset({IM_START_ID, IM_END_ID, ENDOFTEXT_ID, SOSP_ID, MODALITY_PAD_ID})
_CONTROL_NAMES = {i: name for name, i in TINY_SPECIAL_TOKENS.items() if i in _CONTROL_IDS}  # their Qwen names


class PromptError(ValueError):
    """A chat message or prompt request cannot be turned into prompt rows (maps to HTTP 400)."""


class TextEncoder(Protocol):
    """What prompt building needs from a tokenizer (``runtime.tokenizer.Tokenizer`` satisfies it)."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens added."""
        ...


@dataclass(frozen=True)
class AudioContent:
    """Speech content of a turn: codec codes (12.5 per second), each in 0..16383, at least one."""

    codes: tuple[int, ...]

    def __post_init__(self) -> None:
        try:
            codes = tuple(operator.index(code) for code in self.codes)
        except TypeError:
            raise PromptError(f"audio codes must be integers, got {self.codes!r:.80}") from None
        if not codes:
            raise PromptError("audio content needs at least one code")
        bad = [code for code in codes if not 0 <= code < NUM_AUDIO_CODES]
        if bad:
            raise PromptError(f"audio codes must be in 0..{NUM_AUDIO_CODES - 1}, got {bad[:5]}")
        object.__setattr__(self, "codes", codes)


@dataclass(frozen=True)
class ChatMessage:
    """One chat turn: ``role`` is system, user or assistant; ``content`` is text, :class:`AudioContent`, or a
    non-empty tuple of them (parts in order)."""

    role: str
    content: str | AudioContent | tuple[str | AudioContent, ...]

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise PromptError(f"role must be one of {', '.join(ROLES)}; got {self.role!r}")
        parts = self.content if isinstance(self.content, tuple) else (self.content,)
        if not parts or not all(isinstance(part, (str, AudioContent)) for part in parts):
            raise PromptError("content must be a str, an AudioContent or a non-empty tuple of them, got "
                              f"{self.content!r:.80}")
        if self.role == "system" and any(isinstance(part, AudioContent) for part in parts):
            raise PromptError("a system message must be text, not audio")

    def parts(self) -> list[str | AudioContent]:
        """The content as parts, adjacent text parts joined."""
        merged: list[str | AudioContent] = []
        for part in self.content if isinstance(self.content, tuple) else (self.content,):
            if isinstance(part, str) and merged and isinstance(merged[-1], str):
                merged[-1] += part
            else:
                merged.append(part)
        return merged


def text_rows(token_ids: Sequence[int]) -> list[Row]:
    """Rows for text tokens: each token over AUDIO_PAD on the audio channel."""
    return [(token, AUDIO_PAD_ID) for token in token_ids]


def audio_segment_rows(codes: Sequence[int]) -> list[Row]:
    """The ``n + 2`` rows of an audio span: ``[SOSP, MP x (n+1)]`` over ``[AUDIO_PAD, codes..., EOSP]``."""
    codes = AudioContent(tuple(codes)).codes
    return [(SOSP_ID, AUDIO_PAD_ID), *((MODALITY_PAD_ID, code) for code in codes), (MODALITY_PAD_ID, EOSP_ID)]


def build_prompt_rows(
    tokenizer: TextEncoder, messages: Sequence[ChatMessage], *, output_modality: OutputModality
) -> list[Row]:
    """Rows of the whole prompt: every message's turn, then the assistant generation prefix.

    Raises :class:`PromptError` (a ValueError) for an empty message list, an unknown output modality, an
    item that is not a :class:`ChatMessage`, or text content holding control tokens.
    """
    if output_modality not in ("audio", "text"):
        raise PromptError(f"output_modality must be 'audio' or 'text', got {output_modality!r}")
    if not messages:
        raise PromptError("messages must not be empty")
    newline = tokenizer.encode("\n")
    rows: list[Row] = []
    for index, message in enumerate(messages):
        if not isinstance(message, ChatMessage):
            raise PromptError(f"messages[{index}] must be a ChatMessage, got {type(message).__name__}")
        parts = message.parts()
        head = parts.pop(0) if isinstance(parts[0], str) else ""
        rows += text_rows([IM_START_ID, *_encode(tokenizer, f"{message.role}\n{head}", index)])
        for part in parts:
            if isinstance(part, AudioContent):
                rows += audio_segment_rows(part.codes)
            else:
                rows += text_rows(_encode(tokenizer, part, index))
        rows += text_rows([IM_END_ID, *newline])
    rows += text_rows([IM_START_ID, *tokenizer.encode("assistant\n")])
    if output_modality == "audio":
        rows.append((SOSP_ID, AUDIO_PAD_ID))
    return rows


def read_aloud_rows(tokenizer: TextEncoder, text: str) -> list[Row]:
    """Rows of a read-aloud request without instructions: READ_ALOUD_PROMPT as system turn, `text` as user
    turn, audio output (what the ingress builds for /v1/audio/speech)."""
    messages = [ChatMessage("system", READ_ALOUD_PROMPT), ChatMessage("user", text)]
    return build_prompt_rows(tokenizer, messages, output_modality="audio")


def _encode(tokenizer: TextEncoder, text: str, index: int) -> list[int]:
    """Encode one turn's text, refusing control tokens inside it."""
    ids = tokenizer.encode(text)
    forged = sorted(_CONTROL_IDS.intersection(ids))
    if forged:
        shown = ", ".join(_CONTROL_NAMES[i] for i in forged)
        raise PromptError(f"messages[{index}] content contains reserved control token text {shown} "
                          f"(ids {forged}), which cannot be sent as text")
    return ids
