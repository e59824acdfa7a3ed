"""The ingress' per-request summary (GET /admin/requests/{id}) when a stream ends, driven in process with a
scripted vocoder stream (no Ray): a failure mid-way keeps its kind and message, a finished one has none."""
from __future__ import annotations

import asyncio
from typing import Any

from serve_harness import app_args

from deployments.ingress import Ingress
from deployments.streams import StreamPlan

PCM = b"\x01\x00" * 4  # four samples


class ScriptedStream:
    """What `vocoder.synthesize.options(stream=True).remote(payload)` returns: these events, then the end."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = list(events)
        self.cancelled = False

    def __aiter__(self) -> ScriptedStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if not self.events:
            raise StopAsyncIteration
        return self.events.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


class ScriptedVocoder:
    def __init__(self, stream: ScriptedStream) -> None:
        self.stream = stream
        self.synthesize = self

    def options(self, **_: Any) -> ScriptedVocoder:
        return self

    def remote(self, payload: dict[str, Any]) -> ScriptedStream:
        return self.stream


def run(events: list[dict[str, Any]]) -> tuple[bytes, dict[str, Any], bool]:
    """(body bytes, the request's summary, whether the ingress cancelled the stream)."""
    stream = ScriptedStream([{"type": "started"}, *events])
    ingress = Ingress(app_args("tiny"), llm=None, vocoder=ScriptedVocoder(stream))

    async def body() -> bytes:
        response = await ingress._stream("speech", {"request_id": "r1"}, StreamPlan(media_type="audio/pcm"), 0.0)
        return b"".join([chunk async for chunk in response.body_iterator])

    data = asyncio.run(body())
    return data, ingress._recent["r1"], stream.cancelled


def test_a_failure_mid_way_is_kept_with_its_kind_and_message() -> None:
    data, summary, cancelled = run([
        {"type": "audio", "pcm": PCM},
        {"type": "error", "status": 500, "kind": "internal", "message": "OutOfMemoryError: CUDA out of memory"}])
    assert data == PCM  # the audio before the failure was sent; raw PCM has no room for an error
    assert (summary["status"], summary["finish_reason"], summary["num_audio_samples"]) == (500, None, 4)
    assert summary["error"] == {"kind": "internal", "message": "OutOfMemoryError: CUDA out of memory"}
    assert cancelled


def test_a_finished_stream_has_no_error() -> None:
    done = {"type": "done", "reason": "length", "num_audio_codes": 1, "num_prompt_tokens": 7,
            "num_cached_prompt_tokens": 0, "timeline": {}}
    data, summary, cancelled = run([{"type": "audio", "pcm": PCM}, done])
    assert data == PCM
    assert (summary["status"], summary["finish_reason"], summary["error"]) == (200, "length", None)
    assert not cancelled
