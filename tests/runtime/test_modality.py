"""The modality state machine: transitions, prompt replay, the MODALITY_PAD overwrite and output codes."""
from __future__ import annotations

import pytest

from runtime.config import AUDIO_PAD_ID, EOSP_ID, IM_END_ID, MODALITY_PAD_ID, SOSP_ID
from runtime.modality import apply_modality, is_output_code, next_mode, replay_mode


@pytest.mark.parametrize(
    ("mode", "row", "expected"),
    [
        ("text", (SOSP_ID, AUDIO_PAD_ID), "audio"),  # SOSP in text mode starts audio
        ("text", (SOSP_ID, EOSP_ID), "audio"),  # the audio channel does not matter in text mode
        ("text", (42, EOSP_ID), "text"),  # EOSP in text mode is ignored
        ("text", (MODALITY_PAD_ID, 7), "text"),
        ("audio", (MODALITY_PAD_ID, EOSP_ID), "text"),  # EOSP in audio mode ends audio
        ("audio", (MODALITY_PAD_ID, 7), "audio"),
        ("audio", (SOSP_ID, 7), "audio"),  # SOSP in audio mode is ignored
        ("audio", (IM_END_ID, 7), "audio"),
    ],
)
def test_next_mode(mode: str, row: tuple[int, int], expected: str) -> None:
    assert next_mode(mode, row) == expected  # type: ignore[arg-type]


def test_next_mode_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="mode must be"):
        next_mode("speech", (1, 2))  # type: ignore[arg-type]


def test_replay_mode_over_prompts() -> None:
    text_rows = [(151644, AUDIO_PAD_ID), (77, AUDIO_PAD_ID), (10, AUDIO_PAD_ID)]
    assert replay_mode([]) == "text"
    assert replay_mode(text_rows) == "text"
    # An audio-output prompt ends in [SOSP, AUDIO_PAD]: generation starts in audio mode.
    assert replay_mode([*text_rows, (SOSP_ID, AUDIO_PAD_ID)]) == "audio"
    # A complete audio user turn returns to text mode after its EOSP row.
    audio_turn = [(SOSP_ID, AUDIO_PAD_ID), (MODALITY_PAD_ID, 5), (MODALITY_PAD_ID, 6), (MODALITY_PAD_ID, EOSP_ID)]
    assert replay_mode([*text_rows, *audio_turn]) == "text"
    assert replay_mode([*text_rows, *audio_turn[:3]]) == "audio"
    assert replay_mode([(MODALITY_PAD_ID, 5)], start="audio") == "audio"


def test_apply_modality_overwrites_text_only_in_audio_mode() -> None:
    assert apply_modality("audio", 42, 7) == (MODALITY_PAD_ID, 7)
    assert apply_modality("audio", IM_END_ID, EOSP_ID) == (MODALITY_PAD_ID, EOSP_ID)
    assert apply_modality("text", 42, 7) == (42, 7)  # audio token kept although ignored as input
    assert apply_modality("text", SOSP_ID, EOSP_ID) == (SOSP_ID, EOSP_ID)
    with pytest.raises(ValueError, match="mode must be"):
        apply_modality("both", 1, 2)  # type: ignore[arg-type]


def test_is_output_code() -> None:
    assert is_output_code("audio", (MODALITY_PAD_ID, 0))
    assert is_output_code("audio", (MODALITY_PAD_ID, 16383))
    assert is_output_code("audio", (MODALITY_PAD_ID, AUDIO_PAD_ID))  # 512 is a valid code when sampled
    assert not is_output_code("audio", (MODALITY_PAD_ID, EOSP_ID))
    assert not is_output_code("text", (42, 7))
    assert not is_output_code("text", (SOSP_ID, 7))
