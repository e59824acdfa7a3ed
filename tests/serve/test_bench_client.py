"""bench/client.py: exact playback-clock and WAV-parsing behaviour, and a small closed-loop run against
the running tiny service whose counts must match what the server reports and exports."""
from __future__ import annotations

import asyncio
import struct
import sys
import time
from pathlib import Path

import httpx
import pytest
import serve_harness

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.client import (
    AudioStream,
    ChatAudioStream,
    SpeechLoad,
    WavFormatError,
    check_url,
    prompt_text,
    run_closed_loop,
)
from bench.client import main as client_main
from bench.measure import (
    AudioTimeline,
    PlaybackClock,
    RequestResult,
    speech_prompt_text,
    stall_positions,
    summarize,
)
from deployments.framing import wav_header
from deployments.timeline import OPTIONAL_MARKS, STAGES
from runtime.prompts import READ_ALOUD_PROMPT, ChatMessage, build_prompt_rows
from runtime.tokenizer import Tokenizer

APP = {"application": serve_harness.APP_NAME}
CODES = 10  # max_new_tokens == min_new_tokens: every request yields exactly this many codes
PROMPT_TOKENS = 170

# the stages of a request without speech input (which has no speech_encode stage)
TEXT_INPUT_STAGES = [name for name, mark in STAGES if mark not in OPTIONAL_MARKS]


def test_playback_clock_counts_each_stall_once_with_its_length() -> None:
    clock = PlaybackClock(sample_rate=4)  # 2 samples = 0.5 s (binary-exact times)
    for now, samples in ((0.0, 2), (0.25, 2), (1.5, 2), (2.0, 2), (3.5, 2), (3.75, 0)):
        clock.add(now, samples)
    # runs out at 1.0; 1.5 stalls 0.5 -> runs out 2.0; 2.0 is just in time -> 2.5; 3.5 stalls 1.0
    assert (clock.num_underruns, clock.stall_s) == (2, 1.5)
    assert clock.stalled_at_audio_s == [1.0, 2.0]  # audio played before each stall: 4 and 8 samples


def test_reads_of_one_chunk_make_one_chunk_and_no_gap() -> None:
    """The HTTP client reads at most 64 KiB at a time, so a 96,000-byte chunk arrives as two reads
    microseconds apart: one chunk. Gaps run from a chunk's last read to the next chunk's first."""
    result = RequestResult()
    timeline = AudioTimeline(10.0, result)  # the request started at 10 s on the client's clock
    for at, samples in ((0.5, 100), (0.625, 32768), (0.62501, 15232), (0.75, 100), (0.7515, 100), (1.0, 50)):
        timeline.add(10.0 + at, samples)
    timeline.finish(11.25)
    assert (result.ttfa_s, result.num_chunks, result.num_samples, result.e2e_s) == (0.5, 4, 48350, 1.25)
    assert result.chunk_gaps_s == pytest.approx([0.125, 0.12499, 0.2485])


def test_summary_counts_failures_by_kind_and_keeps_each_distinct_message() -> None:
    from bench.measure import RequestResult

    mid_way = "server ended the stream with status 500 (internal: OutOfMemoryError: CUDA out of memory)"
    results = [RequestResult(status=200, num_samples=1920),
               RequestResult(status=200, error=mid_way, num_samples=960),
               RequestResult(status=200, error=mid_way),
               RequestResult(status=503, error='HTTP 503: {"error": "busy"}'),
               RequestResult(status=200)]  # a 200 without audio and without a message
    summary = summarize(results, wall_s=1.0)
    assert (summary["num_ok"], summary["errors"]) == (1, {"200_incomplete": 3, "503": 1})
    assert summary["error_messages"] == {mid_way: 2, 'HTTP 503: {"error": "busy"}': 1, "no audio": 1}


def test_stall_positions_bin_by_audio_played_with_edges_in_the_upper_bin() -> None:
    assert stall_positions([0.0, 0.24, 0.5, 0.99, 1.0, 3.9, 4.0, 7.5]) == {
        "<0.5": 2, "0.5-1": 2, "1-2": 1, "2-4": 1, ">=4": 2}
    assert stall_positions([]) == {"<0.5": 0, "0.5-1": 0, "1-2": 0, "2-4": 0, ">=4": 0}


