"""A request's timeline: where the time to its first audio went, stage by stage.

The engine (`runtime.request.Timeline`), the LLM, vocoder and ingress deployments each set wall-clock marks
(`time.time()`) on a request; they travel to the ingress with the stream's last event and are kept in its
summary (`GET /admin/requests/{id}`, key `timeline`). A client that notes its own send and first-audio
times splits its time to first audio into the stages between consecutive marks (`first_audio_stages`),
which add up to that time exactly. Marks from different processes compare on one host (the benchmarks'
case); across hosts only as well as their clocks agree. No Ray import here (the benchmark client uses it).
"""
from __future__ import annotations

import time
from typing import Any

MAX_CODES = 32  # per-code marks kept for a request's first codes (= runtime.request.TIMELINE_CODES)

NTH = 0  # in a per-code mark: the code the vocoder's first audio waited for (`vocoder_first_chunk_codes`)

# (stage, mark that ends it); each stage starts at the previous mark, the first at the client's send. A mark
# is a timeline key, or (key, k) for the k-th (1-based; NTH: the n-th) of a per-code list of marks.
STAGES: tuple[tuple[str, str | tuple[str, int]], ...] = (
    ("client_to_ingress", "ingress_received"),      # HTTP request in, to the ingress handler
    ("ingress_to_vocoder", "vocoder_received"),     # speech input decoded, Serve call ingress -> vocoder
    ("speech_encode", "vocoder_speech_encoded"),    # speech input -> codes (only with speech input)
    ("vocoder_to_llm", "llm_received"),             # Serve call vocoder -> LLM
    ("llm_to_engine", "engine_arrived"),            # prompt rows built, request queued in the engine
    ("engine_queue", "engine_first_scheduled"),     # waiting for its first step
    ("first_code", ("engine_codes", 1)),            # prefill + sampling, read on the host
    ("more_codes", ("engine_codes", NTH)),          # decode steps up to the n-th code
    ("llm_send", ("llm_codes_sent", NTH)),          # engine thread -> the LLM deployment's stream
    ("llm_to_vocoder", ("vocoder_codes_received", NTH)),  # Serve stream item LLM -> vocoder
    ("vocoder_wait", "vocoder_first_step_started"),  # batcher picks the stream and starts a step
    ("vocoder_first_chunk", "vocoder_first_pcm"),   # that step's flow + BigVGAN, PCM back on the loop
    ("vocoder_to_ingress", "ingress_first_audio"),  # Serve stream item vocoder -> ingress
    ("ingress_to_client", "client_first_audio"),    # HTTP body bytes to the client
)


OPTIONAL_MARKS = frozenset({"vocoder_speech_encoded"})  # a request without speech input has no such stage


def stamp_codes(times: list[float], num_codes: int, now: float | None = None) -> None:
    """Append `now` (default: the wall clock) once per code of an event, keeping at most MAX_CODES."""
    now = time.time() if now is None else now
    times.extend([now] * max(0, min(num_codes, MAX_CODES - len(times))))


def _mark(timeline: dict[str, Any], mark: str | tuple[str, int], n: int) -> float | None:
    if isinstance(mark, str):
        return timeline.get(mark)
    key, k = mark[0], mark[1] or n
    times = timeline.get(key) or []
    return times[k - 1] if 1 <= k <= len(times) else None


def first_audio_stages(timeline: dict[str, Any], sent_at: float, first_audio_at: float) -> dict[str, float] | None:
    """Seconds per stage of STAGES between the client's send (`sent_at`) and its first audio bytes
    (`first_audio_at`), both wall clock; None when a mark is missing (e.g. a text-only request). A stage
    whose mark is in OPTIONAL_MARKS and absent is left out (its time is none: nothing happened there)."""
    marks = {**timeline, "client_first_audio": first_audio_at}
    n = timeline.get("vocoder_first_chunk_codes")
    if not isinstance(n, int) or n < 1:
        return None
    stages: dict[str, float] = {}
    previous = sent_at
    for stage, mark in STAGES:
        at = _mark(marks, mark, n)
        if at is None and mark in OPTIONAL_MARKS:
            continue
        if at is None:
            return None
        stages[stage] = at - previous
        previous = at
    return stages
