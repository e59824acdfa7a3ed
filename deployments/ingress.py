"""`Ingress`: the HTTP edge (Starlette) of the app.

It validates a request without touching any model, opens ONE streaming call on the vocoder deployment
per utterance, peeks at the first item (so an engine refusal becomes a 4xx/503 before any byte is
sent) and then writes every audio chunk out the moment it arrives (no response buffering).
Server-side deadlines (`request_timeout_s`, `stream_idle_timeout_s`) bound every request; when the
client disconnects, Serve cancels the handler and the `finally` blocks down the chain abort the
engine request and close the vocoder session.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from deployments.args import AppArgs
from deployments.errors import ApiError, error_event, internal_error, timeout_error
from deployments.metrics import IngressMetrics
from deployments.streams import ChatCompletionPlan, StreamPlan, chat_plan, speech_plan
from deployments.validation import Limits, chat_request, speech_request

logger = logging.getLogger("ray.serve")

# path -> (route tag of moss_requests, allowed method)
ROUTES = {"/v1/audio/speech": ("speech", "POST"), "/v1/chat/completions": ("chat", "POST"),
          "/health": ("health", "GET"), "/v1/models": ("models", "GET"), "/admin/stats": ("admin", "GET")}
REQUESTS_PREFIX = "/admin/requests/"
MAX_REMEMBERED_REQUESTS = 1024
# Whether the request handled in this task was counted in moss_requests (a non-streamed chat's body runs
# inside the handler and counts itself): a handler cancelled by a disconnect counts a 499 only if not.
_COUNTED: ContextVar[bool] = ContextVar("moss_ingress_counted", default=False)


class Ingress:
    """Routes: POST /v1/audio/speech, POST /v1/chat/completions, GET /health, GET /v1/models,
    GET /admin/stats, GET /admin/requests/{id}."""

    def __init__(self, args: dict[str, Any], llm: Any, vocoder: Any) -> None:
        self._args = AppArgs.model_validate(args)
        self._llm = llm
        self._vocoder = vocoder
        self._metrics = IngressMetrics.create()
        self._limits: Limits | None = None
        self._num_active = 0
        # Summaries of recent requests (GET /admin/requests/{id}): one replica's memory only.
        self._recent: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._created = int(time.time())

    async def __call__(self, request: Request) -> Response:
        received_at = time.time()  # wall clock: the request's timeline (deployments/timeline.py)
        deadline = time.monotonic() + self._args.request_timeout_s  # the body's upload included
        _COUNTED.set(False)
        path, method = self._route_path(request), request.method
        route, expected = ROUTES.get(path, ("admin", "GET") if path.startswith(REQUESTS_PREFIX) else
                                     ("unknown", method))
        try:
            if route == "unknown":
                raise ApiError(404, f"no route {method} {path}", kind="not_found", code="not_found")
            if method != expected:
                raise ApiError(405, f"{method} is not allowed on {path}; use {expected}",
                               kind="invalid_request", code="method_not_allowed")
            if route == "speech":
                return await self._speech(request, received_at, deadline)
            if route == "chat":
                return await self._chat(request, received_at, deadline)
            response = await self._get(path, deadline)
        except asyncio.CancelledError:  # the client went away (Serve cancels the handler) before a response
            if not _COUNTED.get():
                self._count(route, 499, "disconnect")
            raise
        except ClientDisconnect:  # gone while its body was being read: nobody reads an answer
            self._count(route, 499, "disconnect")
            return Response(status_code=499)
        except ApiError as err:
            self._count(route, err.status, err.kind)
            return err.response()
        except Exception as exc:  # never a bare 500 page: an OpenAI-style error, logged
            logger.exception("request %s %s failed", method, path)
            err = internal_error(f"{type(exc).__name__}: {exc}")
            self._count(route, err.status, err.kind)
            return err.response()
        self._count(route, response.status_code)
        return response

    @staticmethod
    def _route_path(request: Request) -> str:
        """The path below the app's route prefix (Serve keeps the prefix in `path`, sets `root_path`)."""
        path, root = request.url.path, request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        return path.rstrip("/") or "/"

    async def _get(self, path: str, deadline: float) -> Response:
        if path == "/health":
            return JSONResponse({"status": "ok"})
        if path == "/v1/models":
            return JSONResponse({"object": "list", "data": [{
                "id": self._args.served_model_name, "object": "model", "created": self._created,
                "owned_by": "moss-speech-serve"}]})
        if path == "/admin/stats":
            llm, vocoder = await self._remote(asyncio.gather(self._llm.stats.remote(), self._vocoder.stats.remote()),
                                             deadline)
            return JSONResponse({"llm": llm, "vocoder": vocoder,
                                 "ingress": {"active_requests": self._num_active}})
        request_id = path.removeprefix(REQUESTS_PREFIX)
        if request_id not in self._recent:
            raise ApiError(404, f"no recent request {request_id!r} on this replica", kind="not_found",
                           code="not_found")
        return JSONResponse(self._recent[request_id])

    def _count(self, route: str, status: int, error_kind: str | None = None) -> None:
        _COUNTED.set(True)
        self._metrics.requests.inc(tags={"route": route, "status": str(status)})
        if error_kind is not None:
            self._metrics.errors.inc(tags={"kind": error_kind})

    async def _remote(self, awaitable: Any, deadline: float) -> Any:
        """The result of a call on another deployment (or of a stream's next event): an ApiError after
        `_within`'s deadlines (504; a replica's every call queues behind its `max_ongoing_requests` streams)
        or for a remote failure (`error_event`: Serve refusing the call is a 503); StopAsyncIteration passes."""
        try:
            return await self._within(awaitable, deadline)
        except TimeoutError:
            raise timeout_error("the request timed out on the server") from None
        except StopAsyncIteration:
            raise
        except Exception as exc:  # noqa: BLE001 - any remote failure becomes an HTTP error
            raise ApiError.from_event(error_event(exc, retry_after_s=self._args.retry_after_s)) from None

    async def _get_limits(self, deadline: float) -> Limits:
        if self._limits is None:  # voice names come from the vocoder replica once, then are cached
            voices = await self._remote(self._vocoder.voices.remote(), deadline)
            self._limits = Limits(
                served_model_name=self._args.served_model_name, voices=voices,
                max_input_chars=self._args.max_input_chars,
                max_new_tokens_limit=self._args.max_new_tokens_limit,
                default_max_new_tokens=self._args.default_max_new_tokens,
                max_input_audio_s=self._args.max_input_audio_s if self._args.speech_input else 0.0)
        return self._limits

    async def _read_body(self, request: Request, deadline: float) -> bytes:
        """The whole body; a 408 when a part of it is awaited longer than `stream_idle_timeout_s` or past the
        request's deadline (a stalled upload held a handler slot until the client closed)."""
        body = bytearray()  # appended in place: a body of megabytes arrives in many parts
        chunks = request.stream()
        while True:
            try:
                chunk = await self._within(anext(chunks), deadline)
            except StopAsyncIteration:
                return bytes(body)
            except TimeoutError:
                raise ApiError(408, "the request body was not received in time", kind="timeout",
                               code="request_timeout") from None
            body += chunk
            if len(body) > self._args.max_body_bytes:
                raise ApiError(413, f"request body exceeds {self._args.max_body_bytes} bytes",
                               kind="invalid_request", code="request_too_large")

    async def _speech(self, request: Request, received_at: float, deadline: float) -> Response:
        body, limits = await self._read_body(request, deadline), await self._get_limits(deadline)
        parsed, payload = speech_request(body, limits)
        return await self._stream("speech", payload, speech_plan(parsed), received_at, deadline)

    async def _chat(self, request: Request, received_at: float, deadline: float) -> Response:
        body, limits = await self._read_body(request, deadline), await self._get_limits(deadline)
        # off the event loop: speech input is decoded and resampled here (deployments/audio_input.py)
        parsed, payload = await asyncio.to_thread(chat_request, body, limits)
        plan = chat_plan(parsed, payload["request_id"], self._args.served_model_name)
        response = await self._stream("chat", payload, plan, received_at, deadline)
        if not isinstance(plan, ChatCompletionPlan):
            return response
        # stream=false: run the same body to its end here, then answer once (a failure keeps its status)
        body = b"".join([chunk async for chunk in response.body_iterator])
        if plan.failure is not None:  # answered here, not raised: the body has counted it already
            return ApiError.from_event(plan.failure).response()
        headers = {k: v for k, v in response.headers.items() if k in ("x-moss-request-id", "cache-control")}
        return Response(body, media_type=plan.media_type, headers=headers)

    async def _within(self, awaitable: Any, deadline: float) -> Any:
        """`awaitable`'s result, awaited no longer than `stream_idle_timeout_s` nor past `deadline`
        (TimeoutError). `asyncio.timeout`, not `wait_for`: on Python 3.11 `wait_for` returns the result and drops
        a cancel (the client's disconnect) that lands in the same loop iteration (CPython gh-86296)."""
        timeout = min(self._args.stream_idle_timeout_s, deadline - time.monotonic())
        async with asyncio.timeout(max(timeout, 0.0)):
            return await awaitable

    async def _next(self, stream: Any, deadline: float) -> dict[str, Any]:
        """The next event, or an ApiError after the idle timeout or the request deadline."""
        return await self._remote(anext(stream), deadline)

    async def _stream(self, route: str, payload: dict[str, Any], plan: StreamPlan, received_at: float,
                      deadline: float) -> Response:
        """Open the utterance stream, peek at its first event, then stream the response body."""
        # arrival on the monotonic clock (the deadline counts from it): first audio and the real-time factor
        # include the upload, the checks and speech input's decoding, as docs/metrics.md says
        started = deadline - self._args.request_timeout_s
        stream = self._vocoder.synthesize.options(stream=True).remote(payload)
        try:
            first = await self._next(stream, deadline)
        except BaseException:
            stream.cancel()
            raise
        if first["type"] == "error":
            raise ApiError.from_event(first)
        assert first["type"] == "started", first
        request_id = payload["request_id"]
        summary = {"request_id": request_id, "route": route, "status": "streaming",
                   "finish_reason": None, "num_audio_codes": None, "num_audio_samples": 0,
                   "num_prompt_tokens": None, "num_cached_prompt_tokens": None, "error": None,
                   "timeline": {"ingress_received": received_at}}
        self._remember(summary)
        body_started = [False]

        def abandon() -> None:  # the client went away before the body's first step: its `finally` never runs
            if not body_started[0]:
                stream.cancel()
                summary["status"] = 499
                self._count(route, 499, "disconnect")

        return _StreamingBody(self._body(route, stream, plan, summary, started, deadline, body_started),
                              abandon, media_type=plan.media_type,
                              headers={"x-moss-request-id": request_id, "cache-control": "no-store"})

    async def _body(self, route: str, stream: Any, plan: StreamPlan, summary: dict[str, Any],
                    started: float, deadline: float, body_started: list[bool]) -> AsyncIterator[bytes]:
        """Frame events as bytes; every audio chunk is yielded as soon as it is received."""
        body_started[0] = True
        self._num_active += 1
        status, error_kind = 499, "disconnect"  # unless we reach the end
        last_audio_at: float | None = None
        try:
            yield plan.start()
            while True:
                try:
                    event = await self._next(stream, deadline)
                except StopAsyncIteration:
                    break
                except ApiError as err:
                    event = err.to_event()
                if event["type"] == "audio":
                    now = time.monotonic()
                    if last_audio_at is None:
                        self._metrics.time_to_first_audio.observe(now - started)
                        summary["timeline"]["ingress_first_audio"] = time.time()
                    else:
                        self._metrics.chunk_gap.observe(now - last_audio_at)
                    last_audio_at = now
                    num_samples = len(event["pcm"]) // 2
                    summary["num_audio_samples"] += num_samples
                    self._metrics.audio_seconds.inc(num_samples / plan.sample_rate)
                    yield plan.audio(event["pcm"])
                elif event["type"] == "text":
                    chunk = plan.text(event["text"])
                    if chunk:
                        yield chunk
                elif event["type"] == "done":
                    summary.update({k: event[k] for k in ("num_audio_codes", "num_prompt_tokens",
                                                         "num_cached_prompt_tokens")})
                    summary["timeline"] = {**event.get("timeline", {}), **summary["timeline"]}
                    summary["finish_reason"] = event["reason"]
                    yield plan.done(event)
                    status, error_kind = 200, None
                    break
                elif event["type"] == "error":
                    logger.warning("stream %s failed mid-way: %s", summary["request_id"], event["message"])
                    status, error_kind = event["status"], event["kind"]
                    summary["error"] = {"kind": event["kind"], "message": event["message"]}
                    chunk = plan.error(event)
                    if chunk:
                        yield chunk
                    break
            audio_s = summary["num_audio_samples"] / plan.sample_rate
            if status == 200 and audio_s > 0:
                self._metrics.realtime_factor.observe((time.monotonic() - started) / audio_s)
        finally:
            self._num_active -= 1
            if status != 200:
                stream.cancel()  # also done by Serve on disconnect; harmless when already finished
            summary["status"] = status
            self._count(route, status, error_kind)

    def _remember(self, summary: dict[str, Any]) -> None:
        self._recent[summary["request_id"]] = summary
        while len(self._recent) > MAX_REMEMBERED_REQUESTS:
            self._recent.popitem(last=False)


class _StreamingBody(StreamingResponse):
    """A StreamingResponse that calls `abandon` once it is done, however it ended. Starlette may never start
    the body (the client gone while the response start is sent, or the disconnect listener winning first);
    a body generator that never started never runs its `finally`, so `abandon` releases what it would have
    (it does nothing when the body did start)."""

    def __init__(self, content: AsyncIterator[bytes], abandon: Any, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._abandon = abandon

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._abandon()
