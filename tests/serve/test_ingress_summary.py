"""The ingress' per-request summary (GET /admin/requests/{id}) and its request counts when a stream ends,
driven in process with a scripted vocoder stream (no Ray): a failure mid-way keeps its kind and message, a
finished one has none, a body the client never let start is released and counted, a non-streamed chat
failure is counted once, a vocoder deployment over capacity is a 503, and the unary calls on the other
deployments (the voice lookup, /admin/stats) are bounded by the request's deadlines."""
from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any

import pytest
from serve_harness import app_args
from starlette.requests import ClientDisconnect, Request

from deployments.ingress import Ingress
from deployments.streams import StreamPlan

PCM = b"\x01\x00" * 4  # four samples
HOLD = {"type": "hold"}  # a scripted stream reaching this waits until cancelled (a long prefill)
GATE = {"type": "gate"}  # a scripted stream reaching this returns what the test sets on its `gate` future


class ScriptedStream:
    """What `vocoder.synthesize.options(stream=True).remote(payload)` returns: these events, then the end."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = list(events)
        self.cancelled = False
        self.holding = asyncio.Event()

    def __aiter__(self) -> ScriptedStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if not self.events:
            raise StopAsyncIteration
        event = self.events.pop(0)
        if event is HOLD:
            self.holding.set()
            await asyncio.get_running_loop().create_future()  # until the task is cancelled
        if event is GATE:
            self.gate = asyncio.get_running_loop().create_future()
            self.holding.set()
            return await self.gate
        return event

    def cancel(self) -> None:
        self.cancelled = True


class Unary:
    """A handle method answering once: `value`, or `error` raised, or (`hang`) nothing until cancelled."""

    def __init__(self, value: Any, error: Exception | None = None, hang: bool = False) -> None:
        self.value, self.error, self.hang = value, error, hang

    async def remote(self) -> Any:
        if self.hang:
            await asyncio.get_running_loop().create_future()
        if self.error is not None:
            raise self.error
        return self.value


class Counter:
    def __init__(self) -> None:
        self.calls: list[dict[str, str] | None] = []

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self.calls.append(tags)

    def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
        pass


class ScriptedVocoder:
    def __init__(self, stream: ScriptedStream, voices_error: Exception | None = None, voices_hang: bool = False) -> None:
        self.stream = stream
        self.synthesize = self
        self.voices = Unary(["default"], voices_error, voices_hang)
        self.stats = Unary({"open_sessions": 0})

    def options(self, **_: Any) -> ScriptedVocoder:
        return self

    def remote(self, payload: dict[str, Any]) -> ScriptedStream:
        return self.stream


def run(events: list[dict[str, Any]]) -> tuple[bytes, dict[str, Any], bool]:
    """(body bytes, the request's summary, whether the ingress cancelled the stream)."""
    stream = ScriptedStream([{"type": "started"}, *events])
    ingress = Ingress(app_args("tiny"), llm=None, vocoder=ScriptedVocoder(stream))

    async def body() -> bytes:
        response = await ingress._stream("speech", {"request_id": "r1"}, StreamPlan(media_type="audio/pcm"), 0.0,
                                         time.monotonic() + 60)
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


def counted_ingress(events: list[dict[str, Any]], voices_error: Exception | None = None, voices_hang: bool = False,
                    **args: Any) -> tuple[Ingress, ScriptedStream, Counter, Counter]:
    """An Ingress (AppArgs `args`) over a scripted stream, counting its requests and errors."""
    stream = ScriptedStream([{"type": "started"}, *events])
    llm = SimpleNamespace(stats=Unary({"running": 0}))
    ingress = Ingress(app_args("tiny") | args, llm=llm, vocoder=ScriptedVocoder(stream, voices_error, voices_hang))
    requests, errors = Counter(), Counter()
    ingress._metrics = SimpleNamespace(requests=requests, errors=errors, time_to_first_audio=Counter(),
                                       chunk_gap=Counter(), realtime_factor=Counter(), audio_seconds=Counter())
    return ingress, stream, requests, errors


def post(path: str, payload: dict[str, Any]) -> Request:
    body = json.dumps(payload).encode()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "server": ("127.0.0.1", 8000),
             "scheme": "http", "http_version": "1.1"}
    return Request(scope, receive)


def test_a_body_the_client_never_let_start_is_released_and_counted() -> None:
    """The client is gone when the response start is sent: Starlette never iterates the body, whose own
    `finally` would have cancelled the vocoder stream and counted the request."""
    ingress, stream, requests, errors = counted_ingress([{"type": "audio", "pcm": PCM}])

    async def main() -> None:
        response = await ingress._stream("speech", {"request_id": "r1"}, StreamPlan(media_type="audio/pcm"), 0.0,
                                         time.monotonic() + 60)

        async def send(message: dict[str, Any]) -> None:
            raise OSError("client gone")

        async def receive() -> dict[str, Any]:
            return {"type": "http.disconnect"}

        with pytest.raises(ClientDisconnect):
            await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)

    asyncio.run(main())
    assert stream.cancelled and ingress._recent["r1"]["status"] == 499
    assert (requests.calls, errors.calls) == ([{"route": "speech", "status": "499"}], [{"kind": "disconnect"}])
    assert ingress._num_active == 0


