"""HTTP load generator for `POST /v1/audio/speech` (streamed raw PCM or WAV), closed or open loop; with
`--speech-input-s`, spoken questions to `POST /v1/chat/completions` instead.

    python bench/client.py --concurrency 1,8,64 --requests 64 --max-new-tokens 100 --fixed-length
    python bench/client.py --rate 4 --duration 60 --max-new-tokens 100 --fixed-length

Closed loop: at each concurrency level, `c` workers send requests back to back until `--requests` have
finished; all start at once (a burst) unless `--ramp-s` spreads their first requests (steady state). With
`--listen`, a worker first plays each reply in real time (from its first audio, pausing at stalls) and sends
its next request when playback ends: `c` simultaneous listeners, as in conversations. Without it, a server
faster than real time serves more audio per second than `c` listeners hear. Open loop: requests arrive as
a Poisson process of `--rate` per second for `--duration` s, no matter how many are still in flight.
`--warmup` requests run first at every level and are not counted.
Per request see `bench/measure.py`; the script prints ONE JSON summary and writes a PNG (`--plot`).
`--speech-input-s S`: each request is a streamed chat whose one user message is an S-second 16 kHz WAV of
noise (distinct per request) in an `input_audio` part, with audio output; its audio is read from the SSE
chunks' `delta.audio.data`. Times count from the send, so they include the upload, decode and encode.
Traffic stays on loopback unless `--allow-remote` is given.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import ipaddress
import itertools
import json
import secrets
import shlex
import socket
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.measure import (  # the repo root is on sys.path now
    BYTES_PER_SAMPLE,
    SAMPLE_RATE,
    AudioTimeline,
    LoopLag,
    RequestResult,
    closed_loop,
    plot_levels,
    requests_per_level,
    speech_prompt_text,
    summarize,
)
from deployments.timeline import first_audio_stages

DEFAULT_URL = "http://127.0.0.1:8000"
SPEECH_PATH = "/v1/audio/speech"
CHAT_PATH = "/v1/chat/completions"
# vocoder.SAMPLES_PER_CODE (24 kHz at 12.5 codes a second); not imported, so the load tools stay free of torch
SAMPLES_PER_CODE = 1920
INPUT_SAMPLE_RATE = 16000  # the WAVs of --speech-input-s (vocoder.speech_encoder's; not imported: no torch here)
REQUEST_ID_HEADERS = ("x-moss-request-id", "x-request-id")
# Prompt variants of this process's requests, from a random start: two client processes against one
# server (e.g. a closed loop, then listeners) must not send the same texts, or the second one's prompts
# come from the prefix cache.
_variants = itertools.count(secrets.randbelow(10**7))


class WavFormatError(ValueError):
    """The response does not start with a 24 kHz mono PCM16 WAV header."""


class AudioStream:
    """Turns response bytes into PCM16 sample counts: strips and checks a WAV header, keeps odd bytes."""

    error: str | None = None  # raw audio has no error events (ChatAudioStream's has)

    def __init__(self, response_format: str) -> None:
        self._in_header = response_format == "wav"
        self._head = b""
        self._carry = 0  # bytes of an incomplete sample
        self.header: dict[str, int] = {}

    def feed(self, data: bytes) -> int:
        """Complete samples that `data` adds (0 while the WAV header is still arriving)."""
        if self._in_header:
            self._head += data
            data = self._parse_header()
            if self._in_header:
                return 0
        total = self._carry + len(data)
        self._carry = total % BYTES_PER_SAMPLE
        return total // BYTES_PER_SAMPLE

    def incomplete(self) -> str | None:
        """Why the stream, now ended, is not whole PCM16 audio (None: it is)."""
        if self._in_header:
            return "the stream ended inside the WAV header"
        return f"the stream ended {self._carry} byte into a sample" if self._carry else None

    def _parse_header(self) -> bytes:
        """Consume RIFF/WAVE chunks up to `data`; return the audio bytes after it (b"" if incomplete)."""
        head = self._head
        if len(head) < 12:
            return b""
        if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
            raise WavFormatError(f"not a RIFF/WAVE stream: {head[:12]!r}")
        pos = 12
        while len(head) >= pos + 8:
            chunk_id, size = head[pos:pos + 4], struct.unpack("<I", head[pos + 4:pos + 8])[0]
            if chunk_id == b"data":
                self._check_format()
                self._in_header = False
                self.header["data_size"] = size
                return head[pos + 8:]
            if len(head) < pos + 8 + size + (size & 1):
                return b""
            if chunk_id == b"fmt ":
                fmt, channels, rate, _, _, bits = struct.unpack("<HHIIHH", head[pos + 8:pos + 24])
                self.header.update(audio_format=fmt, channels=channels, sample_rate=rate, bits=bits)
            pos += 8 + size + (size & 1)  # chunks are padded to even sizes
        return b""

    def _check_format(self) -> None:
        expected = {"audio_format": 1, "channels": 1, "sample_rate": SAMPLE_RATE, "bits": 16}
        got = {k: self.header.get(k) for k in expected}
        if got != expected:
            raise WavFormatError(f"WAV format {got}, expected {expected}")


class ChatAudioStream:
    """Turns a streamed chat's SSE bytes into PCM16 sample counts (`delta.audio.data`, base64); keeps a partial
    event for the next read and the first error event's message in `error`."""

    def __init__(self) -> None:
        self._buffer = b""
        self.error: str | None = None
        self.done = False  # `[DONE]` seen: the stream ended as the server ends every chat stream

    def feed(self, data: bytes) -> int:
        """Samples of audio that the complete events in `data` (with what came before) carry."""
        chunks, self._buffer = sse_payloads(self._buffer + data)
        samples = 0
        for chunk in chunks:
            if chunk is None:
                self.done = True
            elif "error" in chunk:
                self.error = self.error or f"error event: {chunk['error'].get('message')}"
            else:
                for choice in chunk.get("choices", ()):
                    audio = (choice.get("delta") or {}).get("audio") or {}
                    if audio.get("data"):
                        samples += pcm16_samples(audio["data"])
        return samples

    def incomplete(self) -> str | None:
        """Why the stream, now ended, is cut short (None: it is not)."""
        return None if self.done else "the stream ended without [DONE]"


