"""The moss_* metrics on Ray's export port count exactly the traffic a test causes; autoscaling stats."""
from __future__ import annotations

import base64
import io
import json
import time

import httpx
import numpy as np
import pytest
import serve_harness
import soundfile
from serve_harness import metric_value, scrape_metrics

APP = {"application": serve_harness.APP_NAME}  # other tests may run a second app in the same Ray
ING = {**APP, "deployment": "Ingress"}
NUM_CODES = 12
SECONDS_PER_CODE = 1920 / 24000


def moss_lines(text: str) -> list[str]:
    return sorted(line for line in text.splitlines() if line.startswith("ray_moss_"))


def settled_scrape(settle_s: float = 3.0, timeout_s: float = 90.0) -> str:
    """A scrape whose moss_* samples did not change for `settle_s` (earlier traffic fully exported)."""
    deadline = time.monotonic() + timeout_s
    text = scrape_metrics()
    since = time.monotonic()
    while time.monotonic() - since < settle_s:
        assert time.monotonic() < deadline, "moss_* metrics never settled"
        time.sleep(0.5)
        now = scrape_metrics()
        if moss_lines(now) != moss_lines(text):
            text, since = now, time.monotonic()
    return text


def sse_speech(http: httpx.Client, seed: int) -> int:
    """One SSE speech request of NUM_CODES codes; returns how many audio chunks the server sent."""
    body = {"model": "moss-speech", "input": "Metrics please", "seed": seed, "stream_format": "sse",
            "min_new_tokens": NUM_CODES, "max_new_tokens": NUM_CODES + 1}
    with http.stream("POST", "/v1/audio/speech", json=body) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert sum(len(base64.b64decode(e["audio"])) for e in deltas) == 2 * 1920 * NUM_CODES
    return len(deltas)


def test_metrics_count_exactly_the_requests_made(http: httpx.Client) -> None:
    names = {  # sample name -> labels
        "ray_moss_requests_total/models": ("ray_moss_requests_total", {**ING, "route": "models", "status": "200"}),
        "ray_moss_requests_total/speech200": ("ray_moss_requests_total", {**ING, "route": "speech",
                                                                          "status": "200"}),
        "ray_moss_requests_total/speech400": ("ray_moss_requests_total", {**ING, "route": "speech",
                                                                          "status": "400"}),
        "errors": ("ray_moss_errors_total", {**ING, "kind": "invalid_request"}),
        "ttfa": ("ray_moss_time_to_first_audio_seconds_count", APP),
        "gap": ("ray_moss_audio_chunk_gap_seconds_count", APP),
        "rtf": ("ray_moss_realtime_factor_count", APP),
        "audio_s": ("ray_moss_audio_seconds_total", APP),
        "batch_count": ("ray_moss_vocoder_batch_size_count", APP),
        # Ray 2.60 rebuilds a histogram's _sum from bucket midpoints (see docs/metrics.md), so the
        # exact check is on the buckets: a one-stream step lands in the le="1.0" bucket.
        "batch_of_one": ("ray_moss_vocoder_batch_size_bucket", {**APP, "le": "1.0"}),
        "first_code": ("ray_moss_time_to_first_code_seconds_count", APP),
        "first_pcm": ("ray_moss_vocoder_time_to_first_pcm_seconds_count", APP),
        "step_calls": ("ray_moss_vocoder_step_seconds_count", APP),  # steps of every kind and finishes
        "finish_calls": ("ray_moss_vocoder_step_seconds_count", {**APP, "kind": "finish"}),
    }

    def values(text: str) -> dict[str, float]:
        return {key: metric_value(text, name, labels) for key, (name, labels) in names.items()}

    before = values(settled_scrape())
    steps_before = http.get("/admin/stats").json()["vocoder"]["num_steps"]
    for _ in range(3):
        assert http.get("/v1/models").status_code == 200
    for bad in ({"model": "moss-speech"}, {"model": "moss-speech", "input": "x", "top_k": -3}):
        assert http.post("/v1/audio/speech", json=bad).status_code == 400
    num_chunks = [sse_speech(http, seed) for seed in (31, 32)]
    steps = http.get("/admin/stats").json()["vocoder"]["num_steps"] - steps_before

    expected = {**before}
    expected["ray_moss_requests_total/models"] += 3
    expected["ray_moss_requests_total/speech400"] += 2
    expected["errors"] += 2
    expected["ray_moss_requests_total/speech200"] += 2
    expected["ttfa"] += 2
    expected["rtf"] += 2
    expected["gap"] += sum(n - 1 for n in num_chunks)  # one gap between consecutive chunks
    expected["audio_s"] += 2 * NUM_CODES * SECONDS_PER_CODE
    expected["batch_count"] += steps
    expected["batch_of_one"] += steps  # sequential requests: every step carried one stream
    expected["first_code"] += 2
    expected["first_pcm"] += 2
    expected["step_calls"] += steps  # every step; "deadline" ends each utterance inside one (no finish call)
    expected["finish_calls"] += 0

    def matches() -> bool:
        now = values(scrape_metrics())
        return all(now[k] == pytest.approx(v, abs=1e-6) for k, v in expected.items())

    serve_harness.wait_until(matches, timeout_s=60, what=f"metrics to reach {expected}",
                             last=lambda: values(scrape_metrics()))
    assert all(n >= 2 for n in num_chunks)


