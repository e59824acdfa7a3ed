"""Text tokenizer: a thin wrapper over `tokenizers.Tokenizer` plus a tiny byte-level stand-in.

`Tokenizer.tiny()` needs no download: every byte is one token (id == byte value), and the Qwen
special tokens sit at their REAL ids, so prompts built with it use the same special ids as the
released model. Id 151667 is named `<|modality_pad|>` here (MOSS-Speech's modality pad; in the
released Qwen3 tokenizer file the same id carries another name; only the id matters to the engine).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import tokenizers

from runtime.config import (
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    MODALITY_PAD_ID,
    SOSP_ID,
)


class TokenizerError(ValueError):
    """A tokenizer file is missing or unusable."""


# Special tokens of the tiny tokenizer: the Qwen2/Qwen3 names and ids (151643..151666) plus the modality pad.
TINY_SPECIAL_TOKENS: dict[str, int] = {
    "<|endoftext|>": ENDOFTEXT_ID,
    "<|im_start|>": IM_START_ID,
    "<|im_end|>": IM_END_ID,
    "<|object_ref_start|>": SOSP_ID,
    "<|object_ref_end|>": 151647,
    "<|box_start|>": 151648,
    "<|box_end|>": 151649,
    "<|quad_start|>": 151650,
    "<|quad_end|>": 151651,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<|fim_prefix|>": 151659,
    "<|fim_middle|>": 151660,
    "<|fim_suffix|>": 151661,
    "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663,
    "<|file_sep|>": 151664,
    "<tool_response>": 151665,
    "</tool_response>": 151666,
    "<|modality_pad|>": MODALITY_PAD_ID,
}


# Qwen's control tokens a loaded tokenizer must hold at their ids (the facts sheet's)
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>")


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-level alphabet: a printable character standing for each byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _tiny_tokenizer_json() -> str:
    """tokenizer.json text of the tiny byte-level tokenizer (BPE with no merges: one token per byte)."""
    alphabet = _bytes_to_unicode()
    added = [
        {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for content, token_id in sorted(TINY_SPECIAL_TOKENS.items(), key=lambda item: item[1])
    ]
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                          "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                    "use_regex": False},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
            # The special tokens must sit in the model vocab too, or `tokenizers` renumbers them densely.
            "vocab": {**{alphabet[b]: b for b in range(256)}, **TINY_SPECIAL_TOKENS},
            "merges": [],
        },
    }
    return json.dumps(spec, ensure_ascii=False)


class Tokenizer:
    """Encode/decode text for the text channel; special tokens are never added implicitly."""

    def __init__(self, inner: tokenizers.Tokenizer) -> None:
        self._inner = inner

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load a Hugging Face `tokenizer.json`."""
        path = Path(path)
        if not path.is_file():
            raise TokenizerError(f"tokenizer file not found: {path}")
        try:
            tokenizer = cls(tokenizers.Tokenizer.from_file(str(path)))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
            raise TokenizerError(f"cannot load tokenizer {path}: {exc}") from exc
        # the prompts, the stop rules and the control-token guard use these ids as constants
        for token in CONTROL_TOKENS:
            found = tokenizer.token_to_id(token)
            if found != TINY_SPECIAL_TOKENS[token]:
                raise TokenizerError(f"{path}: {token} has id {found}, this runtime uses {TINY_SPECIAL_TOKENS[token]}")
        return tokenizer

    @classmethod
    def tiny(cls) -> Tokenizer:
        """A byte-level tokenizer (id == byte value) carrying the real Qwen special ids."""
        return cls(tokenizers.Tokenizer.from_str(_tiny_tokenizer_json()))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings inside `text` map to their ids; none are added."""
        return list(self._inner.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `ids`, as HF decodes it: incomplete UTF-8 byte runs become U+FFFD, ids unknown to the
        vocabulary are dropped, special tokens are kept unless `skip_special_tokens`."""
        return self._inner.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (e.g. '<|im_end|>'), None when it is not in the vocabulary."""
        return self._inner.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Token string of an id, None when the id is not in the vocabulary."""
        return self._inner.id_to_token(token_id)

    def save(self, path: str | Path) -> None:
        """Write a `tokenizer.json` that `from_file` reads back."""
        self._inner.save(str(path))
