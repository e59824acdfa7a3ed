"""Soak under mixed traffic: does a running app stay correct, and give back everything, over many requests?

    python bench/soak.py --url http://127.0.0.1:8000 --duration 600 --concurrency 12 --out soak.json

`--concurrency` workers send requests back to back for `--duration` seconds, each drawn at random (seeded)
from a mix of what clients do (`MIX`):
- `speech`: `/v1/audio/speech` as raw PCM, WAV or SSE, with `min_new_tokens == max_new_tokens == n`, so
  exactly n codes and n x 1920 samples must arrive, and the server's summary must say n codes;
- `chat_audio`: a streamed chat with audio output (`max_tokens == min_new_tokens == n`): n codes, then text;
  the samples must equal the summary's codes x 1920;
- `chat_text`: a non-streamed text-only chat: one completion with a string and a finish reason;
- `speech_input`: a streamed chat whose user message is a 0.5-2 s WAV (noise): samples = codes x 1920;
- `disconnect_mid`: a long speech stream dropped after its first audio bytes; the server must record it as a
  client disconnect (499);
- `disconnect_early`: a long speech request dropped before its response head arrives;
- `bad`: one of a few malformed requests, each with its exact 4xx status and error `param`.
A 503 with Retry-After (the engine's queue is full) is counted, not failed: `--concurrency` above the
app's `max_num_running + max_num_waiting` makes it part of the mix.

At the end the app must become idle within `--settle-s`: no running or waiting sequence, no KV block in use,
no vocoder session or stream, no active ingress request. With `--replica-rss` the resident memory of each
of the app's replica processes on this machine (found by their `ray::ServeReplica:<app>:...` titles) is read
every 10 s; the summary gives each one's first, last and highest value after the warm-up, and every reading.
An app of the same name on another local Ray (the test suite's, say) is read too, unless `--ray-session` names
this app's Ray session folder (`bench/serve_app.py` prints it as `session_dir`): then only the processes whose
standard output goes to that session's logs count.

Prints one JSON summary (outcomes per kind, every failure's detail, idle check, memory); exit status 1 when
any request failed its check or the app did not settle. Traffic stays on loopback (`bench/client.py`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.client import (  # the repo root is on sys.path now
    CHAT_PATH,
    SAMPLES_PER_CODE,
    SPEECH_PATH,
    AudioStream,
    ChatAudioStream,
    check_url,
    pcm16_samples,
    question_wav,
    sse_payloads,
)

MIX = {"speech": 5, "chat_audio": 2, "chat_text": 1, "speech_input": 1, "disconnect_mid": 2,
       "disconnect_early": 1, "bad": 2}
LONG_CODES = 2000  # a disconnected request's length: it is never meant to end on its own
BAD = [  # (path, body: raw bytes or JSON, status, error param)
    (SPEECH_PATH, b'{"model": "moss-speech", "input": ', 400, None),
    (SPEECH_PATH, {"model": "moss-speech", "input": "hi", "voice": "no-such-voice"}, 400, "voice"),
    (SPEECH_PATH, {"model": "moss-speech", "input": ""}, 400, "input"),
    (SPEECH_PATH, {"model": "tts-1", "input": "hi"}, 404, "model"),
    (CHAT_PATH, {"model": "moss-speech", "messages": []}, 400, "messages"),
]


@dataclass
class Outcome:
    """One request: its kind, how it ended ("ok", "overloaded" or "failed") and why it failed."""

    kind: str
    result: str
    detail: str = ""


class Checked(Exception):
    """A response that broke the kind's contract (the message says how)."""


