"""Byte framing: streaming WAV header, PCM16 conversion, SSE and chat chunk events (no Ray)."""
from __future__ import annotations

import base64
import io
import json
import wave

import numpy as np
import serve_harness

from deployments import framing


def test_streaming_wav_header_is_readable_by_the_wave_module() -> None:
    header = framing.wav_header()
    assert len(header) == framing.WAV_HEADER_BYTES == 44
    fields, rest = serve_harness.parse_wav(header)
    assert rest == b""
    assert fields == {"riff_size": 0xFFFFFFFF, "fmt_size": 16, "audio_format": 1, "channels": 1,
                      "sample_rate": 24000, "byte_rate": 48000, "block_align": 2, "bits": 16,
                      "data_size": 0xFFFFFFFF}
    pcm = framing.pcm16_bytes(np.array([0.0, 0.5, -0.5, 1.0], dtype=np.float32))
    with wave.open(io.BytesIO(header + pcm)) as reader:
        assert (reader.getnchannels(), reader.getsampwidth(), reader.getframerate()) == (1, 2, 24000)
        assert reader.readframes(100) == pcm


def test_pcm16_rounds_and_clips() -> None:
    pcm = np.array([0.0, 1.0, -1.0, 2.0, -3.0, 0.5, 1e-5], dtype=np.float32)
    values = np.frombuffer(framing.pcm16_bytes(pcm), dtype="<i2").tolist()
    assert values == [0, 32767, -32767, 32767, -32767, 16384, 0]


def test_speech_sse_events() -> None:
    delta = framing.speech_delta(b"\x01\x00\xff\x7f")
    assert delta.startswith(b"data: ") and delta.endswith(b"\n\n")
    assert json.loads(delta[6:]) == {"type": "speech.audio.delta", "audio": base64.b64encode(
        b"\x01\x00\xff\x7f").decode()}
    done_event = {"num_prompt_tokens": 10, "num_generated_tokens": 5, "num_cached_prompt_tokens": 4,
                  "num_audio_codes": 3, "num_audio_samples": 5760}
    done = json.loads(framing.speech_done(framing.speech_usage(done_event))[6:])
    assert done == {"type": "speech.audio.done", "usage": {
        "input_tokens": 10, "output_tokens": 5, "total_tokens": 15, "cached_input_tokens": 4,
        "audio_codes": 3, "audio_samples": 5760}}


def test_chat_chunks_follow_the_openai_chunk_shape() -> None:
    chunker = framing.ChatChunker("chatcmpl-abc", "moss-speech", 123)
    role = json.loads(chunker.role()[6:])
    assert role == {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 123,
                    "model": "moss-speech", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                               "content": ""},
                                                         "finish_reason": None}]}
    audio = json.loads(chunker.audio(b"\x00\x01")[6:])
    assert audio["choices"][0]["delta"] == {"audio": {"id": "audio_abc", "data": "AAE="}}
    assert json.loads(chunker.text("hé")[6:])["choices"][0]["delta"] == {"content": "hé"}
    finish = json.loads(chunker.finish("length")[6:])
    assert finish["choices"] == [{"index": 0, "delta": {}, "finish_reason": "length"}]
    assert framing.DONE == b"data: [DONE]\n\n"
