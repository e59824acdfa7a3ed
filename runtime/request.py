"""What callers hand the engine (`GenerationRequest`) and what it streams back (events)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from runtime.config import Row
from runtime.sampling import SamplingParams

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: prompt rows, per-channel sampling settings and limits.

    `seed` None lets the engine derive one from `request_id` (see docs/engine.md).
    """

    request_id: str
    prompt_rows: tuple[Row, ...]
    text_sampling: SamplingParams = field(default_factory=SamplingParams)
    audio_sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 512
    min_new_tokens: int = 0
    seed: int | None = None


@dataclass(frozen=True)
class TextDelta:
    """New text of the output; never ends inside a UTF-8 character."""

    text: str


@dataclass(frozen=True)
class AudioCodes:
    """Codec codes (0..16383) sampled in audio mode since the last event; EOSP is not included."""

    codes: tuple[int, ...]


@dataclass(frozen=True)
class Finished:
    """Last event of every stream: why it ended and how many rows it used."""

    reason: FinishReason
    num_prompt_tokens: int
    num_generated_tokens: int
    num_audio_codes: int
    num_cached_prompt_tokens: int
    error: str | None = None


Event = TextDelta | AudioCodes | Finished
