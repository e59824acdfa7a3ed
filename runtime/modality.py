"""The text/audio modality state machine of MOSS-Speech generation.

Every position holds a row (text token, audio token). Before each forward the mode is evaluated on the
previously appended row (facts sheet, "One generation step"):

- text mode and the row's text token is SOSP (151646)  -> audio mode;
- audio mode and the row's audio token is EOSP (16384) -> text mode;
- anything else keeps the mode.

A request's initial mode comes from replaying the machine over its prompt rows, starting in text mode, so an
audio-output prompt ending in the row ``[SOSP, AUDIO_PAD]`` starts generation in audio mode.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from runtime.config import EOSP_ID, MODALITY_PAD_ID, SOSP_ID, Row

Mode = Literal["text", "audio"]

TEXT_MODE: Mode = "text"
AUDIO_MODE: Mode = "audio"


def next_mode(mode: Mode, row: Row) -> Mode:
    """Return the mode after ``row`` was appended while the sequence was in ``mode``."""
    if mode == TEXT_MODE:
        return AUDIO_MODE if row[0] == SOSP_ID else TEXT_MODE
    if mode == AUDIO_MODE:
        return TEXT_MODE if row[1] == EOSP_ID else AUDIO_MODE
    raise ValueError(f"mode must be 'text' or 'audio', got {mode!r}")


def replay_mode(rows: Iterable[Row], start: Mode = TEXT_MODE) -> Mode:
    """Return the mode after replaying the state machine over ``rows`` from ``start``.

    Used to find the mode a request starts generating in from its prompt rows.
    """
    mode = start
    for row in rows:
        mode = next_mode(mode, row)
    return mode


def apply_modality(mode: Mode, text_token: int, audio_token: int) -> Row:
    """Build the row appended for tokens sampled in ``mode``.

    In audio mode the sampled text token is replaced by MODALITY_PAD (so the row's input embedding is the
    audio one); in text mode the sampled audio token is kept in the row although the model ignores it as
    input.
    """
    if mode == AUDIO_MODE:
        return (MODALITY_PAD_ID, audio_token)
    if mode == TEXT_MODE:
        return (text_token, audio_token)
    raise ValueError(f"mode must be 'text' or 'audio', got {mode!r}")


def is_output_code(mode: Mode, row: Row) -> bool:
    """Whether ``row``, sampled while in ``mode``, carries an audio code that is part of the output.

    Output codes are audio tokens sampled in audio mode, excluding EOSP (which only ends the audio span).
    Audio tokens sampled in text mode are never output.
    """
    return mode == AUDIO_MODE and row[1] != EOSP_ID
