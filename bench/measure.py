"""What the load benchmarks measure per request, and how a run of requests is summarized.

Shared by `bench/client.py` (through HTTP) and `bench/pipeline.py` (in process, no Ray), so both print
the same JSON fields and the difference between them is serving overhead.

Per request (`RequestResult`): time to first audio (first non-empty audio bytes), the gaps between
audio chunks as they arrived, end-to-end time, audio seconds, real-time factor (generation time /
audio duration) and the buffer underruns of a listener who starts playback on the first audio byte.
"""
from __future__ import annotations

import asyncio
import bisect
import functools
import itertools
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SAMPLE_RATE = 24000  # PCM16 mono, as every response format of the server carries
BYTES_PER_SAMPLE = 2
PERCENTILES = (50, 90, 99)
FILLER = "The quick brown fox jumps over the lazy dog while the band plays on. "


class PlaybackClock:
    """A player that starts on the first audio, plays at `sample_rate`, and stalls when its buffer is empty.

    An underrun happens when a chunk arrives after the buffered audio ran out: the player has been
    silent for (arrival - run-out time), and resumes with the new chunk. The end of the stream is not
    an underrun. `stalled_at_audio_s` holds, per underrun, the seconds of audio played before it (all the
    audio received until then), which says which of the stream's chunks came late.
    """

    def __init__(self, sample_rate: int = SAMPLE_RATE) -> None:
        self.sample_rate = sample_rate
        self.stall_s = 0.0
        self.stalled_at_audio_s: list[float] = []
        self._runs_out_at: float | None = None  # when the buffered audio will have been played
        self._received = 0  # samples so far

    def add(self, now: float, num_samples: int) -> None:
        """Audio of `num_samples` samples arrived at time `now` (seconds, any fixed origin)."""
        if num_samples <= 0:
            return
        duration = num_samples / self.sample_rate
        if self._runs_out_at is None:  # playback starts with the first audio
            self._runs_out_at = now + duration
        elif now > self._runs_out_at:
            self.stall_s += now - self._runs_out_at
            self.stalled_at_audio_s.append(self._received / self.sample_rate)
            self._runs_out_at = now + duration
        else:
            self._runs_out_at += duration
        self._received += num_samples

    @property
    def num_underruns(self) -> int:
        return len(self.stalled_at_audio_s)


@dataclass
class RequestResult:
    """One request as the client saw it; times are seconds from the moment the request was sent."""

    status: int | None = None  # HTTP status (200 in process); None when no response came
    error: str | None = None  # why the request failed, None when it succeeded
    request_id: str | None = None
    ttfa_s: float | None = None
    chunk_gaps_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    num_samples: int = 0
    num_chunks: int = 0
    stall_s: float = 0.0
    stalled_at_audio_s: list[float] = field(default_factory=list)  # audio played before each underrun
    num_audio_codes: int | None = None  # as the server (or the engine) reported it, when known
    num_prompt_tokens: int | None = None
    num_cached_prompt_tokens: int | None = None  # of them served by the prefix cache, when known
    first_codes_s: float | None = None  # in process only: when the engine's first codes came out
    # over HTTP with the server's summary: the time to first audio split into stages (deployments/timeline.py)
    first_audio_stages_s: dict[str, float] | None = None

    @property
    def is_ok(self) -> bool:
        """Succeeded: status 200, no error, some audio."""
        return self.status == 200 and self.error is None and self.num_samples > 0

    @property
    def num_underruns(self) -> int:
        return len(self.stalled_at_audio_s)

    @property
    def audio_s(self) -> float:
        """Seconds of audio received."""
        return self.num_samples / SAMPLE_RATE

    @property
    def rtf(self) -> float | None:
        """Real-time factor: generation time (request sent -> last audio) / audio duration."""
        return self.e2e_s / self.audio_s if self.num_samples else None


# Reads that follow the previous one within this are the same chunk: the HTTP client reads at most 64 KiB at a
# time, so a chunk of 25 codes (96,000 bytes of PCM16) arrives as two reads microseconds apart, while the
# server's chunks are a vocoder step or more apart (several ms at least).
CHUNK_MERGE_S = 0.002


