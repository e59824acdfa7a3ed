"""bench/soak.py: its SSE reading, idle test and memory summary (the soak itself runs against a live app)."""
from __future__ import annotations

import base64
import json
from pathlib import Path

from bench.soak import SpeechSse, _rss_summary, is_idle, replica_rss


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
    assert reader.incomplete() is None
    assert SpeechSse().incomplete() == "the stream ended without speech.audio.done"


def test_speech_sse_refuses_a_delta_of_an_odd_number_of_bytes() -> None:
    """A stray byte in one delta misaligns every later sample; the count rounded it away and the soak passed."""
    import pytest

    odd = sse({"type": "speech.audio.delta", "audio": base64.b64encode(b"\0" * 3841).decode()})
    with pytest.raises(ValueError, match="^an audio delta of 3841 bytes is not whole PCM16 samples$"):
        SpeechSse().feed(odd)


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


def fake_process(root: Path, pid: int, title: str, rss_kib: int, stdout: Path) -> None:
    proc = root / str(pid)
    (proc / "fd").mkdir(parents=True)
    (proc / "cmdline").write_bytes(title.encode() + b"\0\0")
    (proc / "status").write_text(f"Name:\tray::ServeRepl\nVmPeak:\t 999 kB\nVmRSS:\t{rss_kib:>8} kB\nThreads:\t7\n")
    (proc / "fd" / "1").symlink_to(stdout)


def test_replica_memory_is_read_by_app_title_and_optionally_by_ray_session(tmp_path: Path) -> None:
    ours, other = tmp_path / "session_a", tmp_path / "session_b"
    root = tmp_path / "proc"
    fake_process(root, 101, "ray::ServeReplica:moss:LLMServer.handle_request_with_rejection", 2048,
                 ours / "logs" / "worker-1.out")
    fake_process(root, 102, "ray::ServeReplica:moss:Ingress", 1024, ours / "logs" / "worker-2.out")
    fake_process(root, 201, "ray::ServeReplica:moss:LLMServer", 4096, other / "logs" / "worker-3.out")
    fake_process(root, 103, "ray::ServeReplica:mossy:Ingress", 512, ours / "logs" / "worker-4.out")
    fake_process(root, 104, "ray::ProxyActor", 512, ours / "logs" / "worker-5.out")
    (root / "self").mkdir()
    assert replica_rss("moss", proc_root=root) == {
        "LLMServer (pid 101)": 2048 * 1024, "Ingress (pid 102)": 1024 * 1024, "LLMServer (pid 201)": 4096 * 1024}
    assert replica_rss("moss", str(ours), proc_root=root) == {
        "LLMServer (pid 101)": 2048 * 1024, "Ingress (pid 102)": 1024 * 1024}