class Soak:
    """The request kinds, each sending one request and checking its answer exactly."""

    def __init__(self, client: httpx.AsyncClient, url: str, rng: random.Random, timeout_s: float) -> None:
        self.client, self.url, self.rng, self.timeout_s = client, url, rng, timeout_s

    def text(self) -> str:
        return f"Soak request {self.rng.randrange(10**9)}: the weather is fine today."

    async def run(self, kind: str) -> Outcome:
        try:
            async with asyncio.timeout(self.timeout_s):
                await getattr(self, kind)()
            return Outcome(kind, "ok")
        except _Overloaded as exc:
            return Outcome(kind, "overloaded", str(exc))
        except (Checked, httpx.HTTPError, ValueError, KeyError) as exc:
            return Outcome(kind, "failed", f"{type(exc).__name__}: {exc}")
        except TimeoutError:
            return Outcome(kind, "failed", f"no end within {self.timeout_s:g} s")

    async def _stream(self, path: str, body: dict[str, Any], feed: Callable[[bytes], int]) -> tuple[str, int]:
        """POST and read the whole stream -> (request id, samples fed)."""
        async with self.client.stream("POST", self.url + path, json=body) as response:
            await _expect_ok(response)
            samples = 0
            async for data in response.aiter_raw():
                samples += feed(data)
            return response.headers["x-moss-request-id"], samples

    async def _summary(self, request_id: str) -> dict[str, Any]:
        response = await self.client.get(f"{self.url}/admin/requests/{request_id}")
        if response.status_code != 200:
            raise Checked(f"no summary for {request_id}: HTTP {response.status_code}")
        return response.json()

    async def _finished(self, request_id: str, samples: int, codes: int | None) -> None:
        """The server's summary agrees: finished normally, with `codes` codes (None: any) and `samples`."""
        summary = await self._summary(request_id)
        if summary["status"] != 200 or summary["error"] is not None:
            raise Checked(f"{request_id}: server status {summary['status']}, error {summary['error']}")
        if codes is not None and summary["num_audio_codes"] != codes:
            raise Checked(f"{request_id}: {summary['num_audio_codes']} codes, expected {codes}")
        expected = summary["num_audio_codes"] * SAMPLES_PER_CODE
        if (samples, summary["num_audio_samples"]) != (expected, expected):
            raise Checked(f"{request_id}: {samples} samples received, {summary['num_audio_samples']} sent, "
                          f"expected {expected}")

    async def speech(self) -> None:
        n = self.rng.randint(4, 24)
        form = self.rng.choice(["pcm", "wav", "sse"])
        body = {"model": "moss-speech", "input": self.text(), "min_new_tokens": n, "max_new_tokens": n,
                "response_format": "wav" if form == "wav" else "pcm",
                "stream_format": "sse" if form == "sse" else "audio", "seed": self.rng.randrange(1000)}
        audio = SpeechSse() if form == "sse" else AudioStream(body["response_format"])
        request_id, samples = await self._stream(SPEECH_PATH, body, audio.feed)
        if problem := audio.incomplete():
            raise Checked(f"{request_id}: {problem}")
        if form == "sse" and audio.done_codes != n:
            raise Checked(f"{request_id}: speech.audio.done reports {audio.done_codes} codes, expected {n}")
        await self._finished(request_id, samples, n)

    async def _audio_chat(self, content: str | list[dict[str, Any]], max_tokens: int, min_codes: int) -> None:
        """A streamed chat with audio output; its samples must equal the codes the server counted x 1920."""
        body = {"model": "moss-speech", "stream": True, "modalities": ["text", "audio"],
                "audio": {"voice": "default", "format": "pcm16"}, "max_tokens": max_tokens,
                "min_new_tokens": min_codes, "messages": [{"role": "user", "content": content}]}
        audio = ChatAudioStream()
        request_id, samples = await self._stream(CHAT_PATH, body, audio.feed)
        if problem := audio.error or audio.incomplete():
            raise Checked(f"{request_id}: {problem}")
        await self._finished(request_id, samples, None)

    async def chat_audio(self) -> None:
        n = self.rng.randint(4, 16)
        await self._audio_chat(self.text(), n + 8, n)

    async def speech_input(self) -> None:
        seconds = self.rng.choice([0.5, 1.0, 2.0])
        part = {"type": "input_audio",
                "input_audio": {"data": question_wav(seconds, self.rng.randrange(10**6)), "format": "wav"}}
        await self._audio_chat([part], 16, 6)

    async def chat_text(self) -> None:
        body = {"model": "moss-speech", "max_tokens": self.rng.randint(2, 12),
                "messages": [{"role": "user", "content": self.text()}]}
        response = await self.client.post(self.url + CHAT_PATH, json=body)
        await _expect_ok(response)
        choice = response.json()["choices"][0]
        if not isinstance(choice["message"]["content"], str) or choice["finish_reason"] not in ("stop", "length"):
            raise Checked(f"unexpected completion: {choice}")

    async def disconnect_mid(self) -> None:
        body = {"model": "moss-speech", "input": self.text(), "min_new_tokens": LONG_CODES,
                "max_new_tokens": LONG_CODES, "response_format": "pcm"}
        keep = self.rng.randint(1, 3)  # audio reads before dropping
        async with self.client.stream("POST", self.url + SPEECH_PATH, json=body) as response:
            await _expect_ok(response)
            request_id = response.headers["x-moss-request-id"]
            reads = 0
            async for data in response.aiter_raw():
                reads += bool(data)
                if reads >= keep:
                    break
            else:
                raise Checked(f"{request_id}: a {LONG_CODES}-code stream ended after {reads} reads")
        # The ingress notes the disconnect when Serve cancels the body; its summary is read now, while the
        # replica still remembers the request (it keeps the latest few hundred)
        for _ in range(100):
            summary = await self._summary(request_id)
            if summary["status"] != "streaming":
                break
            await asyncio.sleep(0.1)
        if summary["status"] != 499:
            raise Checked(f"{request_id}: dropped mid-stream, recorded as {summary['status']}")

    async def disconnect_early(self) -> None:
        body = {"model": "moss-speech", "input": self.text(), "min_new_tokens": LONG_CODES,
                "max_new_tokens": LONG_CODES}
        try:
            async with asyncio.timeout(self.rng.uniform(0.001, 0.05)):
                async with self.client.stream("POST", self.url + SPEECH_PATH, json=body) as response:
                    await _expect_ok(response)
                    async for _ in response.aiter_raw():
                        pass
        except TimeoutError:
            return  # dropped, as meant (before or after the head: either must be freed)
        raise Checked(f"a {LONG_CODES}-code stream ended within 50 ms")

    async def bad(self) -> None:
        path, body, status, param = self.rng.choice(BAD)
        if isinstance(body, bytes):
            response = await self.client.post(self.url + path, content=body,
                                              headers={"content-type": "application/json"})
        else:
            response = await self.client.post(self.url + path, json=body)
        error = response.json().get("error") or {}
        if response.status_code != status or error.get("param") != param:
            raise Checked(f"{body!r}: HTTP {response.status_code} param {error.get('param')!r}, "
                          f"expected {status} {param!r}")