class AudioTimeline:
    """Records audio arrivals of one request: TTFA, chunk gaps and the playback clock. A chunk is a burst of
    reads, each within CHUNK_MERGE_S of the one before; a gap is the time from a chunk's last read to the next
    chunk's first."""

    def __init__(self, started: float, result: RequestResult) -> None:
        self.started = started
        self.result = result
        self.clock = PlaybackClock()
        self._last_at: float | None = None

    def add(self, now: float, num_samples: int) -> None:
        """`num_samples` samples of audio arrived at `now` (same clock as `started`)."""
        if num_samples <= 0:
            return
        result = self.result
        if self._last_at is None:
            result.ttfa_s = now - self.started
            result.num_chunks += 1
        elif now - self._last_at >= CHUNK_MERGE_S:
            result.chunk_gaps_s.append(now - self._last_at)
            result.num_chunks += 1
        self._last_at = now
        result.num_samples += num_samples
        self.clock.add(now, num_samples)

    def finish(self, now: float) -> None:
        """The response ended at `now`."""
        self.result.e2e_s = now - self.started
        self.result.stall_s = self.clock.stall_s
        self.result.stalled_at_audio_s = list(self.clock.stalled_at_audio_s)


class LoopLag:
    """How late the driver's own event loop wakes up (sleeps of `interval_s`, lateness recorded).

    At high concurrency one Python process reads every stream; when its loop lags, the driver's
    timestamps (TTFA, gaps) include that lag. Reported per level as `driver_loop_lag_s`.
    """

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self.lags_s: list[float] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.lags_s.append(max(0.0, time.perf_counter() - before - self.interval_s))

    def start(self) -> None:
        """Start sampling (call inside the running loop)."""
        self.lags_s = []
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> dict[str, float | int | None]:
        """Stop sampling -> percentiles of the lateness in seconds."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        return percentiles(self.lags_s)


def percentiles(values: Sequence[float]) -> dict[str, float | int | None]:
    """p50/p90/p99 (linear interpolation), mean, max and count of `values` (None when empty)."""
    if not values:
        return {"count": 0, "p50": None, "p90": None, "p99": None, "mean": None, "max": None}
    array = np.asarray(values, dtype=np.float64)
    out: dict[str, float | int | None] = {"count": int(array.size)}
    for q in PERCENTILES:
        out[f"p{q}"] = float(np.percentile(array, q))
    out["mean"] = float(array.mean())
    out["max"] = float(array.max())
    return out


MAX_ERROR_MESSAGES = 5


def summarize(results: Sequence[RequestResult], wall_s: float, **extra: Any) -> dict[str, Any]:
    """One level (concurrency or rate) of a run as a JSON-able dict; failed requests only count."""
    ok = [r for r in results if r.is_ok]
    errors = Counter(_error_key(r) for r in results if not r.is_ok)
    audio_s = sum(r.audio_s for r in ok)
    codes = sorted({r.num_audio_codes for r in ok if r.num_audio_codes is not None})
    prompts = sorted({r.num_prompt_tokens for r in ok if r.num_prompt_tokens is not None})
    return {
        **extra,
        "num_requests": len(results),
        "num_ok": len(ok),
        "errors": dict(sorted(errors.items())),
        # each distinct failure text once (at most MAX_ERROR_MESSAGES), with how many requests had it
        "error_messages": dict(Counter(r.error or "no audio" for r in results if not r.is_ok)
                               .most_common(MAX_ERROR_MESSAGES)),
        "wall_s": wall_s,
        "audio_s_total": audio_s,
        "audio_s_per_wall_s": audio_s / wall_s if wall_s > 0 else None,
        "ttfa_s": percentiles([r.ttfa_s for r in ok if r.ttfa_s is not None]),
        "first_codes_s": percentiles([r.first_codes_s for r in ok if r.first_codes_s is not None]),
        "chunk_gap_s": percentiles([gap for r in ok for gap in r.chunk_gaps_s]),
        "e2e_s": percentiles([r.e2e_s for r in ok]),
        "rtf": percentiles([r.rtf for r in ok if r.rtf is not None]),
        "audio_s_per_request": percentiles([r.audio_s for r in ok]),
        "chunks_per_request": percentiles([float(r.num_chunks) for r in ok]),
        "underruns": {
            "total": sum(r.num_underruns for r in ok),
            "requests_with_underrun": sum(1 for r in ok if r.num_underruns),
            "stall_s_total": sum(r.stall_s for r in ok),
            "stall_s_per_request": percentiles([r.stall_s for r in ok]),
            "by_audio_played_s": stall_positions([t for r in ok for t in r.stalled_at_audio_s]),
        },
        "num_audio_codes_seen": codes,
        "num_prompt_tokens_seen": prompts,
        "num_cached_prompt_tokens": percentiles([float(r.num_cached_prompt_tokens) for r in ok
                                                 if r.num_cached_prompt_tokens is not None]),
        "first_audio_stages_s": stage_percentiles([r.first_audio_stages_s for r in ok if r.first_audio_stages_s]),
    }


def stage_percentiles(stages: Sequence[dict[str, float]]) -> dict[str, dict[str, float | None]]:
    """Per stage (in the order the requests list them; a stage only some requests have, such as speech
    input's, counted over those), percentiles of its seconds over requests."""
    names = list(dict.fromkeys(name for s in stages for name in s))
    return {name: percentiles([s[name] for s in stages if name in s]) for name in names}


STALL_POSITION_EDGES_S = (0.5, 1.0, 2.0, 4.0)


def stall_positions(played_s: Sequence[float]) -> dict[str, int]:
    """Underruns counted by the seconds of audio played before them: "<0.5", "0.5-1", "1-2", "2-4", ">=4"
    (early bins = the first, small chunks came late; later ones = steady chunks)."""
    edges = STALL_POSITION_EDGES_S
    names = [f"<{edges[0]:g}"] + [f"{a:g}-{b:g}" for a, b in itertools.pairwise(edges)] + [f">={edges[-1]:g}"]
    counts = dict.fromkeys(names, 0)
    for t in played_s:
        counts[names[bisect.bisect_right(edges, t)]] += 1
    return counts


def playback_left_s(result: RequestResult) -> float:
    """Seconds from the end of `result`'s response until a listener who started playing at its first audio
    (and paused at every stall) hears the last sample; 0 for a failed request."""
    if not result.is_ok or result.ttfa_s is None:
        return 0.0
    return max(0.0, result.ttfa_s + result.audio_s + result.stall_s - result.e2e_s)


async def closed_loop(run_one: Callable[[], Awaitable[RequestResult]], concurrency: int, num_requests: int,
                      ramp_s: float = 0.0, listen: bool = False,
                      sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
                      clock: Callable[[], float] = time.perf_counter) -> tuple[list[RequestResult], float]:
    """`concurrency` workers run `num_requests` requests back to back -> (results, wall seconds).

    With `ramp_s` > 0, worker k starts k * ramp_s / concurrency seconds after worker 0: arrivals are spread
    as in a service that has been running for a while, instead of all at once (a burst, ramp_s = 0).
    With `listen`, a worker plays each reply in real time before it sends its next request (one turn of a
    conversation; `playback_left_s`, counted from the response's end: work `run_one` does after it, such as
    fetching the server's summary, is part of that wait), so `concurrency` is the number of simultaneous
    listeners; without it, a worker sends its next request as soon as the last byte arrived, and a server
    faster than real time serves more audio per second than `concurrency` listeners would hear.
    """
    remaining = iter(range(num_requests))
    results: list[RequestResult] = []
    workers = min(concurrency, num_requests)

    async def worker(k: int) -> None:
        if k and ramp_s > 0:
            await sleep(k * ramp_s / workers)
        last: RequestResult | None = None
        after_end_s = 0.0  # how long `run_one` went on after the last response ended
        for _ in remaining:  # a shared iterator: each index is taken by exactly one worker
            if listen and last is not None:
                await sleep(max(0.0, playback_left_s(last) - after_end_s))
            sent = clock()
            last = await run_one()
            after_end_s = max(0.0, clock() - sent - last.e2e_s)
            results.append(last)

    started = clock()
    await asyncio.gather(*(worker(k) for k in range(workers)))
    return results, clock() - started


def _error_key(result: RequestResult) -> str:
    if result.status is None:
        return f"no_response:{(result.error or 'unknown').split(':')[0]}"
    if result.status == 200:
        return "200_incomplete"
    return str(result.status)


def requests_per_level(levels: Sequence[int], requests: str | None) -> list[int]:
    """Measured requests at each concurrency level: one number for all, a comma list (one per level),
    or None for max(8, 2 x concurrency). Fewer requests than a level's concurrency is refused: the level would
    run only as many workers as requests, under the concurrency's label."""
    if requests is None:
        return [max(8, 2 * c) for c in levels]
    counts = [int(n) for n in requests.split(",") if n.strip()]
    if len(counts) == 1:
        counts = counts * len(levels)
    if len(counts) != len(levels) or min(counts) < 1:
        raise ValueError(f"--requests {requests!r} must be one count >= 1 or one per level {list(levels)}")
    short = [(c, n) for c, n in zip(levels, counts, strict=True) if n < c]
    if short:
        raise ValueError(f"--requests {requests!r}: concurrency {short[0][0]} needs at least {short[0][0]} "
                         f"requests, got {short[0][1]}")
    return counts


def speech_prompt_text(num_prompt_tokens: int, variant: int | None = None) -> str:
    """Input text whose speech prompt is exactly `num_prompt_tokens` rows with the presets' byte-level
    tokenizer (the ingress's read-aloud system prompt + chat template + this text).

    With `variant`, the text starts with that number's 7 digits reversed (the fastest-changing digit
    first), so prompts of different variants share only the system prompt's KV blocks in the prefix
    cache (the first 128 rows with 16-row blocks), as different users' requests would.
    """
    num_chars = num_prompt_tokens - _speech_prompt_rows("")  # one byte-level token per ASCII character
    head = "" if variant is None else f"{variant % 10**7:07d}"[::-1] + " "
    if num_chars < len(head) + 1:
        raise ValueError(f"the fixed speech prompt takes {num_prompt_tokens - num_chars} tokens; ask for more")
    text = (head + FILLER * (num_chars // len(FILLER) + 1))[:num_chars]
    assert _speech_prompt_rows(text) == num_prompt_tokens
    return text


@functools.cache
def _tiny_tokenizer() -> Any:
    from runtime.tokenizer import Tokenizer

    return Tokenizer.tiny()


def _speech_prompt_rows(text: str) -> int:
    from runtime.prompts import read_aloud_rows

    return len(read_aloud_rows(_tiny_tokenizer(), text))


def plot_levels(levels: Sequence[dict[str, Any]], path: str, *, x_key: str = "concurrency",
                title: str = "") -> None:
    """PNG: TTFA and chunk-gap p50/p99 (ms) against concurrency (or arrival rate)."""
    plot_series([("", levels)], path, x_key=x_key, title=title)


def plot_series(series: Sequence[tuple[str, Sequence[dict[str, Any]]]], path: str, *,
                x_key: str = "concurrency", title: str = "") -> None:
    """PNG: TTFA and chunk-gap p50/p99 (ms) against `x_key`, one pair of lines per (name, levels)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_xs = sorted({level[x_key] for _, levels in series for level in levels})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, name in ((axes[0], "ttfa_s", "time to first audio"), (axes[1], "chunk_gap_s", "chunk gap")):
        for index, (label, levels) in enumerate(series):
            xs = [level[x_key] for level in levels]
            for q, style in (("p50", "o-"), ("p99", "s--")):
                ys = [_ms(level[key][q]) for level in levels]
                ax.plot(xs, ys, style, color=f"C{index}", label=f"{label} {q}".strip())
        ax.set_xlabel(x_key.replace("_", " "))
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(name)
        if len(all_xs) > 1 and min(all_xs) > 0 and max(all_xs) / min(all_xs) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(all_xs, [f"{x:g}" for x in all_xs])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ms(value: float | None) -> float:
    return math.nan if value is None else value * 1000.0


def main(argv: list[str] | None = None) -> None:
    """`python bench/measure.py A.json [B.json ...] OUT.png`: draw saved client/pipeline summaries, one
    line pair each (for machines without matplotlib: run the benchmark there, plot here)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("summaries", nargs="+", help="JSON written by bench/client.py or bench/pipeline.py")
    parser.add_argument("png")
    args = parser.parse_args(argv)
    loaded = []
    for path in args.summaries:
        with open(path) as f:
            loaded.append(json.loads(f.read()))
    x_key = "rate_per_s" if loaded[0].get("mode") == "open" else "concurrency"
    names = {"http_speech": "HTTP (Serve)", "inprocess_speech": "in process"}
    if len(loaded) == 1:
        title = f"{loaded[0].get('label', '')} {loaded[0].get('command', '')}"[:160]
        plot_series([("", loaded[0]["levels"])], args.png, x_key=x_key, title=title)
    else:
        series = [(names.get(s.get("benchmark", ""), s.get("label", "")), s["levels"]) for s in loaded]
        plot_series(series, args.png, x_key=x_key, title=" vs ".join(s.get("label", "") for s in loaded))


if __name__ == "__main__":
    main()
