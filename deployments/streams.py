"""How each response format turns stream events into bytes (`StreamPlan`), one per request."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from deployments import framing
from deployments.schemas import ChatCompletionRequest, SpeechRequest
from vocoder.config import SAMPLE_RATE


@dataclass
class StreamPlan:
    """Framing of one streamed response; each method returns the bytes to write (b"" for nothing)."""

    media_type: str
    sample_rate: int = SAMPLE_RATE

    def start(self) -> bytes:
        """Bytes written right after the status line (e.g. the WAV header)."""
        return b""

    def audio(self, pcm: bytes) -> bytes:
        """One PCM16 chunk."""
        return pcm

    def text(self, text: str) -> bytes:
        """One text delta (speech responses drop text)."""
        return b""

    def done(self, event: dict[str, Any]) -> bytes:
        """The end of a successful stream."""
        return b""

    def error(self, event: dict[str, Any]) -> bytes:
        """A failure after the 200 status went out (raw audio can only stop short)."""
        return b""


@dataclass
class WavPlan(StreamPlan):
    """`response_format=wav`: streaming WAV header, then raw PCM16."""

    media_type: str = "audio/wav"

    def start(self) -> bytes:
        return framing.wav_header(self.sample_rate)


@dataclass
class SpeechSsePlan(StreamPlan):
    """`stream_format=sse`: `speech.audio.delta` events, then `speech.audio.done` with usage."""

    media_type: str = "text/event-stream"

    def audio(self, pcm: bytes) -> bytes:
        return framing.speech_delta(pcm)

    def done(self, event: dict[str, Any]) -> bytes:
        return framing.speech_done(framing.speech_usage(event))

    def error(self, event: dict[str, Any]) -> bytes:
        return framing.sse({"type": "error", "error": {
            "message": event["message"], "type": event["error_type"], "param": event["param"],
            "code": event["code"]}})


@dataclass
class ChatPlan(StreamPlan):
    """`chat.completion.chunk` events: role, text and audio deltas, finish, usage, `[DONE]`."""

    media_type: str = "text/event-stream"
    chunker: framing.ChatChunker | None = None
    include_usage: bool = False

    def start(self) -> bytes:
        assert self.chunker is not None
        return self.chunker.role()

    def audio(self, pcm: bytes) -> bytes:
        assert self.chunker is not None
        return self.chunker.audio(pcm)

    def text(self, text: str) -> bytes:
        assert self.chunker is not None
        return self.chunker.text(text) if text else b""

    def done(self, event: dict[str, Any]) -> bytes:
        assert self.chunker is not None
        reason = "length" if event["reason"] == "length" else "stop"
        usage = self.chunker.usage(event) if self.include_usage else b""
        return self.chunker.finish(reason) + usage + framing.DONE

    def error(self, event: dict[str, Any]) -> bytes:
        assert self.chunker is not None
        return self.chunker.error(event) + framing.DONE


@dataclass
class ChatCompletionPlan(StreamPlan):
    """`stream=false`: text and audio are collected; `done` yields the one `chat.completion` JSON body.
    A failure is kept in `failure` (and yields nothing), so the caller can answer with its HTTP status."""

    media_type: str = "application/json"
    chunker: framing.ChatChunker | None = None
    with_audio: bool = False
    failure: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self._text: list[str] = []
        self._pcm: list[bytes] = []

    def audio(self, pcm: bytes) -> bytes:
        self._pcm.append(pcm)
        return b""

    def text(self, text: str) -> bytes:
        self._text.append(text)
        return b""

    def done(self, event: dict[str, Any]) -> bytes:
        assert self.chunker is not None
        reason = "length" if event["reason"] == "length" else "stop"
        pcm = b"".join(self._pcm) if self.with_audio else None
        return self.chunker.completion("".join(self._text), pcm, reason, event)

    def error(self, event: dict[str, Any]) -> bytes:
        self.failure = event
        return b""


def speech_plan(req: SpeechRequest) -> StreamPlan:
    """The framing a speech request asked for."""
    if req.stream_format == "sse":
        return SpeechSsePlan()
    if req.response_format == "wav":
        return WavPlan()
    return StreamPlan(media_type="audio/pcm")


def chat_plan(req: ChatCompletionRequest, request_id: str, model: str) -> StreamPlan:
    """The framing of a chat completion: SSE chunks, or one JSON body with `stream=false`."""
    chunker = framing.ChatChunker(request_id, model, int(time.time()))
    if not req.stream:
        return ChatCompletionPlan(chunker=chunker, with_audio=req.wants_audio)
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return ChatPlan(chunker=chunker, include_usage=include_usage)