class _Overloaded(Exception):
    """A 503 with Retry-After: the app said it is full, as it may."""


async def _expect_ok(response: httpx.Response) -> None:
    if response.status_code == 200:
        return
    text = (await response.aread()).decode("utf-8", "replace")[:300]
    if response.status_code == 503 and "retry-after" in response.headers:
        raise _Overloaded(text)
    raise Checked(f"HTTP {response.status_code}: {text}")


class SpeechSse:
    """Samples of `speech.audio.delta` events, and the codes `speech.audio.done` reports (None: not seen)."""

    def __init__(self) -> None:
        self._buffer = b""
        self.done_codes: int | None = None

    def feed(self, data: bytes) -> int:
        payloads, self._buffer = sse_payloads(self._buffer + data)
        samples = 0
        for payload in payloads:
            if payload is None:  # `[DONE]`: not sent on this route
                raise ValueError("a [DONE] event in a speech stream")
            if payload["type"] == "speech.audio.delta":
                samples += pcm16_samples(payload["audio"])
            elif payload["type"] == "speech.audio.done":
                self.done_codes = payload["usage"]["audio_codes"]
        return samples

    def incomplete(self) -> str | None:
        """Why the stream, now ended, is cut short (None: it is not)."""
        return None if self.done_codes is not None else "the stream ended without speech.audio.done"


def replica_rss(app: str, session_dir: str | None = None, proc_root: Path = Path("/proc")) -> dict[str, int]:
    """Resident bytes of this machine's processes titled `ray::ServeReplica:<app>:...`, by title; given a Ray
    session folder, only those whose standard output is a file under it (a Ray worker's log)."""
    found: dict[str, int] = {}
    logs = None if session_dir is None else Path(session_dir).resolve()
    for proc in proc_root.iterdir():
        if not proc.name.isdigit():
            continue
        try:
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            if not title.startswith(f"ray::ServeReplica:{app}:"):
                continue
            if logs is not None and logs not in Path(os.readlink(proc / "fd" / "1")).parents:
                continue
            rss = resident_bytes(proc)
        except OSError:  # gone meanwhile
            continue
        # the title's suffix names the method running now (".handle_request_with_rejection"): not part of the name
        deployment = title.removeprefix(f"ray::ServeReplica:{app}:").split(".")[0].split()[0]
        found[f"{deployment} (pid {proc.name})"] = rss
    return found


def resident_bytes(proc: Path = Path("/proc/self")) -> int:
    """A process's resident memory (VmRSS of its /proc status), in bytes."""
    status = (proc / "status").read_text().splitlines()
    return 1024 * next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def is_idle(stats: dict[str, Any]) -> bool:
    """Nothing held: sequences, KV blocks, engine request state, vocoder sessions and streams, ingress requests."""
    llm, vocoder = stats["llm"], stats["vocoder"]
    return (llm["num_running"], llm["num_waiting"], llm["num_blocks_used"], llm["num_tracked_requests"],
            vocoder["open_sessions"], vocoder["active_streams"], vocoder["batched_streams"],
            stats["ingress"]["active_requests"]) == (0,) * 8


