"""POST /v1/chat/completions streaming through real HTTP: text and audio deltas, multi-turn, text only."""
from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import soundfile

from runtime.prompts import AudioContent, ChatMessage, build_prompt_rows
from runtime.tokenizer import Tokenizer
from vocoder.speech_encoder import SpeechEncoderConfig

SAMPLES_PER_CODE = 1920


def chat_events(http: httpx.Client, body: dict) -> list[dict]:
    request = {"model": "moss-speech", "stream": True, **body}
    with http.stream("POST", "/v1/chat/completions", json=request) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def split(events: list[dict]) -> tuple[str, bytes, list[str | None], dict | None]:
    text, audio, reasons, usage = "", b"", [], None
    for event in events:
        assert event["object"] == "chat.completion.chunk" and event["model"] == "moss-speech"
        if not event["choices"]:
            usage = event["usage"]
            continue
        delta = event["choices"][0]["delta"]
        text += delta.get("content") or ""
        if "audio" in delta:
            audio += base64.b64decode(delta["audio"]["data"])
        reasons.append(event["choices"][0]["finish_reason"])
    return text, audio, reasons, usage


def test_audio_chat_streams_audio_then_text_in_openai_chunks(http: httpx.Client) -> None:
    # Talking checkpoint: 4 codes (EOSP masked until then), EOSP, then letters up to 12 tokens.
    events = chat_events(http, {
        "messages": [{"role": "user", "content": "Say something"}], "modalities": ["text", "audio"],
        "audio": {"voice": "default", "format": "pcm16"}, "min_new_tokens": 4, "max_completion_tokens": 12,
        "seed": 1, "stream_options": {"include_usage": True}})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith("chatcmpl-")
    text, audio, reasons, usage = split(events)
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert len(text) == 12 - 4 - 1 and text.isalpha() and text.islower()
    assert len(audio) == 2 * SAMPLES_PER_CODE * 4
    assert usage["audio_codes"] == 4 and usage["completion_tokens"] == 12
    assert usage["audio_samples"] == 4 * SAMPLES_PER_CODE


def test_multi_turn_chat_reuses_the_cached_prefix(http: httpx.Client) -> None:
    system = {"role": "system", "content": "You are a friendly assistant. " * 4}
    first_turn = [system, {"role": "user", "content": "Tell me about the sea."}]
    first = chat_events(http, {"messages": first_turn, "max_tokens": 6, "seed": 2,
                               "stream_options": {"include_usage": True}})
    first_text, _, _, first_usage = split(first)
    assert first_usage["completion_tokens"] == 6 and len(first_text) == 6
    second_turn = [*first_turn, {"role": "assistant", "content": first_text},
                   {"role": "user", "content": "And the mountains?"}]
    second = chat_events(http, {"messages": second_turn, "max_tokens": 6, "seed": 3,
                                "stream_options": {"include_usage": True}})
    _, audio, _, second_usage = split(second)
    assert audio == b""  # text-only modality
    cached = second_usage["prompt_tokens_details"]["cached_tokens"]
    # The whole first prompt (system + first user turn, > 130 tokens) is shared: every full 16-token
    # block of it can come from the cache.
    assert cached >= (first_usage["prompt_tokens"] // 16 - 1) * 16 > 0
    assert second_usage["prompt_tokens"] > first_usage["prompt_tokens"]


def test_text_only_chat_has_no_audio(http: httpx.Client) -> None:
    text, audio, reasons, usage = split(chat_events(http, {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "seed": 4}))
    assert len(text) == 8 and text.isalpha()
    assert audio == b"" and usage is None and reasons[-1] == "length"


def test_non_streamed_chat_returns_one_completion_equal_to_the_streamed_one(http: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "Say something"}], "modalities": ["text", "audio"],
            "audio": {"voice": "default", "format": "pcm16"}, "min_new_tokens": 4, "max_completion_tokens": 12,
            "seed": 1}
    text, audio, reasons, usage = split(chat_events(http, {**body, "stream_options": {"include_usage": True}}))
    response = http.post("/v1/chat/completions", json={"model": "moss-speech", "stream": False, **body})
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    completion = response.json()
    assert completion["object"] == "chat.completion" and completion["id"].startswith("chatcmpl-")
    assert completion["id"] == response.headers["x-moss-request-id"]
    (choice,) = completion["choices"]
    message = choice["message"]
    assert choice["finish_reason"] == reasons[-1] == "length"
    assert message["role"] == "assistant" and message["content"] == text == message["audio"]["transcript"]
    assert base64.b64decode(message["audio"]["data"]) == audio and len(audio) == 2 * SAMPLES_PER_CODE * 4
    assert completion["usage"] == usage
    text_only = http.post("/v1/chat/completions", json={
        "model": "moss-speech", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "seed": 4})
    assert text_only.status_code == 200  # stream defaults to false, as in the OpenAI API
    message = text_only.json()["choices"][0]["message"]
    assert "audio" not in message and len(message["content"]) == 8 and message["content"].isalpha()


def test_speech_input_is_encoded_into_the_prompt_and_answered_with_speech(http: httpx.Client) -> None:
    # 1.5 s of a 48 kHz stereo WAV: decoded, down-mixed and resampled by the ingress, encoded by the vocoder
    # replica's tiny speech encoder into 19 codes (24000 samples at 16 kHz), which become 21 prompt rows.
    t = np.arange(72000) / 48000
    wave = (0.4 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, np.stack([wave, wave], axis=1), 48000, format="WAV", subtype="PCM_16")
    speech = {"type": "input_audio", "input_audio": {"data": base64.b64encode(buffer.getvalue()).decode(),
                                                     "format": "wav"}}
    body = {"messages": [{"role": "user", "content": [speech]}], "modalities": ["text", "audio"],
            "audio": {"voice": "default", "format": "pcm16"}, "min_new_tokens": 3, "max_completion_tokens": 6,
            "seed": 5, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json={"model": "moss-speech", "stream": True, **body}) as response:
        assert response.status_code == 200, response.read()
        request_id = response.headers["x-moss-request-id"]
        lines = [line for line in response.iter_lines() if line]
    _, audio, reasons, usage = split([json.loads(line[len("data: "):]) for line in lines[:-1]])
    num_codes = SpeechEncoderConfig.preset("tiny").num_codes(24000)
    assert num_codes == 19
    rows = build_prompt_rows(Tokenizer.tiny(), [ChatMessage("user", AudioContent((0,) * num_codes))],
                             output_modality="audio")
    assert usage["prompt_tokens"] == len(rows)
    assert usage["audio_codes"] == 3 and len(audio) == 2 * SAMPLES_PER_CODE * 3 and reasons[-1] == "length"
    timeline = http.get(f"/admin/requests/{request_id}").json()["timeline"]
    assert timeline["vocoder_received"] <= timeline["vocoder_speech_encoded"] <= timeline["llm_received"]
