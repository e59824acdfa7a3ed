"""What one request body costs the ingress's event loop: the loop's lateness while `Ingress` takes the body.

    python bench/ingress_parse.py --out bench/results/ingress-parse-cpu/<name>.json

In process, no Ray: the vocoder handle is scripted (the voice lookup, then a stream of `started` and `done`), so
the time is the edge's own: reading the body, the JSON and schema checks, and for chat the speech decoding on a
worker thread. Every other stream on an ingress replica shares this loop, so its lateness is the stall they see.
Bodies (each near a limit of the edge, `deployments/validation.py`):
- `ignored-lists`: 8 MiB of empty lists in a field the schema ignores (the most JSON values per byte);
- `many-messages`: a chat of 1024 one-word messages (the most a chat may carry);
- `audio-chat`: a chat with 30 s of 48 kHz 16-bit stereo WAV in base64 (7.7 MB, under the 8 MiB limit);
- `speech`: a plain speech request, for scale.
Each body is sent `--repeats` times; the loop is sampled every `--interval-ms`, and its lateness over all the
repeats of one body is reported as percentiles with the answers' status codes and handling times.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import soundfile
from starlette.requests import Request

from bench.measure import LoopLag, percentiles
from deployments.ingress import Ingress

MAX_BODY_BYTES = 8 << 20


class _Stream:
    """One scripted utterance stream: `started`, then `done`."""

    def __init__(self) -> None:
        self.events = [{"type": "started"}, {"type": "done", "reason": "stop", "num_audio_codes": 0,
                                             "num_prompt_tokens": 1, "num_cached_prompt_tokens": 0, "timeline": {}}]

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if not self.events:
            raise StopAsyncIteration
        return self.events.pop(0)

    def cancel(self) -> None:
        pass


class _Voices:
    async def remote(self) -> list[str]:
        return ["default"]


class _Vocoder:
    def __init__(self) -> None:
        self.synthesize, self.voices = self, _Voices()

    def options(self, **_: Any) -> _Vocoder:
        return self

    def remote(self, _payload: Any) -> _Stream:
        return _Stream()


def bodies() -> dict[str, bytes]:
    chat = {"model": "moss-speech", "stream": True}
    filler = b"[]," * ((MAX_BODY_BYTES - 100) // 3 - 1)
    t = np.arange(48000 * 30) / 48000
    wav = io.BytesIO()
    soundfile.write(wav, np.stack([0.3 * np.sin(2 * np.pi * 220 * t)] * 2, axis=1), 48000, format="WAV",
                    subtype="PCM_16")
    clip = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav.getvalue()).decode(), "format": "wav"}}
    return {
        "ignored-lists": b'{"model": "moss-speech", "input": "hi", "x": [' + filler + b"[]]}",
        "many-messages": json.dumps({**chat, "messages": [{"role": "user", "content": "hi"}] * 1024}).encode(),
        "audio-chat": json.dumps({**chat, "messages": [{"role": "user", "content": [clip]}]}).encode(),
        "speech": json.dumps({"model": "moss-speech", "input": "Hello there."}).encode(),
    }


def _request(path: str, body: bytes) -> Request:
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return await asyncio.get_running_loop().create_future()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "server": ("127.0.0.1", 8000),
             "scheme": "http", "http_version": "1.1"}
    return Request(scope, receive)


async def measure(name: str, body: bytes, repeats: int, interval_s: float) -> dict[str, Any]:
    ingress = Ingress({"engine": {"model": "tiny", "device": "cpu"}, "vocoder_preset": "tiny",
                       "max_body_bytes": MAX_BODY_BYTES}, llm=None, vocoder=_Vocoder())
    path = "/v1/audio/speech" if name in ("ignored-lists", "speech") else "/v1/chat/completions"
    await ingress._get_limits(time.monotonic() + 10)  # the voice lookup, once, outside the timing
    lag = LoopLag(interval_s)
    lag.start()
    await asyncio.sleep(5 * interval_s)
    statuses, handling_s = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        response = await ingress(_request(path, body))
        if hasattr(response, "body_iterator"):
            async for _chunk in response.body_iterator:
                pass
        handling_s.append(time.perf_counter() - started)
        statuses.append(response.status_code)
        await asyncio.sleep(5 * interval_s)
    return {"body_bytes": len(body), "statuses": sorted(set(statuses)), "handling_s": percentiles(handling_s),
            "loop_lateness_s": lag.stop()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--interval-ms", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = {}
    for name, body in bodies().items():
        results[name] = asyncio.run(measure(name, body, args.repeats, args.interval_ms / 1e3))
        print(name, json.dumps(results[name]))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "python": platform.python_version(),
                                        "machine": platform.machine(), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
