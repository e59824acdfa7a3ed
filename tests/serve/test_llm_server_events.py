"""`LLMServer.generate` ends every stream with `finished` only for a normal end ("stop", "length"); a request
the engine ended otherwise becomes one `error` event, so that the ingress answers its status before the 200
or an error event after it, never a cut-short answer framed as whole."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from deployments import llm_server
from deployments.llm_server import LLMServer
from runtime.request import AudioCodes, Finished, Timeline


class _Window:
    def add(self, value: float) -> None:
        pass


class _Histogram:
    def observe(self, value: float) -> None:
        pass


def _server(events: list) -> tuple[LLMServer, list[str]]:
    aborted: list[str] = []

    async def stream():
        for event in events:
            yield event

    server = object.__new__(LLMServer)
    server._engine = SimpleNamespace(generate=lambda request, **kw: stream(), abort=aborted.append)
    server._ttfa = _Window()
    server._metrics = SimpleNamespace(time_to_first_code=_Histogram())
    return server, aborted


def _finished(reason: str, *, scheduled: bool, error: str | None = None) -> Finished:
    return Finished(reason, 5, 3 if scheduled else 0, 2 if scheduled else 0, 0, error,
                    Timeline(100.0, 100.5 if scheduled else None, ()))


def _run(server: LLMServer) -> list[dict]:
    async def collect() -> list[dict]:
        return [event async for event in server.generate({"request_id": "r1"})]

    return asyncio.run(collect())


@pytest.fixture(autouse=True)
def _no_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llm_server, "build_generation_request", lambda engine, request: request)


@pytest.mark.parametrize(("events", "expected"), [
    # a step failed after the request ran: its codes went out, then a 500
    ([AudioCodes((7, 8)), _finished("error", scheduled=True, error="engine step failed: RuntimeError('oom')")],
     [("codes", None, None), ("error", 500, "generation failed: engine step failed: RuntimeError('oom')")]),
    # failed on its first step, known before any byte: a 500 the ingress answers in place of the 200
    ([_finished("error", scheduled=True, error="engine step failed: RuntimeError('oom')")],
     [("error", 500, "generation failed: engine step failed: RuntimeError('oom')")]),
    # expired in the queue, never scheduled: a 503 to retry
    ([_finished("error", scheduled=False, error="request waited more than 300 s in the queue")],
     [("error", 503, "generation not started: request waited more than 300 s in the queue")]),
    # the replica shut down mid-stream
    ([AudioCodes((7,)), _finished("abort", scheduled=True)],
     [("codes", None, None), ("error", 503, "generation aborted: the LLM replica is shutting down")]),
])
def test_an_abnormal_end_is_one_error_event(events: list, expected: list) -> None:
    server, aborted = _server(events)
    got = _run(server)
    assert [(e["type"], e.get("status"), e.get("message")) for e in got] == expected
    assert got[-1]["retry_after_s"] == (1.0 if expected[-1][1] == 503 else None)
    assert aborted == []  # the engine ended the request itself: nothing left to abort


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_a_normal_end_is_a_finished_event(reason: str) -> None:
    server, aborted = _server([AudioCodes((1, 2, 3)), _finished(reason, scheduled=True)])
    got = _run(server)
    assert [e["type"] for e in got] == ["codes", "finished"]
    assert (got[1]["reason"], got[1]["num_audio_codes"], got[1]["timeline"]["engine_first_scheduled"]) == (
        reason, 2, 100.5)
    assert aborted == []


def test_a_prompt_the_builder_refuses_is_a_400_but_a_server_side_value_error_is_a_500(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from deployments.errors import error_event

    def refuse(engine: object, request: dict) -> None:
        raise ValueError("message text holds the control token '<|im_start|>'")

    monkeypatch.setattr(llm_server, "build_generation_request", refuse)
    server, _ = _server([])
    got = _run(server)
    assert [(e["type"], e["status"], e["code"], e["message"]) for e in got] == [
        ("error", 400, "invalid_value", "message text holds the control token '<|im_start|>'")]
    # a ValueError from anywhere else is a fault of the server, not of the request
    event = error_event(ValueError("lane must be in [0, 2), got 3"))
    assert (event["status"], event["code"], event["message"]) == (
        500, "internal_error", "ValueError: lane must be in [0, 2), got 3")


@pytest.mark.parametrize(("request_fields", "param"), [({}, "input"), ({"prompt_param": "messages"}, "messages")])
def test_a_prompt_too_long_names_the_field_it_came_from(monkeypatch: pytest.MonkeyPatch, request_fields: dict,
                                                        param: str) -> None:
    """Speech's prompt is its `input`; chat's is its `messages` (the ingress says which in `prompt_param`)."""
    from runtime.errors import ContextLengthExceededError

    server, _ = _server([])

    def refuse(request: object, **kwargs: object) -> None:
        raise ContextLengthExceededError("prompt (4109 rows) + max_new_tokens (8) = 4117 exceeds max_model_len (4096)")

    server._engine.generate = refuse

    async def collect() -> list[dict]:
        return [event async for event in server.generate({"request_id": "r1", **request_fields})]

    (event,) = asyncio.run(collect())
    assert (event["type"], event["status"], event["code"], event["param"]) == (
        "error", 400, "context_length_exceeded", param)