def test_speech_input_counts_its_seconds_and_one_encode_call(http: httpx.Client) -> None:
    names = {"speech_s": ("ray_moss_speech_input_seconds_total", APP),
             "encodes": ("ray_moss_vocoder_step_seconds_count", {**APP, "kind": "encode"})}

    def values(text: str) -> dict[str, float]:
        return {key: metric_value(text, name, labels) for key, (name, labels) in names.items()}

    before = values(settled_scrape())
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(20000, dtype=np.float32), 16000, format="WAV", subtype="PCM_16")
    clip = {"type": "input_audio", "input_audio": {"data": base64.b64encode(buffer.getvalue()).decode(),
                                                   "format": "wav"}}
    body = {"model": "moss-speech", "max_tokens": 2, "seed": 3,
            "messages": [{"role": "user", "content": [clip, {"type": "text", "text": "and"}, clip]}]}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    expected = {"speech_s": before["speech_s"] + 2 * 1.25, "encodes": before["encodes"] + 1}  # one call per request

    def matches() -> bool:
        now = values(scrape_metrics())
        return all(now[k] == pytest.approx(v, abs=1e-6) for k, v in expected.items())

    serve_harness.wait_until(matches, timeout_s=60, what=f"metrics to reach {expected}",
                             last=lambda: values(scrape_metrics()))


def test_engine_and_vocoder_gauges_match_the_server_state(http: httpx.Client) -> None:
    # Two speech requests sharing the system prompt: the second hits the prefix cache.
    for seed in (41, 42):
        assert http.post("/v1/audio/speech", json={"model": "moss-speech", "input": "Same prompt",
                                                   "seed": seed, "min_new_tokens": 2,
                                                   "max_new_tokens": 3}).status_code == 200
    stats = http.get("/admin/stats").json()
    llm = stats["llm"]
    assert llm["prefix_cache_hits"] > 0
    assert llm["device_memory"] is None and stats["vocoder"]["device_memory"] is None  # CPU replicas
    # the CPU engine's cache holds float32 rows, 16 tokens a block; nothing was preempted, no step failed
    assert (llm["kv_cache_dtype"], llm["kv_capacity_tokens"], llm["num_preemptions"], llm["num_step_failures"]) == (
        "float32", 16 * llm["num_blocks_total"], 0, 0)
    expected = {
        "ray_moss_kv_blocks_used": 0, "ray_moss_kv_blocks_free": llm["num_blocks_total"],
        "ray_moss_queued_requests": 0, "ray_moss_active_streams": 0,
        "ray_moss_prefix_cache_query_tokens_total": llm["prefix_cache_queries"],
        "ray_moss_prefix_cache_hit_tokens_total": llm["prefix_cache_hits"],
        "ray_moss_prefix_cache_hit_rate": llm["prefix_cache_hits"] / llm["prefix_cache_queries"],
    }

    def matches() -> bool:
        text = scrape_metrics()
        return all(metric_value(text, k, APP) == pytest.approx(v) for k, v in expected.items())

    serve_harness.wait_until(matches, timeout_s=60, what=f"gauges to reach {expected}",
                             last=lambda: {k: metric_value(scrape_metrics(), k, APP) for k in expected})


