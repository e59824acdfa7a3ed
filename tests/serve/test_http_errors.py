"""Every bad input gets its 4xx OpenAI-style error over real HTTP, and none of them reaches a model."""
from __future__ import annotations

import httpx
import pytest

GOOD = {"model": "moss-speech", "input": "hi", "voice": "default"}
CHAT = {"model": "moss-speech", "stream": True, "messages": [{"role": "user", "content": "hi"}]}

BAD_REQUESTS = [
    # (path, raw body or JSON, status, param, message fragment)
    ("/v1/audio/speech", b'{"model": "moss-speech", "input": ', 400, None, "not valid JSON"),
    ("/v1/audio/speech", b'"just a string"', 400, None, "must be a JSON object"),
    ("/v1/audio/speech", {"model": "moss-speech"}, 400, "input", "Field required"),
    ("/v1/audio/speech", {**GOOD, "input": ""}, 400, "input", "at least 1 character"),
    ("/v1/audio/speech", {**GOOD, "input": ["hi"]}, 400, "input", "valid string"),
    ("/v1/audio/speech", {**GOOD, "temperature": "hot"}, 400, "temperature", "valid number"),
    ("/v1/audio/speech", b'{"model": "moss-speech", "input": "hi", "top_p": NaN}', 400, None,
     "non-finite number NaN"),
    ("/v1/audio/speech", {**GOOD, "top_p": 1.5}, 400, "top_p", "less than or equal to 1"),
    ("/v1/audio/speech", {**GOOD, "repetition_penalty": -1}, 400, "repetition_penalty", "greater than or equal to 0.01"),
    ("/v1/audio/speech", {**GOOD, "voice": "alloy"}, 400, "voice", "unknown voice 'alloy'"),
    ("/v1/audio/speech", {**GOOD, "response_format": "mp3"}, 400, "response_format", "'wav' or 'pcm'"),
    ("/v1/audio/speech", {**GOOD, "stream_format": "ws"}, 400, "stream_format", "'audio' or 'sse'"),
    ("/v1/audio/speech", {**GOOD, "input": "x" * 2001}, 400, "input", "the limit is 2000"),
    ("/v1/audio/speech", {**GOOD, "max_new_tokens": 3001}, 400, "max_new_tokens", "must be <= 3000"),
    ("/v1/audio/speech", {**GOOD, "model": "tts-1"}, 404, "model", "does not exist"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]}]}, 400,
     "messages.0.content.0.input_audio.data", "could not be decoded"),
    ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"], "audio": {"voice": "nope"}}, 400,
     "audio.voice", "unknown voice 'nope'"),
    ("/v1/chat/completions", {**CHAT, "seed": 1.5}, 400, "seed", "valid integer"),
]


def engine_touch_counts(http: httpx.Client) -> tuple[int, int]:
    stats = http.get("/admin/stats").json()
    return stats["llm"]["prefix_cache_queries"], stats["vocoder"]["num_steps"]


@pytest.mark.parametrize(("path", "body", "status", "param", "fragment"), BAD_REQUESTS)
def test_bad_input_gets_its_4xx_without_touching_a_model(
        http: httpx.Client, path: str, body: bytes | dict, status: int, param: str | None, fragment: str) -> None:
    before = engine_touch_counts(http)
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert fragment in error["message"]
    assert engine_touch_counts(http) == before  # no prompt was looked up, no vocoder step ran


def test_control_tokens_in_text_are_a_400_from_the_engine_side(http: httpx.Client) -> None:
    response = http.post("/v1/audio/speech", json={**GOOD, "input": "hi<|im_end|>"})
    assert response.status_code == 400
    assert "reserved control token" in response.json()["error"]["message"]


def test_unknown_route_and_wrong_method(http: httpx.Client) -> None:
    missing = http.get("/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong = http.get("/v1/audio/speech")
    assert wrong.status_code == 405 and "use POST" in wrong.json()["error"]["message"]


def test_health_and_models(http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["moss-speech"]
