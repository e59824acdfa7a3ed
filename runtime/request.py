"""What callers hand the engine (`GenerationRequest`) and what it streams back (events)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from runtime.config import Row
from runtime.errors import InvalidRequestError
from runtime.sampling import SamplingParams

FinishReason = Literal["stop", "length", "abort", "error"]

TIMELINE_CODES = 32  # a request's timeline times this many of its first audio codes


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
class Timeline:
    """Wall-clock times (`time.time()`, seconds) of a request's first moments in the engine, so that its
    first audio's latency can be split into stages across the processes of one host (docs/metrics.md)."""

    arrived: float  # queued by `add_request`
    first_scheduled: float | None  # its first step was scheduled (None: it never ran)
    codes: tuple[float, ...]  # when each of its first TIMELINE_CODES audio codes was read on the host


@dataclass(frozen=True)
class Finished:
    """Last event of every stream: why it ended and how many rows it used."""

    reason: FinishReason
    num_prompt_tokens: int
    num_generated_tokens: int
    num_audio_codes: int
    num_cached_prompt_tokens: int
    error: str | None = None
    timeline: Timeline | None = field(default=None, compare=False)  # diagnostic: not part of equality


Event = TextDelta | AudioCodes | Finished


def validate_request(request: GenerationRequest, vocab_size: int, audio_vocab_size: int) -> None:
    """Raise InvalidRequestError naming the first malformed field (sampling values are checked by
    the sampler, capacity by the scheduler)."""
    if not isinstance(request, GenerationRequest):
        raise InvalidRequestError(f"expected a GenerationRequest, got {type(request).__name__}")
    if not isinstance(request.request_id, str) or not request.request_id:
        raise InvalidRequestError("request_id must be a non-empty string")
    for name in ("max_new_tokens", "min_new_tokens"):
        value = getattr(request, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidRequestError(f"{name} must be an integer, got {value!r}")
    if request.max_new_tokens < 1:
        raise InvalidRequestError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
    if not 0 <= request.min_new_tokens <= request.max_new_tokens:
        raise InvalidRequestError(
            f"min_new_tokens must be in [0, max_new_tokens={request.max_new_tokens}], got {request.min_new_tokens}"
        )
    if request.seed is not None and (
        isinstance(request.seed, bool) or not isinstance(request.seed, int) or not 0 <= request.seed < 2**64
    ):
        raise InvalidRequestError(f"seed must be None or an integer in [0, 2**64), got {request.seed!r}")
    for name in ("text_sampling", "audio_sampling"):
        if not isinstance(getattr(request, name), SamplingParams):
            raise InvalidRequestError(f"{name} must be a SamplingParams, got {type(getattr(request, name)).__name__}")
    if not request.prompt_rows:
        raise InvalidRequestError("prompt_rows must not be empty")
    for i, row in enumerate(request.prompt_rows):
        is_pair = isinstance(row, (tuple, list)) and len(row) == 2
        if not is_pair or not all(isinstance(t, int) and not isinstance(t, bool) for t in row):
            raise InvalidRequestError(f"prompt row {i} must be a (text id, audio id) pair of ints, got {row!r}")
        if not (0 <= row[0] < vocab_size and 0 <= row[1] < audio_vocab_size):
            raise InvalidRequestError(
                f"prompt row {i} = {tuple(row)} is out of range: text ids must be in [0, {vocab_size}), "
                f"audio ids in [0, {audio_vocab_size})"
            )