def test_audio_stream_strips_a_wav_header_split_across_reads_and_keeps_odd_bytes() -> None:
    stream = AudioStream("wav")
    data = wav_header(24000) + bytes(range(11))  # 5 samples and one odd byte
    counts = [stream.feed(data[i:i + 7]) for i in range(0, len(data), 7)]
    assert sum(counts) == 5 and counts[:6] == [0] * 6  # nothing before the 44-byte header is complete
    assert stream.feed(b"\x00") == 1
    assert stream.header == {"audio_format": 1, "channels": 1, "sample_rate": 24000, "bits": 16,
                             "data_size": 0xFFFFFFFF}


def test_audio_stream_skips_chunks_before_data_and_rejects_other_formats() -> None:
    header = wav_header(24000)
    list_chunk = b"LIST" + struct.pack("<I", 3) + b"abc\x00"  # odd size: padded to even
    stream = AudioStream("wav")
    assert stream.feed(header[:36] + list_chunk + header[36:] + b"\x01\x02\x03\x04") == 2
    with pytest.raises(WavFormatError, match="sample_rate"):
        AudioStream("wav").feed(wav_header(16000))
    with pytest.raises(WavFormatError, match="RIFF"):
        AudioStream("wav").feed(b"\x00" * 44)
    assert AudioStream("pcm").feed(b"\x00" * 7) == 3


def test_chat_audio_stream_counts_audio_deltas_across_split_reads_and_keeps_the_first_error() -> None:
    import base64
    import json

    def event(payload: object) -> bytes:
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    def audio(num_samples: int) -> dict:
        data = base64.b64encode(b"\1\0" * num_samples).decode()
        return {"choices": [{"index": 0, "delta": {"audio": {"data": data}}, "finish_reason": None}]}

    text = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
    body = event(text) + event(audio(480)) + event(audio(7)) + b"data: [DONE]\n\n"
    stream = ChatAudioStream()
    counts = [stream.feed(body[i:i + 50]) for i in range(0, len(body), 50)]
    assert sum(counts) == 487 and stream.error is None
    assert all(c == 0 for c in counts[:2])  # nothing counted before its event is complete
    failing = ChatAudioStream()
    assert failing.feed(event(audio(10)) + event({"error": {"message": "vocoder step failed"}})
                        + event({"error": {"message": "second"}})) == 10
    assert failing.error == "error event: vocoder step failed"


def test_a_speech_load_sends_a_streamed_chat_with_one_spoken_question() -> None:
    import base64
    import io

    import soundfile

    load = SpeechLoad(speech_input_s=1.5, max_new_tokens=12, min_new_tokens=12, seed=4, temperature=0.7)
    first, second = load.payload(), load.payload()
    assert load.path == "/v1/chat/completions"
    part = first["messages"][0]["content"][0]
    assert {k: v for k, v in first.items() if k != "messages"} == {
        "model": "moss-speech", "stream": True, "modalities": ["text", "audio"],
        "audio": {"voice": "default", "format": "pcm16"}, "max_tokens": 12, "min_new_tokens": 12, "seed": 4}
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(part["input_audio"]["data"])), dtype="float32")
    assert (part["type"], part["input_audio"]["format"], rate, samples.shape) == ("input_audio", "wav", 16000,
                                                                                  (24000,))
    assert second["messages"] != first["messages"]  # distinct noise per request


def test_check_url_refuses_non_loopback_hosts_unless_allowed() -> None:
    assert check_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert check_url("http://[::1]:8000") == "http://[::1]:8000"
    assert check_url("http://localhost:8000") == "http://localhost:8000"
    for url in ("http://10.1.2.3:8000", "http://example.com", "http://0.0.0.0:8000"):
        with pytest.raises(ValueError, match="not a loopback address"):
            check_url(url)
    assert check_url("http://10.1.2.3:8000", allow_remote=True) == "http://10.1.2.3:8000"


def test_localhost_counts_as_loopback_only_where_it_resolves_to_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    import bench.client as client_module

    def resolves_to(*addresses: str):
        return lambda host, port: [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in addresses]

    monkeypatch.setattr(client_module.socket, "getaddrinfo", resolves_to("127.0.0.1", "::1"))
    assert check_url("http://localhost:8000") == "http://localhost:8000"
    monkeypatch.setattr(client_module.socket, "getaddrinfo", resolves_to("127.0.0.1", "10.0.0.7"))
    with pytest.raises(ValueError, match="refusing to send load to 'localhost': not a loopback address"):
        check_url("http://localhost:8000")