def sse_payloads(buffer: bytes) -> tuple[list[dict[str, Any] | None], bytes]:
    """The JSON `data:` payloads of the complete server-sent events in `buffer` (None for `[DONE]`), and the
    bytes of the incomplete event after them."""
    *events, rest = buffer.replace(b"\r\n", b"\n").split(b"\n\n")
    return [None if line[5:].strip() == b"[DONE]" else json.loads(line[5:]) for event in events
            for line in event.split(b"\n") if line.startswith(b"data:")], rest


def pcm16_samples(data: str) -> int:
    """Samples of one base64 PCM16 delta; ValueError for an odd number of bytes (every later sample of the
    stream would be misaligned)."""
    pcm = base64.b64decode(data)
    if len(pcm) % BYTES_PER_SAMPLE:
        raise ValueError(f"an audio delta of {len(pcm)} bytes is not whole PCM16 samples")
    return len(pcm) // BYTES_PER_SAMPLE


def question_wav(seconds: float, variant: int) -> str:
    """Base64 of a 16 kHz mono PCM16 WAV of `seconds` of noise, seeded by `variant` (a spoken question's
    stand-in: the encoder's cost depends on the length only)."""
    import soundfile

    noise = 0.1 * np.random.default_rng(variant).standard_normal(round(seconds * INPUT_SAMPLE_RATE))
    buffer = io.BytesIO()
    soundfile.write(buffer, noise.astype(np.float32), INPUT_SAMPLE_RATE, format="WAV", subtype="PCM_16")
    return base64.b64encode(buffer.getvalue()).decode()


