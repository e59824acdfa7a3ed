"""The `moss_*` metrics (Ray `ray.serve.metrics`, exported on Ray's metrics port with a `ray_` prefix).

Each deployment creates only the metrics it records, inside its replica (a metric object made in the
driver does not reach the export port). Exact exported names: docs/metrics.md.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from ray.serve.metrics import Counter, Gauge, Histogram

# Fine below 0.3 s, where first-audio targets and the stages that make them up (first code, first PCM) lie:
# 10 ms steps to 0.1 s, 20 ms steps to 0.3 s (one stream's first audio is ~0.1 s, 64 listeners' p99 ~0.3 s on
# the H200), so a quantile read from the buckets is off by at most one such step there.
TTFA_BOUNDARIES = [*(round(0.01 * i, 2) for i in range(1, 11)), *(round(0.1 + 0.02 * i, 2) for i in range(1, 11)),
                   0.35, 0.4, 0.5, 0.6, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0]
GAP_BOUNDARIES = [0.005, 0.01, 0.02, 0.04, 0.08, 0.12, 0.16, 0.24, 0.32, 0.5, 1.0, 2.0, 5.0]
RTF_BOUNDARIES = [0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0]
BATCH_BOUNDARIES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
STEP_BOUNDARIES = [0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0]


@dataclass
class IngressMetrics:
    """Per-request metrics, recorded where the bytes leave the server."""

    requests: Counter
    errors: Counter
    time_to_first_audio: Histogram
    chunk_gap: Histogram
    realtime_factor: Histogram
    audio_seconds: Counter

    @classmethod
    def create(cls) -> IngressMetrics:
        """Create the ingress metrics (call inside the replica)."""
        return cls(
            requests=Counter("moss_requests", description="HTTP requests by route and status code.",
                             tag_keys=("route", "status")),
            errors=Counter("moss_errors", description="Failed requests by kind of error.",
                           tag_keys=("kind",)),
            time_to_first_audio=Histogram(
                "moss_time_to_first_audio_seconds", boundaries=TTFA_BOUNDARIES,
                description="Seconds from request arrival to the first audio chunk leaving the ingress."),
            chunk_gap=Histogram("moss_audio_chunk_gap_seconds", boundaries=GAP_BOUNDARIES,
                                description="Seconds between consecutive audio chunks of one stream."),
            realtime_factor=Histogram(
                "moss_realtime_factor", boundaries=RTF_BOUNDARIES,
                description="Per request: generation wall time / audio duration (< 1 is faster than real time)."),
            audio_seconds=Counter("moss_audio_seconds", description="Seconds of audio produced."),
        )


@dataclass
class LLMMetrics:
    """Engine state, refreshed from `Engine.stats()` by the LLM deployment."""

    queued_requests: Gauge
    kv_blocks_used: Gauge
    kv_blocks_free: Gauge
    prefix_cache_hit_rate: Gauge
    prefix_cache_hit_tokens: Counter
    prefix_cache_query_tokens: Counter
    preemptions: Counter
    step_failures: Counter
    time_to_first_code: Histogram

    @classmethod
    def create(cls) -> LLMMetrics:
        """Create the LLM deployment metrics (call inside the replica)."""
        return cls(
            queued_requests=Gauge("moss_queued_requests", description="Requests waiting in the engine."),
            kv_blocks_used=Gauge("moss_kv_blocks_used", description="KV cache blocks in use."),
            kv_blocks_free=Gauge("moss_kv_blocks_free", description="KV cache blocks free."),
            prefix_cache_hit_rate=Gauge(
                "moss_prefix_cache_hit_rate",
                description="Prompt tokens served from the prefix cache / prompt tokens looked up (lifetime)."),
            prefix_cache_hit_tokens=Counter("moss_prefix_cache_hit_tokens",
                                            description="Prompt tokens found in the prefix cache."),
            prefix_cache_query_tokens=Counter("moss_prefix_cache_query_tokens",
                                              description="Prompt tokens looked up in the prefix cache."),
            preemptions=Counter("moss_preemptions", description=(
                "Running sequences preempted because the KV cache had no free block (their rows are computed "
                "again when they are admitted again).")),
            step_failures=Counter("moss_engine_step_failures", description=(
                "Engine steps that raised; each failed every request in flight (the replica is replaced after "
                "max_consecutive_step_failures in a row or one device error).")),
            time_to_first_code=Histogram(
                "moss_time_to_first_code_seconds", boundaries=TTFA_BOUNDARIES,
                description="Seconds from a request reaching the LLM deployment to its first audio codes leaving it."),
        )


@dataclass
class VocoderMetrics:
    """Vocoder deployment metrics."""

    active_streams: Gauge
    batch_size: Histogram
    step_seconds: Histogram
    time_to_first_pcm: Histogram
    speech_input_seconds: Counter

    @classmethod
    def create(cls) -> VocoderMetrics:
        """Create the vocoder deployment metrics (call inside the replica)."""
        return cls(
            active_streams=Gauge("moss_active_streams",
                                 description="Utterances streaming through the vocoder deployment."),
            batch_size=Histogram("moss_vocoder_batch_size", boundaries=BATCH_BOUNDARIES,
                                 description="Streams advanced by one StreamingVocoder.step call."),
            step_seconds=Histogram(
                "moss_vocoder_step_seconds", boundaries=STEP_BOUNDARIES, tag_keys=("kind",),
                description="Wall seconds of one vocoder call by kind: first / urgent / background step, finish, "
                            "encode (speech input -> codes)."),
            time_to_first_pcm=Histogram(
                "moss_vocoder_time_to_first_pcm_seconds", boundaries=TTFA_BOUNDARIES,
                description="Seconds from an utterance reaching the vocoder deployment to its first PCM leaving it."),
            speech_input_seconds=Counter(
                "moss_speech_input_seconds", description="Seconds of speech input encoded into codes."),
        )


class RecentWindow:
    """Values observed in the last `window_s` seconds, for autoscaling stats (p90, mean). Expired values go
    as new ones come, not only when read: Serve reads the stats only with an autoscaling config, and a
    replica with a fixed count would otherwise keep every value it ever saw."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._items: deque[tuple[float, float]] = deque()

    def add(self, value: float, now: float | None = None) -> None:
        """Record one value."""
        now = time.monotonic() if now is None else now
        self._items.append((now, value))
        self._expire(now)

    def __len__(self) -> int:
        """Values held now (read or not)."""
        return len(self._items)

    def _expire(self, now: float) -> None:
        cutoff = now - self.window_s
        while self._items and self._items[0][0] < cutoff:
            self._items.popleft()

    def _values(self, now: float | None) -> list[float]:
        self._expire(time.monotonic() if now is None else now)
        return [value for _, value in self._items]

    def quantile(self, q: float, now: float | None = None) -> float:
        """The q-quantile (nearest rank) of the window, 0.0 when empty."""
        values = sorted(self._values(now))
        if not values:
            return 0.0
        rank = max(0, math.ceil(q * len(values)) - 1)  # nearest rank
        return values[min(rank, len(values) - 1)]

    def mean(self, now: float | None = None) -> float:
        """The mean of the window, 0.0 when empty."""
        values = self._values(now)
        return sum(values) / len(values) if values else 0.0


