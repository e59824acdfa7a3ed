"""bench/soak.py: its SSE reading, idle test and memory summary (the soak itself runs against a live app)."""
from __future__ import annotations

import base64
import json

from bench.soak import SpeechSse, _rss_summary, is_idle


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def test_speech_sse_counts_samples_across_split_reads_and_reads_the_done_codes() -> None:
    pcm = bytes(range(10)) * 384  # 3840 bytes: 1920 samples
    body = (sse({"type": "speech.audio.delta", "audio": base64.b64encode(pcm).decode()}) * 2
            + sse({"type": "speech.audio.done", "usage": {"audio_codes": 2, "output_tokens": 3}}))
    reader = SpeechSse()
    cut = len(body) // 2 + 7  # inside the second event
    assert reader.feed(body[:cut]) == 1920
    assert reader.done_codes is None
    assert reader.feed(body[cut:]) == 1920
    assert reader.done_codes == 2  # the audio codes, not the tokens


def stats(**changes: int) -> dict:
    llm = {"num_running": 0, "num_waiting": 0, "num_blocks_used": 0, "num_tracked_requests": 0}
    vocoder = {"open_sessions": 0, "active_streams": 0, "batched_streams": 0}
    ingress = {"active_requests": 0}
    for name, value in changes.items():
        for part in (llm, vocoder, ingress):
            if name in part:
                part[name] = value
    return {"llm": llm, "vocoder": vocoder, "ingress": ingress}


def test_idle_means_every_count_is_zero() -> None:
    assert is_idle(stats())
    for name in ("num_running", "num_waiting", "num_blocks_used", "num_tracked_requests", "open_sessions", "active_streams",
                 "batched_streams", "active_requests"):
        assert not is_idle(stats(**{name: 1})), name


def test_rss_summary_gives_first_last_and_highest_per_process() -> None:
    mib = 2**20
    samples = [(0.0, {"LLMServer (pid 7)": 100 * mib}),
               (10.0, {"LLMServer (pid 7)": 300 * mib, "Ingress (pid 8)": 50 * mib}),
               (20.0, {"LLMServer (pid 7)": 200 * mib, "Ingress (pid 8)": 60 * mib})]
    assert _rss_summary(samples) == {
        "Ingress (pid 8)": {"first_mib": 50.0, "first_at_s": 10.0, "last_mib": 60.0, "last_at_s": 20.0,
                            "max_mib": 60.0, "samples": 2, "series": [[10.0, 50.0], [20.0, 60.0]]},
        "LLMServer (pid 7)": {"first_mib": 100.0, "first_at_s": 0.0, "last_mib": 200.0, "last_at_s": 20.0,
                              "max_mib": 300.0, "samples": 3,
                              "series": [[0.0, 100.0], [10.0, 300.0], [20.0, 200.0]]},
    }