@dataclass
class SpeechLoad:
    """What every request of a run asks for (OpenAI speech fields plus ours)."""

    url: str = DEFAULT_URL
    model: str = "moss-speech"
    input: str = "Hello there, this is a streaming speech benchmark."
    voice: str = "default"
    response_format: str = "pcm"  # pcm | wav
    max_new_tokens: int | None = 64
    min_new_tokens: int | None = None
    seed: int | None = 0
    temperature: float | None = None
    timeout_s: float = 600.0
    server_summary: bool = False  # GET /admin/requests/{id} after each request (codes, prompt tokens)
    prompt_tokens: int | None = None  # with unique_prompts: each request gets its own text of this length
    unique_prompts: bool = False
    speech_input_s: float | None = None  # spoken questions to the chat route instead of text to speak
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return CHAT_PATH if self.speech_input_s else SPEECH_PATH

    def short_by(self, num_samples: int) -> str | None:
        """Why a speech response of `num_samples` is not what a fixed length (min = max new tokens, every one an
        audio code) must give, or None; a chat's audio length is not fixed by its token budget."""
        if self.speech_input_s or self.max_new_tokens is None or self.min_new_tokens != self.max_new_tokens:
            return None
        expected = self.max_new_tokens * SAMPLES_PER_CODE
        return None if num_samples == expected else (
            f"{num_samples} samples received; {self.max_new_tokens} codes are {expected}")

    def payload(self) -> dict[str, Any]:
        """The JSON body of one request."""
        if self.speech_input_s:
            return self._chat_payload()
        text = self.input
        if self.unique_prompts and self.prompt_tokens:
            text = speech_prompt_text(self.prompt_tokens, variant=next(_variants))
        body: dict[str, Any] = {"model": self.model, "input": text, "voice": self.voice,
                                "response_format": self.response_format, "stream_format": "audio"}
        for key in ("max_new_tokens", "min_new_tokens", "seed", "temperature"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        return {**body, **self.extra}

    def _chat_payload(self) -> dict[str, Any]:
        """A streamed chat with audio output whose user message is one spoken question. `max_new_tokens` is
        chat's `max_tokens`; `temperature`, which in chat samples the text channel, is not sent."""
        part = {"type": "input_audio",
                "input_audio": {"data": question_wav(self.speech_input_s, next(_variants)), "format": "wav"}}
        body: dict[str, Any] = {"model": self.model, "stream": True, "modalities": ["text", "audio"],
                                "audio": {"voice": self.voice, "format": "pcm16"},
                                "messages": [{"role": "user", "content": [part]}]}
        for key, name in (("max_new_tokens", "max_tokens"), ("min_new_tokens", "min_new_tokens"), ("seed", "seed")):
            if getattr(self, key) is not None:
                body[name] = getattr(self, key)
        return {**body, **self.extra}


def check_url(url: str, allow_remote: bool = False) -> str:
    """`url` without a trailing slash; ValueError for a non-loopback host unless `allow_remote`."""
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"--url must be http(s)://host[:port], got {url!r}")
    if not allow_remote and not _is_loopback(parsed.host):
        raise ValueError(f"refusing to send load to {parsed.host!r}: not a loopback address "
                         f"(pass --allow-remote to override)")
    return url.rstrip("/")


def _is_loopback(host: str) -> bool:
    if host == "localhost":  # a name: every address it resolves to must be loopback (/etc/hosts may differ)
        try:
            addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
        except OSError:
            return False
        return bool(addresses) and all(_is_loopback(a) for a in addresses)
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def prompt_text(num_prompt_tokens: int) -> str:
    """Input text giving a prompt of exactly `num_prompt_tokens` (see `bench.measure.speech_prompt_text`)."""
    return speech_prompt_text(num_prompt_tokens)


async def run_request(client: httpx.AsyncClient, load: SpeechLoad) -> RequestResult:
    """Send one request and time its audio as it arrives; never raises for HTTP or network failures."""
    result = RequestResult()
    body = load.payload()
    started = time.perf_counter()
    sent_at = time.time()  # wall clock, to place the server's timeline marks
    timeline = AudioTimeline(started, result)
    audio = ChatAudioStream() if load.speech_input_s else AudioStream(load.response_format)
    ended = False
    try:
        # the whole request (its server summary included), not each read: a server trickling bytes would
        # otherwise keep it alive for ever
        async with asyncio.timeout(load.timeout_s):
            async with client.stream("POST", load.url + load.path, json=body,
                                     timeout=httpx.Timeout(load.timeout_s, connect=10.0)) as response:
                result.status = response.status_code
                result.request_id = next((response.headers[h] for h in REQUEST_ID_HEADERS
                                          if h in response.headers), None)
                if response.status_code != 200:
                    text = (await response.aread()).decode("utf-8", "replace")
                    result.error = f"HTTP {response.status_code}: {text[:200]}"
                else:
                    async for data in response.aiter_raw():
                        timeline.add(time.perf_counter(), audio.feed(data))
                    # a chat's error event after its 200, else a stream cut short (raw audio can only stop
                    # short when the server fails)
                    result.error = audio.error or audio.incomplete() or load.short_by(result.num_samples)
            timeline.finish(time.perf_counter())
            ended = True
            if result.status == 200 and load.server_summary and result.request_id:
                await _add_server_summary(client, load, result, sent_at)
    except (httpx.HTTPError, WavFormatError, ValueError) as exc:  # ValueError: an event that is not JSON
        result.error = f"{type(exc).__name__}: {exc}"
    except TimeoutError:
        result.error = f"timed out after {load.timeout_s:g} s"
    if not ended:  # the response ended with the exception
        timeline.finish(time.perf_counter())
    return result


