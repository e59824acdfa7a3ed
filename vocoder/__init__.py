"""Streaming codec decoder for MOSS-Speech: codes (12.5 Hz) -> flow-matching mel -> BigVGAN -> 24 kHz PCM.

No Ray import here; `deployments/` wraps it. See docs/vocoder.md.
"""

from __future__ import annotations

from vocoder.config import (
    LOOKAHEAD_CODES,
    MEL_FRAMES_PER_CODE,
    NUM_MELS,
    SAMPLE_RATE,
    SAMPLES_PER_CODE,
    VocoderConfig,
)
from vocoder.session import VocoderSession
from vocoder.streaming import StreamingVocoder
from vocoder.voices import Voice, VoiceLibrary

__all__ = [
    "LOOKAHEAD_CODES",
    "MEL_FRAMES_PER_CODE",
    "NUM_MELS",
    "SAMPLES_PER_CODE",
    "SAMPLE_RATE",
    "StreamingVocoder",
    "VocoderConfig",
    "VocoderSession",
    "Voice",
    "VoiceLibrary",
]
