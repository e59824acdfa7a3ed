"""Request schemas of the HTTP API (OpenAI speech and chat completions, plus our sampling fields).

Parsing never touches a model: every check here is on the JSON alone. Checks that need server
settings (input length, known voices, served model name) live in `deployments.validation`.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Strict types ("0.5" is not a float), no NaN/Infinity, unknown fields ignored as OpenAI does.
_STRICT = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=0, le=16384)]
RepetitionPenalty = Annotated[float, Field(ge=0.01, le=10.0)]  # within the engine's range (sampling.py)
Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]
NewTokens = Annotated[int, Field(ge=1)]
# Messages of one chat request: each costs the LLM replica prompt rows to build, on its event loop, even when
# it is empty (max_input_chars counts only text)
MAX_MESSAGES = 1024


class SamplingFields(BaseModel):
    """Our sampling extensions; None means the engine default (temperature 0.6, top_p 0.95, ...)."""

    model_config = _STRICT

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_new_tokens: Annotated[int, Field(ge=0)] | None = None
    seed: Seed | None = None

    def sampling_overrides(self) -> dict[str, float | int]:
        """The sampling fields the client set, as `SamplingParams` keyword arguments."""
        fields = ("temperature", "top_p", "top_k", "repetition_penalty")
        return {name: getattr(self, name) for name in fields if getattr(self, name) is not None}


class SpeechRequest(SamplingFields):
    """`POST /v1/audio/speech`: sampling fields apply to the audio channel."""

    model: str
    input: Annotated[str, Field(min_length=1)]
    voice: Annotated[str, Field(min_length=1)] = "default"
    instructions: str | None = None
    response_format: Literal["wav", "pcm"] = "wav"
    stream_format: Literal["audio", "sse"] = "audio"
    speed: float | None = None
    max_new_tokens: NewTokens | None = None

    @model_validator(mode="after")
    def _check(self) -> SpeechRequest:
        if not self.input.strip():
            raise ValueError("input must contain non-whitespace text")
        if self.speed is not None and self.speed != 1.0:
            raise ValueError("speed must be 1.0 (other speeds are not supported)")
        _check_min_max(self.min_new_tokens, self.max_new_tokens)
        return self


class TextPart(BaseModel):
    """A `{"type": "text", "text": ...}` content part."""

    model_config = _STRICT
    type: Literal["text"]
    text: str


class InputAudio(BaseModel):
    """`input_audio` of a content part: base64 of a whole audio file. `format`: OpenAI's wav / mp3, plus flac and
    ogg (Vorbis tested); the file's own header decides how it is decoded."""

    model_config = _STRICT
    data: Annotated[str, Field(min_length=1)]
    format: Literal["wav", "mp3", "flac", "ogg"]


class InputAudioPart(BaseModel):
    """A `{"type": "input_audio", "input_audio": {"data": ..., "format": "wav"}}` content part (speech input)."""

    model_config = _STRICT
    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = TextPart | InputAudioPart


class ChatMessageIn(BaseModel):
    """One chat message; content is a string or a list of content parts."""

    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None


class AudioOutput(BaseModel):
    """The chat request's `audio` parameter."""

    model_config = _STRICT
    voice: Annotated[str, Field(min_length=1)] = "default"
    format: Literal["pcm16"] = "pcm16"


class StreamOptions(BaseModel):
    """`stream_options`; `include_usage` adds a last chunk with usage."""

    model_config = _STRICT
    include_usage: bool = False


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`: sampling fields apply to the text channel."""

    model: str
    messages: Annotated[list[ChatMessageIn], Field(min_length=1, max_length=MAX_MESSAGES)]
    modalities: Annotated[list[Literal["text", "audio"]], Field(min_length=1)] = ["text"]
    audio: AudioOutput | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: NewTokens | None = None
    max_completion_tokens: NewTokens | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.messages[-1].role != "user":
            raise ValueError("the last message must have role 'user'")
        _check_min_max(self.min_new_tokens, self.max_new_tokens)
        return self

    @property
    def max_new_tokens(self) -> int | None:
        """`max_completion_tokens` wins over the older `max_tokens`."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def max_new_tokens_field(self) -> str:
        """The field `max_new_tokens` came from, for errors about it."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    @property
    def wants_audio(self) -> bool:
        """True when the response should carry audio."""
        return "audio" in self.modalities


def _check_min_max(min_new_tokens: int | None, max_new_tokens: int | None) -> None:
    if min_new_tokens is not None and max_new_tokens is not None and min_new_tokens > max_new_tokens:
        raise ValueError(f"min_new_tokens ({min_new_tokens}) must not exceed max_new_tokens "
                         f"({max_new_tokens})")