def test_a_non_streamed_chat_failure_is_counted_once() -> None:
    failure = {"type": "error", "status": 500, "message": "generation failed: boom", "kind": "internal",
               "error_type": "server_error", "param": None, "code": "internal_error", "retry_after_s": None}
    ingress, _, requests, errors = counted_ingress([{"type": "text", "text": "hi"}, failure])
    response = asyncio.run(ingress(post("/v1/chat/completions", {
        "model": "moss-speech", "messages": [{"role": "user", "content": "hello"}]})))
    assert response.status_code == 500
    assert json.loads(response.body)["error"]["message"] == "generation failed: boom"
    assert (requests.calls, errors.calls) == ([{"route": "chat", "status": "500"}], [{"kind": "internal"}])


def test_a_vocoder_deployment_over_capacity_at_the_voice_lookup_is_a_503() -> None:
    """The first request of a new ingress replica looks the voices up; Serve refusing that call is a 503 with
    the app's Retry-After, not a 500."""
    from ray.serve.exceptions import BackPressureError

    ingress, _, requests, _ = counted_ingress(
        [], retry_after_s=4.0, voices_error=BackPressureError(num_queued_requests=5, max_queued_requests=5))
    response = asyncio.run(ingress(post("/v1/audio/speech", {"model": "moss-speech", "input": "hi"})))
    assert (response.status_code, response.headers["retry-after"]) == (503, "4")
    assert json.loads(response.body)["error"]["code"] == "server_overloaded"
    assert requests.calls == [{"route": "speech", "status": "503"}]


def get(path: str) -> Request:
    scope = {"type": "http", "method": "GET", "path": path, "root_path": "", "query_string": b"", "headers": [],
             "server": ("127.0.0.1", 8000), "scheme": "http", "http_version": "1.1"}
    return Request(scope)


def test_a_voice_lookup_that_never_answers_is_a_504_after_the_idle_timeout() -> None:
    """The lookup queues behind the vocoder replica's streams (every call takes a slot of its
    max_ongoing_requests): it is bounded like any other wait of the request."""
    ingress, stream, requests, errors = counted_ingress([], voices_hang=True, stream_idle_timeout_s=0.05)
    response = asyncio.run(asyncio.wait_for(ingress(post("/v1/audio/speech", SPEECH)), 10))  # a hang fails
    assert response.status_code == 504 and json.loads(response.body)["error"]["code"] == "timeout"
    assert (requests.calls, errors.calls) == ([{"route": "speech", "status": "504"}], [{"kind": "timeout"}])
    assert stream.events == [{"type": "started"}]  # no stream was opened


def test_admin_stats_answers_and_is_bounded_like_a_request() -> None:
    from ray.serve.exceptions import BackPressureError

    ingress, _, requests, _ = counted_ingress([], stream_idle_timeout_s=0.05, retry_after_s=4.0)
    response = asyncio.run(ingress(get("/admin/stats")))
    assert response.status_code == 200 and json.loads(response.body) == {
        "llm": {"running": 0}, "vocoder": {"open_sessions": 0}, "ingress": {"active_requests": 0}}
    ingress._vocoder.stats = Unary(None, hang=True)
    assert asyncio.run(asyncio.wait_for(ingress(get("/admin/stats")), 10)).status_code == 504  # a hang fails
    ingress._vocoder.stats = Unary(None, BackPressureError(num_queued_requests=5, max_queued_requests=5))
    response = asyncio.run(ingress(get("/admin/stats")))
    assert (response.status_code, response.headers["retry-after"]) == (503, "4")
    assert requests.calls == [{"route": "admin", "status": status} for status in ("200", "504", "503")]


def _post_raw(path: str, receive: Any) -> Request:
    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "server": ("127.0.0.1", 8000),
             "scheme": "http", "http_version": "1.1"}
    return Request(scope, receive)


SPEECH = {"model": "moss-speech", "input": "hi"}
CHAT = {"model": "moss-speech", "messages": [{"role": "user", "content": "hello"}]}


@pytest.mark.parametrize(("path", "payload", "events", "route"), [
    ("/v1/audio/speech", SPEECH, [], "speech"),  # gone while the first event is awaited (queued, prefilling)
    ("/v1/chat/completions", {**CHAT, "stream": True}, [], "chat"),
    # stream=false: the body runs inside the handler and counts its own 499
    ("/v1/chat/completions", CHAT, [{"type": "text", "text": "hi"}], "chat"),
])
def test_a_handler_cancelled_by_a_disconnect_is_counted_once_as_499(path: str, payload: dict, events: list,
                                                                    route: str) -> None:
    ingress, stream, requests, errors = counted_ingress([*events, HOLD])
    if not events:  # the hold comes before "started": the peek waits
        stream.events = [HOLD]

    async def main() -> None:
        task = asyncio.ensure_future(ingress(post(path, payload)))
        await stream.holding.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert stream.cancelled and ingress._num_active == 0
    assert (requests.calls, errors.calls) == ([{"route": route, "status": "499"}], [{"kind": "disconnect"}])


