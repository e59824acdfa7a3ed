"""Request parsing and checks (no Ray, no model): each bad input maps to an exact 4xx error."""
from __future__ import annotations

import asyncio
import json

import pytest

from deployments.errors import ApiError
from deployments.validation import Limits, chat_request, speech_request
from runtime.prompts import READ_ALOUD_PROMPT

LIMITS = Limits(served_model_name="moss-speech", voices=["default", "warm"], max_input_chars=20,
                max_new_tokens_limit=100, default_max_new_tokens=50)


def speech(**fields: object) -> bytes:
    body = {"model": "moss-speech", "input": "hello", "voice": "default", **fields}
    return json.dumps({k: v for k, v in body.items() if v is not ...}).encode()


def error_of(call, body: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        call(body, LIMITS)
    return info.value


def test_speech_request_dict_carries_prompt_sampling_and_limits() -> None:
    req, payload = speech_request(speech(temperature=0.5, top_k=7, seed=3, max_new_tokens=40,
                                         min_new_tokens=10, response_format="pcm"), LIMITS)
    assert req.response_format == "pcm" and req.stream_format == "audio"
    assert payload["request_id"].startswith("speech-")
    assert payload["messages"] == [("system", READ_ALOUD_PROMPT), ("user", "hello")]
    assert payload["output_modality"] == "audio" and payload["with_audio"] is True
    assert payload["audio_sampling"] == {"temperature": 0.5, "top_k": 7}
    assert payload["text_sampling"] == {}
    assert (payload["max_new_tokens"], payload["min_new_tokens"], payload["seed"]) == (40, 10, 3)


def test_speech_instructions_extend_the_system_prompt() -> None:
    _, payload = speech_request(speech(instructions="Whisper."), LIMITS)
    assert payload["messages"][0] == ("system", f"{READ_ALOUD_PROMPT} Whisper.")
    assert error_of(speech_request, speech(instructions="w" * 21)).param == "instructions"


def test_speech_defaults() -> None:
    req, payload = speech_request(speech(voice=...), LIMITS)
    assert (req.voice, req.response_format, req.stream_format) == ("default", "wav", "audio")
    assert payload["max_new_tokens"] == 50 and payload["min_new_tokens"] == 0 and payload["seed"] is None


@pytest.mark.parametrize(("body", "status", "param", "fragment"), [
    (b"{not json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "must be a JSON object"),
    # 20k nested arrays (40 KB, under the body limit) exhaust the parser's recursion: a 400, not a 500
    (b'{"model": "moss-speech", "input": "hi", "x": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", 400, None,
     "nests arrays or objects too deeply"),
    (b'{"model": "moss-speech", "input": "hi", "temperature": NaN}', 400, None, "non-finite number NaN"),
    (b'{"model": "moss-speech", "input": "hi", "top_p": Infinity}', 400, None, "non-finite number Infinity"),
    (speech(input=...), 400, "input", "Field required"),
    (speech(input=""), 400, "input", "at least 1 character"),
    (speech(input="   "), 400, None, "non-whitespace"),
    (speech(input=5), 400, "input", "valid string"),
    (speech(temperature="0.5"), 400, "temperature", "valid number"),
    (speech(temperature=2.5), 400, "temperature", "less than or equal to 2"),
    (speech(top_p=0), 400, "top_p", "greater than 0"),
    (speech(top_k=1.5), 400, "top_k", "valid integer"),
    (speech(top_k=-1), 400, "top_k", "greater than or equal to 0"),
    (speech(repetition_penalty=0), 400, "repetition_penalty", "greater than or equal to 0.01"),
    (speech(repetition_penalty=1e-40), 400, "repetition_penalty", "greater than or equal to 0.01"),
    (speech(seed=-1), 400, "seed", "greater than or equal to 0"),
    (speech(max_new_tokens=0), 400, "max_new_tokens", "greater than or equal to 1"),
    (speech(max_new_tokens=101), 400, "max_new_tokens", "must be <= 100"),
    (speech(min_new_tokens=60), 400, "min_new_tokens", "must not exceed max_new_tokens (50)"),
    (speech(min_new_tokens=9, max_new_tokens=8), 400, None, "min_new_tokens (9) must not exceed"),
    (speech(voice="nobody"), 400, "voice", "unknown voice 'nobody'; available voices: default, warm"),
    (speech(response_format="mp3"), 400, "response_format", "'wav' or 'pcm'"),
    (speech(stream_format="chunks"), 400, "stream_format", "'audio' or 'sse'"),
    (speech(speed=1.5), 400, None, "speed must be 1.0"),
    (speech(input="x" * 21), 400, "input", "21 characters long; the limit is 20"),
    (speech(model="tts-1"), 404, "model", "'tts-1' does not exist"),
    (speech(instructions="calm \udc00"), 400, "instructions", "instructions: text holds a lone UTF-16 surrogate"),
    (speech(input="hi \ud83d"), 400, "input", "input: Input should be a valid string, unable to parse raw data"),
])
def test_bad_speech_input_is_a_4xx(body: bytes, status: int, param: str | None, fragment: str) -> None:
    err = error_of(speech_request, body)
    assert err.status == status
    assert err.param == param
    assert fragment in err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_a_body_of_too_many_json_values_is_refused_before_it_is_parsed() -> None:
    """The bound is MAX_JSON_ITEMS plus the request's most text (max_input_chars, 20 here, for each of speech's
    input and instructions) in commas, brackets and braces, counted in the raw bytes: 8 MiB of empty lists in
    an ignored field held the event loop for seconds when it was parsed and walked. Fields the schema ignores
    are not read otherwise, so a lone surrogate in one is no error."""
    from deployments.validation import MAX_JSON_ITEMS

    head = b'{"model": "moss-speech", "input": "a, b", "x": ['  # 5 counted, then 2 per "[]," and 1 for "[]]}"
    fits = head + b"[]," * ((MAX_JSON_ITEMS + 40 - 6) // 2) + b"[]]}"  # speech: input and instructions, 2 x 20
    assert sum(map(fits.count, (b",", b"[", b"{"))) == MAX_JSON_ITEMS + 40
    assert speech_request(fits, LIMITS)[1]["messages"][1] == ("user", "a, b")
    over = fits.replace(b'"a, b"', b'"a,,b"')
    err = error_of(speech_request, over)
    assert (err.status, err.code, err.param) == (400, "request_too_complex", None)
    assert err.message == (f"request body holds {MAX_JSON_ITEMS + 41} commas, brackets and braces; at most "
                           f"{MAX_JSON_ITEMS + 40} are accepted")
    # the most text a speech request may carry, all commas, with a limit above MAX_JSON_ITEMS
    commas = speech(input="," * 70_000, instructions="," * 70_000)
    wide = Limits(served_model_name="moss-speech", voices=["default"], max_input_chars=70_000,
                  max_new_tokens_limit=100, default_max_new_tokens=50)
    assert speech_request(commas, wide)[0].input == "," * 70_000
    assert error_of(chat_request, b'{"messages": [' + b"{}," * 40_000 + b"{}]}").code == "request_too_complex"
    ignored = b'{"model": "moss-speech", "input": "hi", "\\ud800": "\\udc00", "x": {"y": ["\\ud83d"]}}'
    assert speech_request(ignored, LIMITS)[1]["messages"][1] == ("user", "hi")


def chat(messages: object = ..., **fields: object) -> bytes:
    if messages is ...:
        messages = [{"role": "user", "content": "hi"}]
    body = {"model": "moss-speech", "messages": messages, "stream": True, **fields}
    return json.dumps({k: v for k, v in body.items() if v is not ...}).encode()


def test_chat_request_dict_keeps_turns_in_order() -> None:
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": [{"type": "text", "text": "he"}, {"type": "text", "text": "llo"}]},
             {"role": "user", "content": "again"}]
    req, payload = chat_request(chat(turns, modalities=["text", "audio"], audio={"voice": "warm",
                                                                                 "format": "pcm16"},
                                     max_tokens=30, temperature=0.0), LIMITS)
    assert req.wants_audio
    assert payload["messages"] == [("system", "be brief"), ("user", "hi"), ("assistant", "hello"),
                                   ("user", "again")]
    assert payload["output_modality"] == "audio" and payload["voice"] == "warm"
    assert payload["text_sampling"] == {"temperature": 0.0} and payload["max_new_tokens"] == 30
    assert payload["prompt_param"] == "messages"  # a too-long prompt's 400 names the chat's field
    _, text_only = chat_request(chat(), LIMITS)
    assert text_only["output_modality"] == "text" and text_only["with_audio"] is False


@pytest.mark.parametrize(("body", "param", "fragment"), [
    (chat([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA",
                                                                                  "format": "wav"}}]}]),
     "messages.0.content.0.input_audio.data", "input audio (format 'wav') could not be decoded"),
    (chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages.0.content.0", "unsupported content part type 'image_url'"),
    (chat([{"role": "user", "content": [{"type": ["text"], "text": "x"}]}]),
     "messages.0.content.0", "unsupported content part type ['text']"),
    (chat([{"role": "user", "content": [{"text": "x"}]}]), "messages.0.content.0", "unsupported content part type None"),
    (chat([]), "messages", "at least 1 item"),
    (chat([{"role": "robot", "content": "hi"}]), "messages.0.role", "'system', 'developer'"),
    (chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]), None,
     "last message must have role 'user'"),
    (chat(modalities=["video"]), "modalities.0", "'text' or 'audio'"),
    (chat(modalities=["audio"], audio={"voice": "nobody"}), "audio.voice", "unknown voice 'nobody'"),
    (chat(modalities=["audio"], audio={"format": "mp3"}), "audio.format", "'pcm16'"),
    (chat([{"role": "user", "content": "y" * 21}]), "messages", "21 characters long"),
    (chat(max_tokens=101), "max_tokens", "max_tokens must be <= 100, got 101"),  # the field the client sent
    (chat(max_tokens=5, max_completion_tokens=101), "max_completion_tokens", "max_completion_tokens must be <= 100"),
    (chat(n=2), "n", "less than or equal to 1"),
    (chat([{"role": "user", "content": "hi"}] * 1025), "messages", "at most 1024 items after validation, not 1025"),
    (chat([{"role": "user", "content": "hi \ud83d"}]), "messages.0.content", "lone UTF-16 surrogate"),
    (chat([{"role": "system", "content": "x"}, {"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]),
     "messages.1.content.0.text", "lone UTF-16 surrogate"),
])
def test_bad_chat_input_is_a_400(body: bytes, param: str | None, fragment: str) -> None:
    err = error_of(chat_request, body)
    assert err.status == 400
    assert err.param == param
    assert fragment in err.message


def test_error_response_is_openai_shaped_with_retry_after() -> None:
    from deployments.errors import error_event, overloaded
    from runtime.errors import ContextLengthExceededError, EngineOverloadedError

    response = overloaded("busy", 2.2).response()
    assert response.status_code == 503 and response.headers["retry-after"] == "3"
    assert json.loads(response.body) == {"error": {"message": "busy", "type": "server_overloaded_error",
                                                   "param": None, "code": "server_overloaded"}}
    event = error_event(EngineOverloadedError("queue full", retry_after_s=0.5))
    assert ApiError.from_event(event).response().headers["retry-after"] == "1"
    event = error_event(ContextLengthExceededError("too long"))
    assert (event["status"], event["code"], event["kind"]) == (400, "context_length_exceeded", "context_length")
    assert ApiError.from_event(event).param == "input"  # speech's prompt field
    assert ApiError.from_event(error_event(ContextLengthExceededError("too long"), prompt_param="messages")).param \
        == "messages"
    assert error_event(RuntimeError("boom"))["status"] == 500
    from ray.serve.exceptions import BackPressureError

    event = error_event(BackPressureError(num_queued_requests=9, max_queued_requests=8), retry_after_s=2.0)
    assert (event["status"], event["code"], event["retry_after_s"]) == (503, "server_overloaded", 2.0)
    # Serve's own hint, where the handle's config gives one, wins over the app's
    hinted = BackPressureError(num_queued_requests=9, max_queued_requests=8, retry_after_s=6.0)
    assert error_event(hinted, retry_after_s=2.0)["retry_after_s"] == 6.0


def test_the_llm_deployment_over_capacity_is_a_503_with_the_apps_retry_after() -> None:
    """VocoderServer's first LLM event is Serve refusing the call: the error event it yields carries the
    app's `retry_after_s` (its constructor argument), not a fixed second."""
    from types import SimpleNamespace

    from ray.serve.exceptions import BackPressureError

    from deployments.vocoder_server import VocoderServer

    class Refused:
        def __aiter__(self) -> Refused:
            return self

        async def __anext__(self) -> dict:
            raise BackPressureError(num_queued_requests=4, max_queued_requests=4)

        def cancel(self) -> None:
            pass

    llm = SimpleNamespace(generate=SimpleNamespace(options=lambda **_: SimpleNamespace(remote=lambda _: Refused())))
    server = object.__new__(VocoderServer)
    server._llm, server._retry_after_s = llm, 7.0
    events = asyncio.run(_collect(server.synthesize({"request_id": "r", "with_audio": False, "voice": "default"})))
    assert [(e["type"], e["status"], e["retry_after_s"]) for e in events] == [("error", 503, 7.0)]


async def _collect(stream) -> list[dict]:
    return [event async for event in stream]


def test_an_unhealthy_engine_is_a_503_and_fails_the_replicas_health_check() -> None:
    from types import SimpleNamespace

    from deployments.errors import error_event
    from deployments.llm_server import LLMServer
    from runtime.errors import EngineUnhealthyError

    event = error_event(EngineUnhealthyError("the engine cannot serve: a step has run for 61 s"), retry_after_s=2.0)
    assert (event["status"], event["code"], event["retry_after_s"], event["message"]) == (
        503, "server_overloaded", 2.0, "server unavailable: the engine cannot serve: a step has run for 61 s")

    def unhealthy() -> None:
        raise EngineUnhealthyError("3 steps in a row failed (max_consecutive_step_failures 3)")

    server = object.__new__(LLMServer)
    server._engine = SimpleNamespace(check_health=unhealthy)
    with pytest.raises(EngineUnhealthyError, match="3 steps in a row failed"):
        server.check_health()
    server._engine = SimpleNamespace(check_health=lambda: None)
    server.check_health()
