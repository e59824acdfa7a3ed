"""Streaming order, client disconnect and overload, observed through server state (no timing)."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator

import httpx
import pytest
import serve_harness
from talking_checkpoint import write_talking_checkpoint

LONG = {"model": "moss-speech", "input": "A long story", "voice": "default",
        "min_new_tokens": 3000, "max_new_tokens": 3000}


def stats(http: httpx.Client) -> dict:
    return http.get("/admin/stats").json()


def is_idle(http: httpx.Client) -> bool:
    now = stats(http)
    return (now["llm"]["num_blocks_used"], now["llm"]["num_running"], now["llm"]["num_waiting"],
            now["llm"]["num_tracked_requests"], now["vocoder"]["open_sessions"],
            now["vocoder"]["active_streams"]) == (0,) * 6


def test_first_audio_arrives_while_generating_and_a_disconnect_frees_everything(http: httpx.Client) -> None:
    serve_harness.wait_until(lambda: is_idle(http), what="an idle server before the test")
    with http.stream("POST", "/v1/audio/speech", json={**LONG, "seed": 21}) as response:
        assert response.status_code == 200
        request_id = response.headers["x-moss-request-id"]
        received = b""
        chunks = response.iter_raw()
        while len(received) <= 44:  # the WAV header, then the first PCM bytes
            received += next(chunks)
        # The first audio is in our hands, and the server is still generating this request.
        during = stats(http)
        assert during["llm"]["num_running"] == 1 and during["llm"]["num_blocks_used"] > 0
        assert during["llm"]["num_tracked_requests"] == 1
        assert during["vocoder"]["active_streams"] == 1 and during["vocoder"]["open_sessions"] == 1
        report = http.get(f"/admin/requests/{request_id}").json()
        assert report["status"] == "streaming" and report["finish_reason"] is None
        # Leaving the `with` block closes the connection mid-stream.
    serve_harness.wait_until(lambda: is_idle(http), what="KV blocks and vocoder sessions freed")
    after = stats(http)
    assert after["llm"]["num_blocks_free"] == after["llm"]["num_blocks_total"]
    report = http.get(f"/admin/requests/{request_id}").json()
    assert report["status"] == 499  # recorded as a client disconnect
    assert report["num_audio_codes"] is None  # the request never finished normally
    assert 0 < report["num_audio_samples"] < 3000 * 1920


def test_over_capacity_is_503_with_retry_after_and_nothing_leaks(serve_base_url: str, http: httpx.Client) -> None:
    serve_harness.wait_until(lambda: is_idle(http), what="an idle server before the test")
    running, waiting = serve_harness.MAX_NUM_RUNNING, serve_harness.MAX_NUM_WAITING

    async def hold(client: httpx.AsyncClient, seed: int, statuses: list[int], release: asyncio.Event) -> None:
        async with client.stream("POST", "/v1/audio/speech", json={**LONG, "seed": seed}) as response:
            statuses.append(response.status_code)
            await release.wait()  # keep streaming; leaving closes the connection (client disconnect)

    async def engine(client: httpx.AsyncClient) -> dict:
        return (await client.get("/admin/stats")).json()["llm"]

    async def until(predicate: Callable[[], Awaitable[bool]]) -> None:
        while not await predicate():
            await asyncio.sleep(0.1)

    async def main() -> list[httpx.Response]:
        release = asyncio.Event()
        statuses: list[int] = []
        async with httpx.AsyncClient(base_url=serve_base_url, timeout=120.0) as client:
            tasks = []
            for seed in range(running):  # fill the running slots one by one: each answers 200
                tasks.append(asyncio.create_task(hold(client, 100 + seed, statuses, release)))
                while len(statuses) < seed + 1:
                    await asyncio.sleep(0.1)
            for seed in range(waiting):  # these wait in the engine queue (no status line yet)
                tasks.append(asyncio.create_task(hold(client, 200 + seed, statuses, release)))

            async def queue_full() -> bool:
                state = await engine(client)
                return (state["num_running"], state["num_waiting"]) == (running, waiting)

            await until(queue_full)
            rejected = [await client.post("/v1/audio/speech", json={**LONG, "seed": 300 + i}) for i in range(2)]
            assert statuses == [200] * running
            release.set()
            for task in tasks:
                task.cancel()  # disconnect all, including the two that never got a status line
            await asyncio.gather(*tasks, return_exceptions=True)
        return rejected

    rejected = asyncio.run(asyncio.wait_for(main(), timeout=240))
    for response in rejected:
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"  # the engine's retry_after_s (1.0), rounded up
        error = response.json()["error"]
        assert error["code"] == "server_overloaded" and "waiting queue is full" in error["message"]
    serve_harness.wait_until(lambda: is_idle(http), what="all admitted requests aborted and freed")


@pytest.fixture(scope="module")
def short_deadline_url(serve_base_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second app in the same Serve instance whose requests may live 8 s (route prefix /short).

    8 s leaves room for admission on a loaded 2-core machine; the ~3000-code request needs minutes there."""
    from ray import serve

    from deployments.app import build_app

    checkpoint = write_talking_checkpoint(tmp_path_factory.mktemp("short-deadline-checkpoint"))
    args = {**serve_harness.app_args(str(checkpoint)), "request_timeout_s": 8.0}
    serve.run(build_app(args), name="moss-short", route_prefix="/short")
    yield f"{serve_base_url}/short"
    serve.delete("moss-short")


def test_server_side_deadline_ends_a_long_stream_and_frees_it(short_deadline_url: str) -> None:
    with httpx.Client(base_url=short_deadline_url, timeout=120.0) as client:
        body = {**LONG, "seed": 8, "stream_format": "sse"}  # ~3000 codes: minutes of CPU work
        with client.stream("POST", "/v1/audio/speech", json=body) as response:
            assert response.status_code == 200
            events = [json.loads(line[6:]) for line in response.iter_lines() if line]
        # The server ended the stream itself with an error event (no done event, nothing hangs).
        assert events[-1] == {"type": "error", "error": {
            "message": "the request timed out on the server", "type": "timeout_error", "param": None,
            "code": "timeout"}}
        assert all(e["type"] == "speech.audio.delta" for e in events[:-1])
        serve_harness.wait_until(lambda: is_idle(client), what="the timed-out request freed")