async def _add_server_summary(client: httpx.AsyncClient, load: SpeechLoad, result: RequestResult,
                              sent_at: float) -> None:
    response = await client.get(f"{load.url}/admin/requests/{result.request_id}", timeout=30.0)
    if response.status_code != 200:
        result.error = f"no server summary for {result.request_id}: HTTP {response.status_code}"
        return
    try:
        summary = response.json()
    except ValueError:  # not JSON (a proxy's page, say): no summary, the run goes on
        result.error = f"no server summary for {result.request_id}: the reply is not JSON"
        return
    result.num_audio_codes = summary.get("num_audio_codes")
    result.num_prompt_tokens = summary.get("num_prompt_tokens")
    result.num_cached_prompt_tokens = summary.get("num_cached_prompt_tokens")
    if result.ttfa_s is not None and summary.get("timeline"):
        result.first_audio_stages_s = first_audio_stages(summary["timeline"], sent_at, sent_at + result.ttfa_s)
    if summary.get("status") != 200:  # raw audio can only stop short when the server fails mid-way
        error = summary.get("error") or {}
        result.error = (f"server ended the stream with status {summary.get('status')}"
                        + (f" ({error['kind']}: {error['message']})" if error else ""))


async def run_closed_loop(client: httpx.AsyncClient, load: SpeechLoad, concurrency: int,
                          num_requests: int, ramp_s: float = 0.0,
                          listen: bool = False) -> tuple[list[RequestResult], float]:
    """`concurrency` workers send `num_requests` requests back to back -> (results, wall seconds);
    `ramp_s` spreads the workers' first requests (`bench.measure.closed_loop`)."""
    return await closed_loop(lambda: run_request(client, load), concurrency, num_requests, ramp_s, listen)


async def run_open_loop(client: httpx.AsyncClient, load: SpeechLoad, rate: float, duration_s: float,
                        seed: int = 0) -> tuple[list[RequestResult], float]:
    """Poisson arrivals at `rate`/s for `duration_s` s; waits for all -> (results, wall seconds)."""
    rng = np.random.default_rng(seed)
    arrivals: list[float] = []
    at = float(rng.exponential(1.0 / rate))
    while at < duration_s:
        arrivals.append(at)
        at += float(rng.exponential(1.0 / rate))
    started = time.perf_counter()

    async def send_at(offset: float) -> RequestResult:
        await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
        return await run_request(client, load)

    results = await asyncio.gather(*(send_at(offset) for offset in arrivals))
    return list(results), time.perf_counter() - started


