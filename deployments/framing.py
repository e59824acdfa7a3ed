"""Byte framing of streamed responses: PCM16, the streaming WAV header, SSE events, chat chunks."""
from __future__ import annotations

import base64
import json
import struct
from typing import Any

import numpy as np

from vocoder.config import SAMPLE_RATE

# RIFF and data chunk sizes are unknown while streaming; 0xFFFFFFFF is the customary "unknown" value.
STREAMING_SIZE = 0xFFFFFFFF
WAV_HEADER_BYTES = 44


def wav_header(sample_rate: int = SAMPLE_RATE, num_channels: int = 1, bits_per_sample: int = 16) -> bytes:
    """A 44-byte PCM WAV header with streaming (unknown) lengths."""
    block_align = num_channels * bits_per_sample // 8
    return b"".join([
        b"RIFF", struct.pack("<I", STREAMING_SIZE), b"WAVE",
        b"fmt ", struct.pack("<IHHIIHH", 16, 1, num_channels, sample_rate, sample_rate * block_align,
                             block_align, bits_per_sample),
        b"data", struct.pack("<I", STREAMING_SIZE),
    ])


def pcm16_bytes(pcm: np.ndarray) -> bytes:
    """float PCM in [-1, 1] -> little-endian signed 16-bit bytes (values outside are clipped)."""
    scaled = np.rint(np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0) * 32767.0)
    return scaled.astype("<i2").tobytes()


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event carrying a JSON object (or a literal string such as `[DONE]`)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def b64(data: bytes) -> str:
    """Standard base64 text of raw bytes."""
    return base64.b64encode(data).decode("ascii")


def speech_delta(pcm: bytes) -> bytes:
    """`speech.audio.delta` SSE event."""
    return sse({"type": "speech.audio.delta", "audio": b64(pcm)})


def speech_done(usage: dict[str, Any]) -> bytes:
    """`speech.audio.done` SSE event with usage."""
    return sse({"type": "speech.audio.done", "usage": usage})


def speech_usage(done: dict[str, Any]) -> dict[str, int]:
    """OpenAI speech usage (input/output/total tokens) plus our audio counts, from a `done` event."""
    return {
        "input_tokens": done["num_prompt_tokens"],
        "output_tokens": done["num_generated_tokens"],
        "total_tokens": done["num_prompt_tokens"] + done["num_generated_tokens"],
        "cached_input_tokens": done["num_cached_prompt_tokens"],
        "audio_codes": done["num_audio_codes"],
        "audio_samples": done["num_audio_samples"],
    }


class ChatChunker:
    """Builds `chat.completion.chunk` SSE events for one streamed chat completion."""

    def __init__(self, completion_id: str, model: str, created: int) -> None:
        self.completion_id = completion_id
        self.model = model
        self.created = created
        self._audio_id = "audio_" + completion_id.removeprefix("chatcmpl-")

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None,
               usage: dict[str, Any] | None = None, with_choice: bool = True) -> bytes:
        body: dict[str, Any] = {"id": self.completion_id, "object": "chat.completion.chunk",
                                "created": self.created, "model": self.model,
                                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
                                if with_choice else []}
        if usage is not None:
            body["usage"] = usage
        return sse(body)

    def role(self) -> bytes:
        """The first chunk: `delta.role = "assistant"`."""
        return self._chunk({"role": "assistant", "content": ""})

    def text(self, text: str) -> bytes:
        """A text delta (`delta.content`)."""
        return self._chunk({"content": text})

    def audio(self, pcm: bytes) -> bytes:
        """An audio delta (`delta.audio.data`, base64 PCM16 at 24 kHz mono)."""
        return self._chunk({"audio": {"id": self._audio_id, "data": b64(pcm)}})

    def finish(self, finish_reason: str) -> bytes:
        """The last choice chunk with an empty delta and the finish reason."""
        return self._chunk({}, finish_reason=finish_reason)

    def usage(self, done: dict[str, Any]) -> bytes:
        """The `stream_options.include_usage` chunk: no choices, usage only."""
        return self._chunk({}, usage=chat_usage(done), with_choice=False)

    def completion(self, text: str, pcm: bytes | None, finish_reason: str, done: dict[str, Any]) -> bytes:
        """The whole `chat.completion` object of a non-streamed request (JSON, not SSE). With audio,
        `message.audio` holds all PCM16 (base64) and the text as `transcript`; nothing is stored for
        later turns, so `expires_at` is the creation time."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if pcm is not None:
            message["audio"] = {"id": self._audio_id, "data": b64(pcm), "transcript": text,
                                "expires_at": self.created}
        body = {"id": self.completion_id, "object": "chat.completion", "created": self.created,
                "model": self.model, "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
                "usage": chat_usage(done)}
        return json.dumps(body, separators=(",", ":")).encode()

    def error(self, event: dict[str, Any]) -> bytes:
        """A mid-stream error (after the 200 status was sent) as an `{"error": ...}` event."""
        return sse({"error": {"message": event["message"], "type": event["error_type"],
                              "param": event["param"], "code": event["code"]}})


def chat_usage(done: dict[str, Any]) -> dict[str, Any]:
    """OpenAI chat usage plus our audio counts, from a `done` event."""
    return {"prompt_tokens": done["num_prompt_tokens"], "completion_tokens": done["num_generated_tokens"],
            "total_tokens": done["num_prompt_tokens"] + done["num_generated_tokens"],
            "prompt_tokens_details": {"cached_tokens": done["num_cached_prompt_tokens"]},
            "audio_codes": done["num_audio_codes"], "audio_samples": done["num_audio_samples"]}


DONE = sse("[DONE]")
