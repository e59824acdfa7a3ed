"""Measure Ray Serve's first-flush delay (ray-project/ray#59681): yield -> bytes at the HTTP client.

Not a pytest test (no timing assertions in tests). Run from the repo root:

    RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 .venv/bin/python tests/serve/first_flush_probe.py

A probe app with the same shape as ours (Starlette ingress streaming what it pulls from a downstream
deployment's stream) yields a chunk stamped with `time.time()`, then waits HOLD_S before the next one.
The client stamps each chunk on arrival (same host, same clock). If Serve held the first chunk back
until more bytes came, its delay would be about HOLD_S. Prints one JSON line.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator

import httpx
import ray
from ray import serve
from starlette.requests import Request
from starlette.responses import StreamingResponse

HOLD_S = 1.0
NUM_CHUNKS = 3
NUM_RUNS = 10


async def stamped_chunks(count: int) -> AsyncIterator[bytes]:
    """`count` JSON lines, HOLD_S apart, each stamped with the wall time it was yielded."""
    for index in range(count):
        if index:
            await asyncio.sleep(HOLD_S)
        yield json.dumps({"index": index, "yielded_at": time.time()}).encode() + b"\n"


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class Source:
    """Downstream deployment: streams `stamped_chunks`."""

    async def chunks(self, count: int) -> AsyncIterator[bytes]:
        async for chunk in stamped_chunks(count):
            yield chunk


@serve.deployment(ray_actor_options={"num_cpus": 0.1})
class ProbeIngress:
    """HTTP edge: `/direct` yields itself; `/hop` relays the Source stream (like our ingress)."""

    def __init__(self, source: serve.handle.DeploymentHandle) -> None:
        self._source = source

    async def __call__(self, request: Request) -> StreamingResponse:
        if request.url.path == "/direct":
            return StreamingResponse(stamped_chunks(NUM_CHUNKS), media_type="text/plain")
        stream = self._source.chunks.options(stream=True).remote(NUM_CHUNKS)

        async def relay() -> AsyncIterator[bytes]:
            async for chunk in stream:
                yield chunk

        return StreamingResponse(relay(), media_type="text/plain")


def measure(base_url: str, path: str) -> list[list[float]]:
    """Per run, per chunk: arrival time - yield time (seconds)."""
    runs = []
    with httpx.Client(base_url=base_url, timeout=30.0) as client:
        for _ in range(NUM_RUNS):
            delays, buffer = [], b""
            with client.stream("GET", path) as response:
                for raw in response.iter_raw():
                    arrived = time.time()
                    buffer += raw
                    while b"\n" in buffer:
                        line, buffer = buffer.split(b"\n", 1)
                        delays.append(arrived - json.loads(line)["yielded_at"])
            runs.append(delays)
    return runs


def main() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ray.init(num_cpus=2, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(ProbeIngress.bind(Source.bind()), name="probe", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    result = {"hold_s": HOLD_S, "runs": NUM_RUNS}
    for path in ("/direct", "/hop"):
        runs = measure(base, path)
        first = [r[0] for r in runs]
        later = [d for r in runs for d in r[1:]]
        result[path.strip("/")] = {
            "first_chunk_delay_ms_p50": round(1000 * statistics.median(first), 2),
            "first_chunk_delay_ms_max": round(1000 * max(first), 2),
            "later_chunk_delay_ms_p50": round(1000 * statistics.median(later), 2),
            "first_chunk_held_until_next": any(d > HOLD_S / 2 for d in first),
        }
    print(json.dumps(result))
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