def test_record_autoscaling_stats_per_contract(http: httpx.Client) -> None:
    from ray import serve

    assert http.post("/v1/audio/speech", json={"model": "moss-speech", "input": "scale", "seed": 7,
                                               "min_new_tokens": 2, "max_new_tokens": 3}).status_code == 200
    llm = serve.get_deployment_handle("LLMServer", app_name=serve_harness.APP_NAME)
    vocoder = serve.get_deployment_handle("VocoderServer", app_name=serve_harness.APP_NAME)
    llm_stats = llm.record_autoscaling_stats.remote().result()
    assert set(llm_stats) == {"kv_cache_usage", "num_waiting", "num_running", "ttfa_p90_s"}
    assert (llm_stats["kv_cache_usage"], llm_stats["num_waiting"], llm_stats["num_running"]) == (0.0, 0.0, 0.0)
    assert llm_stats["ttfa_p90_s"] > 0  # the request above produced audio within the window
    vocoder_stats = vocoder.record_autoscaling_stats.remote().result()
    assert set(vocoder_stats) == {"batch_occupancy", "busy_fraction", "lag_s"}
    assert 0 < vocoder_stats["batch_occupancy"] <= 1 and vocoder_stats["lag_s"] == 0.0
    assert 0 < vocoder_stats["busy_fraction"] <= 1  # the request's steps ran within the last 30 s


def test_llm_counters_grow_by_the_engine_totals_increase() -> None:
    """`_refresh_metrics` turns the engine's lifetime totals into counter increments: each refresh adds what
    the total grew by since the last one, nothing when it did not grow (in process, no Ray)."""
    import dataclasses
    from types import SimpleNamespace

    from deployments.llm_server import LLMServer
    from deployments.metrics import LLMMetrics
    from runtime.engine import EngineStats

    class Recorder:  # stands in for a Gauge or a Counter
        def __init__(self) -> None:
            self.calls: list[tuple[str, float]] = []

        def set(self, value: float) -> None:
            self.calls.append(("set", value))

        def inc(self, value: float) -> None:
            self.calls.append(("inc", value))

    # (queried, hits, preemptions, failed steps)
    totals = iter([(10, 4, 0, 0), (10, 4, 3, 1), (30, 12, 3, 1), (30, 12, 5, 3)])
    server = object.__new__(LLMServer)
    server._metrics = LLMMetrics(**{f.name: Recorder() for f in dataclasses.fields(LLMMetrics)})
    server._seen = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0, "num_step_failures": 0}

    def stats() -> EngineStats:
        queries, hits, preemptions, failures = next(totals)
        return EngineStats(num_running=2, num_waiting=1, num_blocks_total=8, num_blocks_used=5, num_blocks_free=3,
                           prefix_cache_queries=queries, prefix_cache_hits=hits, num_preemptions=preemptions,
                           num_step_failures=failures)

    server._engine = SimpleNamespace(stats=stats)
    for _ in range(4):
        server._refresh_metrics()
    m = server._metrics
    assert m.preemptions.calls == [("inc", 3), ("inc", 2)]
    assert m.step_failures.calls == [("inc", 1), ("inc", 2)]
    assert m.prefix_cache_query_tokens.calls == [("inc", 10), ("inc", 20)]
    assert m.prefix_cache_hit_tokens.calls == [("inc", 4), ("inc", 8)]
    assert m.prefix_cache_hit_rate.calls == [("set", 0.4)] * 4
    assert m.kv_blocks_used.calls == [("set", 5)] * 4 and m.queued_requests.calls == [("set", 1)] * 4
