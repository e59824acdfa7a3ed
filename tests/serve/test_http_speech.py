"""POST /v1/audio/speech through real HTTP against the running tiny app (real engine and vocoder)."""
from __future__ import annotations

import base64
import json
import wave
from io import BytesIO
from pathlib import Path

import httpx
import numpy as np
import serve_harness

SAMPLES_PER_CODE = 1920
NUM_CODES = 6


def speech_body(seed: int, num_codes: int = NUM_CODES, **extra: object) -> dict:
    """With the talking checkpoint, `min_new_tokens` codes come out, then EOSP ends the audio
    (`max_new_tokens` = codes + 1 stops generation right after it)."""
    return {"model": "moss-speech", "input": "Hello there", "voice": "default", "seed": seed,
            "min_new_tokens": num_codes, "max_new_tokens": num_codes + 1, **extra}


def summary(http: httpx.Client, request_id: str) -> dict:
    response = http.get(f"/admin/requests/{request_id}")
    assert response.status_code == 200, response.text
    return response.json()


def pcm16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.int32)


def test_streamed_wav_is_24khz_mono_pcm16_with_1920_samples_per_reported_code(http: httpx.Client) -> None:
    with http.stream("POST", "/v1/audio/speech", json=speech_body(seed=11)) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "audio/wav"
        assert response.headers["transfer-encoding"] == "chunked"
        request_id = response.headers["x-moss-request-id"]
        body = response.read()
    fields, pcm = serve_harness.parse_wav(body)
    assert (fields["sample_rate"], fields["channels"], fields["bits"], fields["data_size"]) == \
        (24000, 1, 16, 0xFFFFFFFF)
    report = summary(http, request_id)
    assert report["status"] == 200 and report["finish_reason"] == "length"
    assert report["num_audio_codes"] == NUM_CODES  # the engine's own count (Finished.num_audio_codes)
    assert len(pcm) == 2 * SAMPLES_PER_CODE * report["num_audio_codes"]
    assert report["num_audio_samples"] == SAMPLES_PER_CODE * NUM_CODES
    with wave.open(BytesIO(body)) as reader:
        assert (reader.getframerate(), reader.getnchannels(), reader.getsampwidth()) == (24000, 1, 2)
        assert reader.readframes(10**6) == pcm
    assert np.abs(pcm16(pcm)).max() > 0  # real audio, not silence


def test_sse_decodes_to_the_same_audio_as_wav_for_the_same_seed(http: httpx.Client) -> None:
    wav = http.post("/v1/audio/speech", json=speech_body(seed=5))
    assert wav.status_code == 200
    _, wav_pcm = serve_harness.parse_wav(wav.content)
    raw = http.post("/v1/audio/speech", json=speech_body(seed=5, response_format="pcm"))
    assert raw.status_code == 200 and raw.headers["content-type"] == "audio/pcm"

    with http.stream("POST", "/v1/audio/speech", json=speech_body(seed=5, stream_format="sse")) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    done = events[-1]
    assert done["type"] == "speech.audio.done"
    assert done["usage"]["audio_codes"] == NUM_CODES
    assert done["usage"]["audio_samples"] == NUM_CODES * SAMPLES_PER_CODE
    assert done["usage"]["output_tokens"] == NUM_CODES + 1  # the codes plus the EOSP row
    assert done["usage"]["total_tokens"] == done["usage"]["input_tokens"] + NUM_CODES + 1
    sse_pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])

    assert len(sse_pcm) == len(wav_pcm) == len(raw.content) == 2 * SAMPLES_PER_CODE * NUM_CODES
    # Same codes and seeded vocoder noise; chunking may differ, which the vocoder guarantees only
    # within float rounding: at most one PCM16 step apart.
    assert np.abs(pcm16(sse_pcm) - pcm16(wav_pcm)).max() <= 1
    assert np.abs(pcm16(raw.content) - pcm16(wav_pcm)).max() <= 1
    other = http.post("/v1/audio/speech", json=speech_body(seed=6, response_format="pcm"))
    assert np.abs(pcm16(other.content) - pcm16(wav_pcm)).max() > 100  # another seed: other audio


def test_openai_client_streaming_response_writes_a_wav(serve_base_url: str, tmp_path: Path) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{serve_base_url}/v1", api_key="unused", timeout=120.0)
    out = tmp_path / "speech.wav"
    with client.audio.speech.with_streaming_response.create(
        model="moss-speech", voice="default", input="Hello from the OpenAI client", response_format="wav",
        extra_body={"seed": 3, "min_new_tokens": 4, "max_new_tokens": 5},
    ) as response:
        assert response.status_code == 200
        response.stream_to_file(out)
    fields, pcm = serve_harness.parse_wav(out.read_bytes())
    assert (fields["sample_rate"], fields["channels"], fields["bits"]) == (24000, 1, 16)
    assert len(pcm) == 2 * SAMPLES_PER_CODE * 4
