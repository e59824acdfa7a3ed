"""The tiny tokenizer: real special ids, byte-level round trip, HF-like decoding of partial UTF-8."""
from __future__ import annotations

from pathlib import Path

import pytest

from runtime.config import ENDOFTEXT_ID, IM_END_ID, IM_START_ID, MODALITY_PAD_ID, SOSP_ID
from runtime.tokenizer import Tokenizer, TokenizerError


def test_tiny_special_ids_are_the_real_ones() -> None:
    tok = Tokenizer.tiny()
    assert tok.token_to_id("<|endoftext|>") == ENDOFTEXT_ID == 151643
    assert tok.token_to_id("<|im_start|>") == IM_START_ID == 151644
    assert tok.token_to_id("<|im_end|>") == IM_END_ID == 151645
    assert tok.token_to_id("<|object_ref_start|>") == SOSP_ID == 151646
    assert tok.token_to_id("<|modality_pad|>") == MODALITY_PAD_ID == 151667
    assert tok.id_to_token(151645) == "<|im_end|>"
    assert tok.token_to_id("<|no_such_token|>") is None


def test_bytes_are_their_own_ids_and_no_special_tokens_are_added() -> None:
    tok = Tokenizer.tiny()
    assert tok.encode("hi") == [104, 105]
    assert tok.encode("é") == [0xC3, 0xA9]
    assert tok.encode("<|im_start|>user\n") == [151644, 117, 115, 101, 114, 10]
    assert tok.encode("") == []


def test_utf8_round_trip() -> None:
    tok = Tokenizer.tiny()
    text = "Héllo, 世界! 🎧 <|im_end|>\n  two  spaces"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text.replace("<|im_end|>", "")


def test_incomplete_utf8_decodes_to_replacement_char() -> None:
    tok = Tokenizer.tiny()
    ids = tok.encode("世")
    assert ids == [0xE4, 0xB8, 0x96]
    assert tok.decode(ids[:2]) == "\ufffd"
    assert tok.decode(tok.encode("a") + ids[:1]) == "a\ufffd"


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    Tokenizer.tiny().save(path)
    tok = Tokenizer.from_file(path)
    assert tok.encode("<|im_start|>ok") == [151644, 111, 107]
    with pytest.raises(TokenizerError, match="not found"):
        Tokenizer.from_file(tmp_path / "missing.json")


def test_a_tokenizer_whose_control_tokens_sit_elsewhere_is_refused(tmp_path: Path) -> None:
    """The prompts and stop rules use Qwen's control ids as constants: a tokenizer.json that puts
    <|im_end|> at another id (or lacks it) is refused, naming the token."""
    import json

    data = json.loads(Tokenizer.tiny()._inner.to_str())
    for added in data["added_tokens"]:
        if added["content"] == "<|im_end|>":
            added["id"] = 151545
    data["model"]["vocab"]["<|im_end|>"] = 151545
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match=r"<\|im_end\|> has id 151545, this runtime uses 151645"):
        Tokenizer.from_file(path)