def test_a_disconnect_in_the_loop_iteration_of_an_event_still_ends_the_request() -> None:
    """The event arrives and the handler is cancelled in one loop iteration. Python 3.11's `asyncio.wait_for`
    returned the event and dropped the cancel, so a non-streamed chat read its stream to the end and kept the
    engine's sequence and the vocoder's session all that time."""
    rest = [{"type": "text", "text": "b"}, {"type": "done", "reason": "stop", "num_audio_codes": 0,
                                           "num_prompt_tokens": 3, "num_cached_prompt_tokens": 0, "timeline": {}}]
    ingress, stream, requests, errors = counted_ingress([{"type": "text", "text": "a"}, GATE, *rest])

    async def main() -> None:
        task = asyncio.ensure_future(ingress(post("/v1/chat/completions", CHAT)))
        await stream.holding.wait()
        stream.gate.set_result({"type": "text", "text": "c"})
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert stream.cancelled and ingress._num_active == 0 and stream.events == rest  # nothing read after it
    assert (requests.calls, errors.calls) == ([{"route": "chat", "status": "499"}], [{"kind": "disconnect"}])


def test_first_audio_and_the_real_time_factor_count_from_arrival_with_the_upload() -> None:
    """docs/metrics.md: both histograms start at the request's arrival. They started after the body was read
    and checked, so a slow upload or a long clip's decoding did not count."""
    ingress, _, requests, errors = counted_ingress([
        {"type": "audio", "pcm": PCM * 6000},  # 24000 samples: 1 s of audio
        {"type": "done", "reason": "stop", "num_audio_codes": 13, "num_prompt_tokens": 3,
         "num_cached_prompt_tokens": 0, "timeline": {}}])
    first_audio, factors = [], []
    ingress._metrics.time_to_first_audio = SimpleNamespace(observe=lambda value, tags=None: first_audio.append(value))
    ingress._metrics.realtime_factor = SimpleNamespace(observe=lambda value, tags=None: factors.append(value))
    body = json.dumps(SPEECH | {"response_format": "pcm"}).encode()
    parts = [{"type": "http.request", "body": body[:10], "more_body": True},
             {"type": "http.request", "body": body[10:], "more_body": False}]

    async def receive() -> dict[str, Any]:
        if len(parts) == 1:
            await asyncio.sleep(0.3)  # the rest of the upload comes 0.3 s later
        return parts.pop(0) if parts else {"type": "http.disconnect"}

    async def main() -> bytes:
        response = await ingress(_post_raw("/v1/audio/speech", receive))
        return b"".join([chunk async for chunk in response.body_iterator])

    assert asyncio.run(main()) == PCM * 6000
    assert len(first_audio) == len(factors) == 1
    assert first_audio[0] >= 0.3 and factors[0] >= 0.3  # 1 s of audio: the factor is seconds taken
    assert (requests.calls, errors.calls) == ([{"route": "speech", "status": "200"}], [])


def test_a_client_gone_during_the_upload_is_a_499_not_a_500() -> None:
    ingress, stream, requests, errors = counted_ingress([])
    parts = [{"type": "http.request", "body": b'{"model": "moss', "more_body": True}, {"type": "http.disconnect"}]

    async def receive() -> dict[str, Any]:
        return parts.pop(0)

    response = asyncio.run(ingress(_post_raw("/v1/audio/speech", receive)))
    assert response.status_code == 499 and stream.events == [{"type": "started"}]  # no deployment was called
    assert (requests.calls, errors.calls) == ([{"route": "speech", "status": "499"}], [{"kind": "disconnect"}])


def test_a_stalled_upload_is_a_408_after_the_idle_timeout() -> None:
    ingress, stream, requests, errors = counted_ingress([], stream_idle_timeout_s=0.05)
    parts = [{"type": "http.request", "body": b'{"model": "moss', "more_body": True}]

    async def receive() -> dict[str, Any]:
        if parts:
            return parts.pop(0)
        return await asyncio.get_running_loop().create_future()  # the rest never comes

    response = asyncio.run(ingress(_post_raw("/v1/audio/speech", receive)))
    assert response.status_code == 408
    assert json.loads(response.body)["error"] == {
        "message": "the request body was not received in time", "type": "invalid_request_error", "param": None,
        "code": "request_timeout"}
    assert (requests.calls, errors.calls) == ([{"route": "speech", "status": "408"}], [{"kind": "timeout"}])
    assert not stream.cancelled and stream.events == [{"type": "started"}]  # no deployment was called