class _ScriptedServer:
    """A one-thread HTTP/1.1 server on 127.0.0.1 that answers each connection with `reply(request bytes)`:
    a list of (bytes, seconds to wait after sending them), then closes it (so replies say `connection:
    close`: a client reusing the connection would race the close)."""

    def __init__(self, reply) -> None:
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.reply = reply
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                request = conn.recv(65536)
                for data, pause in self.reply(request):
                    try:
                        conn.sendall(data)
                    except OSError:
                        break
                    time.sleep(pause)


def _run_one(load: SpeechLoad):
    from bench.client import run_request

    async def main():
        async with httpx.AsyncClient(trust_env=False) as client:
            return await run_request(client, load)

    return asyncio.run(main())


def test_the_request_timeout_bounds_the_whole_request_not_each_read() -> None:
    """A server that sends 480 bytes every 0.3 s for 3 s: `timeout_s` 0.8 ends the request with the client's
    own timeout (each read alone was within it, so the request used to run its whole 3 s and count as
    complete; a slow read would be httpx's ReadTimeout instead)."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: audio/pcm\r\ntransfer-encoding: chunked\r\n\r\n"
    chunk = b"1e0\r\n" + b"\0" * 480 + b"\r\n"
    server = _ScriptedServer(lambda _: [(head, 0.0)] + [(chunk, 0.3)] * 10 + [(b"0\r\n\r\n", 0.0)])
    result = _run_one(SpeechLoad(url=server.url, timeout_s=0.8))
    assert result.status == 200 and result.error == "timed out after 0.8 s"


def test_the_request_timeout_covers_the_server_summary() -> None:
    """The summary's GET used httpx's per-read timeout only: one trickled byte every 0.2 s kept the request (and
    the run) going past `timeout_s`."""
    def reply(request: bytes) -> list[tuple[bytes, float]]:
        if request.startswith(b"POST"):
            return [(b"HTTP/1.1 200 OK\r\nx-moss-request-id: abc\r\ncontent-length: 480\r\nconnection: close\r\n\r\n"
                     + b"\0" * 480, 0.0)]
        return [(b"HTTP/1.1 200 OK\r\ncontent-length: 40\r\nconnection: close\r\n\r\n", 0.2)] + [(b" ", 0.2)] * 40

    result = _run_one(SpeechLoad(url=_ScriptedServer(reply).url, server_summary=True, timeout_s=1.0))
    assert result.status == 200 and result.error == "timed out after 1 s"
    assert result.num_samples == 240  # the stream itself was read whole before the summary


def test_a_stream_cut_short_is_a_failure_without_the_server_summary() -> None:
    """Raw audio can only stop short when the server fails mid-way: with a fixed length the samples tell, as a
    stray byte or a chat stream without `[DONE]` does; they all counted as successes."""
    def pcm(num_bytes: int):
        head = f"HTTP/1.1 200 OK\r\ncontent-length: {num_bytes}\r\nconnection: close\r\n\r\n".encode()
        return lambda _: [(head + b"\0" * num_bytes, 0.0)]

    fixed = {"max_new_tokens": 2, "min_new_tokens": 2}
    assert _run_one(SpeechLoad(url=_ScriptedServer(pcm(2 * 3840)).url, **fixed)).error is None
    assert _run_one(SpeechLoad(url=_ScriptedServer(pcm(3840)).url, **fixed)).error == (
        "1920 samples received; 2 codes are 3840")
    assert _run_one(SpeechLoad(url=_ScriptedServer(pcm(3841)).url)).error == (
        "the stream ended 1 byte into a sample")
    assert _run_one(SpeechLoad(url=_ScriptedServer(pcm(3840)).url, max_new_tokens=2)).error is None  # not fixed
    chat = ChatAudioStream()
    chat.feed(b'data: {"choices": []}\n\n')
    assert chat.incomplete() == "the stream ended without [DONE]"
    chat.feed(b"data: [DONE]\n\n")
    assert chat.incomplete() is None and chat.done
    wav = AudioStream("wav")
    wav.feed(wav_header(24000)[:20])
    assert wav.incomplete() == "the stream ended inside the WAV header"
    with pytest.raises(ValueError, match="^an audio delta of 3 bytes is not whole PCM16 samples$"):
        ChatAudioStream().feed(b'data: {"choices": [{"delta": {"audio": {"data": "AAAA"}}}]}\n\n')


def test_a_server_summary_that_is_not_json_is_an_error_of_that_request_only() -> None:
    def reply(request: bytes) -> list[tuple[bytes, float]]:
        if request.startswith(b"POST"):
            return [(b"HTTP/1.1 200 OK\r\nx-moss-request-id: abc\r\ncontent-length: 480\r\nconnection: close\r\n\r\n"
                     + b"\0" * 480, 0.0)]
        return [(b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: 13\r\nconnection: close\r\n\r\n"
                 + b"<html></html>", 0.0)]

    result = _run_one(SpeechLoad(url=_ScriptedServer(reply).url, server_summary=True))
    assert result.status == 200 and result.request_id == "abc"
    assert result.error == "no server summary for abc: the reply is not JSON"


def test_the_client_ignores_proxies_from_the_environment(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """HTTP_PROXY would carry the loopback load to the proxy's host: the client does not use it (here the
    proxy is a closed loopback port, so a proxied request would fail to connect)."""
    reply = [(b"HTTP/1.1 200 OK\r\ncontent-type: audio/pcm\r\ncontent-length: 480\r\nconnection: close\r\n\r\n"
              + b"\0" * 480, 0.0)]
    server = _ScriptedServer(lambda _: reply)
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")
    summary = client_main(["--url", server.url, "--concurrency", "1", "--requests", "1", "--warmup", "0"])
    capsys.readouterr()
    assert (summary["levels"][0]["num_ok"], summary["levels"][0]["errors"]) == (1, {})


def test_listen_is_refused_for_an_open_loop_before_any_request() -> None:
    with pytest.raises(SystemExit, match="--listen is for the closed loop"):
        client_main(["--rate", "2", "--listen", "--url", "http://127.0.0.1:9"])


def test_prompt_text_has_the_asked_length_and_variants_differ_from_their_first_character() -> None:
    texts = [speech_prompt_text(512, variant=v) for v in (0, 1, 2)]
    assert prompt_text(512) == speech_prompt_text(512) and len(set(texts)) == 3
    # The rows the LLM replica builds for these texts (deployments.validation's messages), counted independently.
    tokenizer = Tokenizer.tiny()
    rows = [build_prompt_rows(tokenizer, [ChatMessage("system", READ_ALOUD_PROMPT), ChatMessage("user", t)],
                              output_modality="audio") for t in texts]
    assert [len(r) for r in rows] == [512] * 3
    assert texts[1].startswith("1000000 The quick brown fox")  # fastest-changing digit first


def _counters() -> dict[str, float]:
    text = serve_harness.scrape_metrics()
    value = serve_harness.metric_value
    return {
        "requests": value(text, "ray_moss_requests_total", {**APP, "route": "speech", "status": "200"}),
        "audio_s": value(text, "ray_moss_audio_seconds_total", APP),
        "ttfa_count": value(text, "ray_moss_time_to_first_audio_seconds_count", APP),
        "rtf_count": value(text, "ray_moss_realtime_factor_count", APP),
    }


def _settled(predicate: object = None, settle_s: float = 2.5, timeout_s: float = 60.0) -> dict[str, float]:
    """Counters once `predicate(counters)` holds (if given) and nothing changed for `settle_s`."""
    deadline = time.monotonic() + timeout_s
    values, since = _counters(), time.monotonic()
    while time.monotonic() - since < settle_s or (callable(predicate) and not predicate(values)):
        assert time.monotonic() < deadline, f"metrics never settled: {values}"
        time.sleep(0.5)
        now = _counters()
        if now != values:
            values, since = now, time.monotonic()
    return values


async def _run(load: SpeechLoad, concurrency: int, num_requests: int) -> list:
    async with httpx.AsyncClient() as client:
        results, _ = await run_closed_loop(client, load, concurrency, num_requests)
    return results


def test_client_counts_match_the_servers_reports_and_metrics(serve_base_url: str) -> None:
    before = _settled()
    common = {"url": check_url(serve_base_url), "prompt_tokens": PROMPT_TOKENS, "unique_prompts": True,
              "max_new_tokens": CODES, "min_new_tokens": CODES, "seed": 3, "timeout_s": 120.0,
              "server_summary": True}
    results = asyncio.run(_run(SpeechLoad(response_format="wav", **common), 2, 4))
    results += asyncio.run(_run(SpeechLoad(response_format="pcm", **common), 2, 2))

    assert [(r.status, r.error) for r in results] == [(200, None)] * 6
    assert len({r.request_id for r in results}) == 6
    for r in results:
        assert (r.num_audio_codes, r.num_prompt_tokens) == (CODES, PROMPT_TOKENS)
        assert r.num_samples == r.num_audio_codes * 1920  # audio seconds == codes * 0.08
        assert r.audio_s == pytest.approx(CODES * 0.08, rel=1e-12)
        assert r.num_chunks >= 1 and len(r.chunk_gaps_s) == r.num_chunks - 1
        assert 0 < r.ttfa_s <= r.e2e_s and r.rtf == r.e2e_s / r.audio_s
        # the server's timeline splits the client's time to first audio into stages that add up to it
        assert r.first_audio_stages_s is not None and list(r.first_audio_stages_s) == TEXT_INPUT_STAGES
        assert sum(r.first_audio_stages_s.values()) == pytest.approx(r.ttfa_s, abs=1e-6)
        assert min(r.first_audio_stages_s.values()) >= 0.0  # marks of one host's clock come in causal order
    timeline = httpx.get(f"{serve_base_url}/admin/requests/{results[0].request_id}", timeout=30).json()["timeline"]
    assert [len(timeline[k]) for k in ("engine_codes", "llm_codes_sent", "vocoder_codes_received")] == [CODES] * 3
    assert timeline["vocoder_first_chunk_codes"] >= 2 + 3  # the tiny service's 2-code first chunk + lookahead

    after = _settled(lambda v: v["requests"] >= before["requests"] + 6)
    assert after["requests"] - before["requests"] == 6
    assert after["ttfa_count"] - before["ttfa_count"] == 6
    assert after["rtf_count"] - before["rtf_count"] == 6
    client_samples = sum(r.num_samples for r in results)
    assert round((after["audio_s"] - before["audio_s"]) * 24000) == client_samples == 6 * CODES * 1920

    summary = summarize(results, wall_s=1.0, concurrency=2)
    assert (summary["num_requests"], summary["num_ok"], summary["errors"]) == (6, 6, {})
    assert summary["num_audio_codes_seen"] == [CODES] and summary["num_prompt_tokens_seen"] == [PROMPT_TOKENS]
    assert summary["ttfa_s"]["count"] == 6
    # unique prompts share only the system prompt's 8 full blocks of 16 rows (138 rows are common), never more
    cached = [r.num_cached_prompt_tokens for r in results]
    assert set(cached) <= {0, 128} and cached[-1] == 128 and summary["num_cached_prompt_tokens"]["max"] == 128
    stages = summary["first_audio_stages_s"]
    assert list(stages) == TEXT_INPUT_STAGES and {v["count"] for v in stages.values()} == {6}
    assert sum(v["mean"] for v in stages.values()) == pytest.approx(summary["ttfa_s"]["mean"], abs=1e-6)
    assert summary["chunk_gap_s"]["count"] == sum(r.num_chunks - 1 for r in results)
    assert summary["audio_s_total"] == pytest.approx(6 * CODES * 0.08, rel=1e-12)
    underruns = summary["underruns"]
    assert underruns["total"] == sum(r.num_underruns for r in results) == sum(underruns["by_audio_played_s"].values())


def test_spoken_questions_are_timed_from_the_send_with_the_encode_as_a_stage(serve_base_url: str) -> None:
    """`--speech-input-s 1`: a 1 s WAV is 13 codes, a user turn of 13 + 2 audio rows between its header and the
    generation prefix (35 rows); the client counts the audio of the chat's deltas, and the server's timeline
    now has the speech_encode stage inside the time to first audio."""
    load = SpeechLoad(url=check_url(serve_base_url), speech_input_s=1.0, max_new_tokens=CODES,
                      min_new_tokens=CODES, seed=3, timeout_s=120.0, server_summary=True)
    results = asyncio.run(_run(load, 2, 3))
    assert [(r.status, r.error) for r in results] == [(200, None)] * 3
    for r in results:
        assert (r.num_audio_codes, r.num_prompt_tokens, r.num_samples) == (CODES, 35, CODES * 1920)
        assert list(r.first_audio_stages_s) == [name for name, _ in STAGES]
        assert sum(r.first_audio_stages_s.values()) == pytest.approx(r.ttfa_s, abs=1e-6)
        assert r.first_audio_stages_s["speech_encode"] > 0