async def soak(url: str, *, duration_s: float, concurrency: int, seed: int, timeout_s: float, settle_s: float,
               warmup: int, rss_app: str | None, ray_session: str | None = None) -> dict[str, Any]:
    """Run the mix, then check that the app settles -> the summary."""
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    outcomes: list[Outcome] = []
    rss: list[tuple[float, dict[str, int]]] = []
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=10.0),
                                 trust_env=False) as client:
        warm = Soak(client, url, random.Random(seed - 1), timeout_s)
        for outcome in [await warm.run("speech") for _ in range(warmup)]:
            if outcome.result != "ok":
                raise RuntimeError(f"warm-up request failed: {outcome.detail}")
        started = time.monotonic()
        soaks = [Soak(client, url, random.Random(seed * 1000 + w), timeout_s) for w in range(concurrency)]

        async def worker(s: Soak) -> None:
            kinds, weights = list(MIX), list(MIX.values())
            while time.monotonic() - started < duration_s:
                outcomes.append(await s.run(s.rng.choices(kinds, weights)[0]))

        async def sample_rss() -> None:
            while True:
                rss.append((time.monotonic() - started, replica_rss(rss_app, ray_session)))
                await asyncio.sleep(10.0)

        sampler = asyncio.create_task(sample_rss()) if rss_app else None
        await asyncio.gather(*(worker(s) for s in soaks))
        traffic_s = time.monotonic() - started
        settled_after, last = await _settle(client, url, settle_s)
        if sampler is not None:
            sampler.cancel()
            rss.append((time.monotonic() - started, replica_rss(rss_app, ray_session)))
    counts = Counter((o.kind, o.result) for o in outcomes)
    failures = [f"{o.kind}: {o.detail}" for o in outcomes if o.result == "failed"]
    return {
        "duration_s": round(traffic_s, 1), "concurrency": concurrency, "seed": seed, "mix": MIX,
        "num_requests": len(outcomes),
        "outcomes": {kind: {result: counts[(kind, result)] for result in ("ok", "overloaded", "failed")
                            if counts[(kind, result)]} for kind in MIX},
        "failures": failures[:50], "num_failures": len(failures),
        "settled": settled_after is not None, "settled_after_s": settled_after, "final_stats": last,
        "replica_rss": _rss_summary(rss),
    }


async def _settle(client: httpx.AsyncClient, url: str, settle_s: float) -> tuple[float | None, dict[str, Any]]:
    """Poll /admin/stats until idle -> (seconds it took or None, the last stats)."""
    began = time.monotonic()
    while True:
        stats = (await client.get(f"{url}/admin/stats")).json()
        waited = time.monotonic() - began
        if is_idle(stats):
            return round(waited, 2), stats
        if waited > settle_s:
            return None, stats
        await asyncio.sleep(0.5)


def _rss_summary(samples: list[tuple[float, dict[str, int]]]) -> dict[str, Any]:
    """Per replica process: first, last and highest resident MiB, when each was read, and every reading."""
    names = sorted({name for _, found in samples for name in found})
    mib = 2**20
    out = {}
    for name in names:
        series = [(t, found[name]) for t, found in samples if name in found]
        out[name] = {"first_mib": round(series[0][1] / mib, 1), "first_at_s": round(series[0][0], 1),
                     "last_mib": round(series[-1][1] / mib, 1), "last_at_s": round(series[-1][0], 1),
                     "max_mib": round(max(v for _, v in series) / mib, 1), "samples": len(series),
                     "series": [[round(t, 1), round(v / mib, 1)] for t, v in series]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the app (loopback only)")
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of traffic")
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0, help="per-request limit, seconds")
    parser.add_argument("--settle-s", type=float, default=60.0, help="how long the app may take to be idle")
    parser.add_argument("--warmup", type=int, default=2, help="speech requests before the clock starts")
    parser.add_argument("--replica-rss", default=None, metavar="APP",
                        help="read the resident memory of this Serve app's replica processes")
    parser.add_argument("--ray-session", default=None, metavar="DIR",
                        help="with --replica-rss: only the replicas of the Ray whose session folder this is")
    parser.add_argument("--out", default=None, help="also write the JSON summary here")
    args = parser.parse_args(argv)
    if args.ray_session is not None and args.replica_rss is None:
        parser.error("--ray-session needs --replica-rss")
    url = check_url(args.url)
    summary = asyncio.run(soak(url, duration_s=args.duration, concurrency=args.concurrency, seed=args.seed,
                               timeout_s=args.timeout, settle_s=args.settle_s, warmup=args.warmup,
                               rss_app=args.replica_rss, ray_session=args.ray_session))
    summary["command"] = shlex.join(["python", "bench/soak.py", *(argv if argv is not None else sys.argv[1:])])
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if summary["settled"] and not summary["num_failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