async def run_benchmark(load: SpeechLoad, *, concurrency_levels: list[int], num_requests: list[int],
                        warmup: int, rate: float | None = None, duration_s: float = 0.0,
                        seed: int = 0, ramp_s: float = 0.0, listen: bool = False,
                        on_level: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Every level (closed loop) or the one open-loop run, each after its warm-up -> level summaries.

    `on_level(levels_so_far)` is called after each level (the CLI saves partial results with it)."""
    most = max([*concurrency_levels, warmup, 1]) + 16
    limits = httpx.Limits(max_connections=None if rate else most, max_keepalive_connections=most)
    levels: list[dict[str, Any]] = []
    lag = LoopLag()
    # trust_env off: an HTTP(S)_PROXY from the environment would carry the loopback load to another host
    async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
        if rate is not None:
            if warmup:
                await run_closed_loop(client, load, warmup, warmup)
            lag.start()
            results, wall_s = await run_open_loop(client, load, rate, duration_s, seed)
            levels.append(summarize(results, wall_s, rate_per_s=rate, duration_s=duration_s,
                                    driver_loop_lag_s=lag.stop()))
            return levels
        for concurrency, count in zip(concurrency_levels, num_requests, strict=True):
            if warmup:
                await run_closed_loop(client, load, concurrency, warmup)
            lag.start()
            results, wall_s = await run_closed_loop(client, load, concurrency, count, ramp_s, listen)
            levels.append(summarize(results, wall_s, concurrency=concurrency, ramp_s=ramp_s, listen=listen,
                                    driver_loop_lag_s=lag.stop()))
            if on_level is not None:
                on_level(levels)
    return levels


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=DEFAULT_URL, help="server base URL (loopback unless --allow-remote)")
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback host")
    p.add_argument("--concurrency", default="1,8,64", help="closed-loop levels, comma separated")
    p.add_argument("--requests", default=None,
                   help="measured requests per level: N, or one per level (default max(8, 2 x concurrency))")
    p.add_argument("--ramp-s", type=float, default=0.0,
                   help="closed loop: spread the workers' first requests over this many seconds (steady "
                        "state); 0 sends them all at once (a burst)")
    p.add_argument("--listen", action="store_true",
                   help="closed loop: each worker sends its next request only when its listener has played "
                        "the previous reply in real time (concurrency = simultaneous listeners)")
    p.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    p.add_argument("--duration", type=float, default=30.0, help="open loop: seconds of arrivals")
    p.add_argument("--warmup", type=int, default=2, help="uncounted requests before each level")
    p.add_argument("--model", default="moss-speech")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--input", default=None, help="text to speak")
    text.add_argument("--prompt-tokens", type=int, default=None,
                      help="pick input text so the prompt is exactly this many tokens (preset tokenizer)")
    p.add_argument("--same-prompt", action="store_true",
                   help="with --prompt-tokens: every request sends the same text (default: each request's "
                        "text starts with its own number, so only the system prompt hits the prefix cache)")
    text.add_argument("--speech-input-s", type=float, default=None,
                      help="spoken questions: each request a streamed chat with a WAV of this many seconds")
    p.add_argument("--voice", default="default")
    p.add_argument("--response-format", choices=("pcm", "wav"), default="pcm")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--fixed-length", action="store_true",
                   help="min_new_tokens = max_new_tokens: every request yields the same number of codes")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--seed", type=int, default=0, help="request seed and open-loop arrival seed")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--server-summary", action="store_true",
                   help="read each request's code and prompt-token counts from GET /admin/requests/{id}")
    p.add_argument("--out", default=None, help="also write the JSON summary to this file")
    p.add_argument("--plot", default=None, help="PNG of TTFA / chunk gap p50 and p99 per level")
    p.add_argument("--label", default="", help="free text stored in the summary (hardware, config)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print one JSON line, write --out / --plot; returns the summary."""
    args = parse_args(argv)
    url = check_url(args.url, args.allow_remote)
    levels_asked = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if args.rate is None and (not levels_asked or min(levels_asked) < 1):
        raise SystemExit("--concurrency needs levels >= 1")
    if args.ramp_s < 0:
        raise SystemExit("--ramp-s must be >= 0")
    if args.rate is not None and args.listen:
        raise SystemExit("--listen is for the closed loop; an open loop's arrivals do not wait for listeners")
    if args.rate is not None and not (args.rate > 0 and args.duration > 0):
        raise SystemExit("--rate and --duration must be > 0")
    if args.speech_input_s is not None and not args.speech_input_s >= 0.08:
        raise SystemExit("--speech-input-s must be at least 0.08 (one code)")
    text = prompt_text(args.prompt_tokens) if args.prompt_tokens else (args.input or SpeechLoad.input)
    load = SpeechLoad(url=url, model=args.model, input=text, voice=args.voice,
                      response_format=args.response_format, max_new_tokens=args.max_new_tokens,
                      min_new_tokens=args.max_new_tokens if args.fixed_length else None, seed=args.seed,
                      temperature=args.temperature, timeout_s=args.timeout,
                      server_summary=args.server_summary, prompt_tokens=args.prompt_tokens,
                      unique_prompts=bool(args.prompt_tokens) and not args.same_prompt,
                      speech_input_s=args.speech_input_s)
    request = {k: v for k, v in asdict(load).items() if k not in ("input", "extra", "url")}
    request.update(input_chars=len(text), input_head=text[:48])
    summary: dict[str, Any] = {
        "benchmark": "http_speech",
        "command": shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(argv),
        "argv": sys.argv if argv is None else argv,
        "url": url, "label": args.label, "mode": "open" if args.rate is not None else "closed",
        "concurrency_levels": [] if args.rate is not None else levels_asked,
        "warmup_per_level": args.warmup, "request": request, "complete": False, "levels": [],
    }

    def save(levels: list[dict[str, Any]]) -> None:
        summary["levels"] = levels
        if args.out:  # after every level, so a run cut short keeps what it measured
            Path(args.out).write_text(json.dumps(summary) + "\n")

    levels = asyncio.run(run_benchmark(
        load, concurrency_levels=levels_asked, num_requests=requests_per_level(levels_asked, args.requests), warmup=args.warmup,
        rate=args.rate, duration_s=args.duration, seed=args.seed, ramp_s=args.ramp_s, listen=args.listen,
        on_level=save))
    summary["complete"] = True
    if args.plot:
        x_key = "rate_per_s" if args.rate is not None else "concurrency"
        plot_levels(levels, args.plot, x_key=x_key, title=f"{summary['label']} {summary['command']}"[:160])
        summary["plot"] = args.plot
    save(levels)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
