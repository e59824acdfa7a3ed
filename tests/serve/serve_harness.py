"""Helpers shared by the serve tests: the test app's settings, metrics scraping and parsing, WAV parsing.

`tests/serve/conftest.py` starts Ray and the app once per session and records the metrics port here,
so any test module (including tests/serve/test_ops_*.py) can call `scrape_metrics()`.
"""
from __future__ import annotations

import socket
import struct
import time
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

APP_NAME = "moss"
MAX_NUM_RUNNING = 4
MAX_NUM_WAITING = 2


def app_args(model: str) -> dict:
    """The app every serve test talks to: tiny engine (`model`: preset or checkpoint folder) and
    tiny vocoder on CPU, small queues so overload is reachable with a handful of requests."""
    return {
        "engine": {"model": model, "device": "cpu", "kv_cache_bytes": 16 * 2**20,
                   "max_num_running": MAX_NUM_RUNNING, "max_num_waiting": MAX_NUM_WAITING,
                   "max_model_len": 4096},
        "vocoder_preset": "tiny",
        "max_input_chars": 2000,
        "max_new_tokens_limit": 3000,
        "default_max_new_tokens": 64,
        "request_timeout_s": 300.0,
        "stream_idle_timeout_s": 120.0,
    }

_state: dict[str, int] = {}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def set_metrics_port(port: int) -> None:
    """Called by the session fixture once Ray is up."""
    _state["metrics_port"] = port


def scrape_metrics() -> str:
    """Ray's Prometheus text from the metrics export port on 127.0.0.1 (the test session's Ray)."""
    port = _state["metrics_port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode("utf-8")


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the samples named exactly `name` whose labels include `labels` (0.0 when none)."""
    labels = labels or {}
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def metric_names(text: str) -> set[str]:
    """Every sample name on the scrape."""
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def wait_until(predicate: Callable[[], bool], *, timeout_s: float = 60.0, interval_s: float = 0.25,
               what: str = "condition", last: Callable[[], object] | None = None) -> None:
    """Poll until `predicate()` is true; fail the test with `what` (and `last()`) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            seen = f"; last seen {last()}" if last is not None else ""
            raise AssertionError(f"timed out waiting for {what}{seen}")
        time.sleep(interval_s)


def stable_metric(name: str, labels: dict[str, str] | None = None, *, settle_s: float = 3.0,
                  timeout_s: float = 60.0) -> float:
    """The metric's value once it stopped changing for `settle_s` (earlier traffic fully exported)."""
    deadline = time.monotonic() + timeout_s
    value = metric_value(scrape_metrics(), name, labels)
    since = time.monotonic()
    while time.monotonic() - since < settle_s:
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}{labels} never settled")
        time.sleep(0.5)
        now = metric_value(scrape_metrics(), name, labels)
        if now != value:
            value, since = now, time.monotonic()
    return value


def parse_wav(data: bytes) -> tuple[dict[str, int], bytes]:
    """Parse a streamed 44-byte WAV header (sizes 0xFFFFFFFF) -> (format fields, PCM bytes)."""
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt ", data[:16]
    riff_size, = struct.unpack("<I", data[4:8])
    fmt_size, audio_format, channels, rate, byte_rate, block_align, bits = struct.unpack(
        "<IHHIIHH", data[16:36])
    assert data[36:40] == b"data"
    data_size, = struct.unpack("<I", data[40:44])
    return ({"riff_size": riff_size, "fmt_size": fmt_size, "audio_format": audio_format,
             "channels": channels, "sample_rate": rate, "byte_rate": byte_rate,
             "block_align": block_align, "bits": bits, "data_size": data_size}, data[44:])
