"""EncodeQueue: concurrent requests' speech clips encoded together, each request given its own codes."""
from __future__ import annotations

import asyncio
import threading

import pytest

from deployments.encode_queue import EncodeQueue


class FakeEncoder:
    """`encode_batch` of clips named by strings: codes are the clip's name's characters' ordinals. The first
    call blocks until `release` is set, so later requests queue behind it; a clip named "bad" fails its call."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.release = threading.Event()

    def encode_batch(self, clips: list[str]) -> list[list[int]]:
        self.calls.append(list(clips))
        if len(self.calls) == 1:
            self.release.wait(30)
        if "bad" in clips:
            raise RuntimeError("encode failed")
        return [[ord(c) for c in clip] for clip in clips]


async def in_thread(fn, *args):
    return await asyncio.to_thread(fn, *args)


async def until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.005)


def test_requests_waiting_behind_a_call_are_encoded_together_each_getting_its_own_codes() -> None:
    async def main() -> tuple[list, list]:
        encoder = FakeEncoder()
        queue = EncodeQueue(encoder.encode_batch, in_thread, max_clips=8)
        first = asyncio.ensure_future(queue.encode(["a"]))
        await until(lambda: encoder.calls)  # the first call is in flight
        rest = [asyncio.ensure_future(queue.encode(clips)) for clips in (["bc", "d"], ["e"], ["fg"])]
        await asyncio.sleep(0.05)
        encoder.release.set()
        return await asyncio.gather(first, *rest), encoder.calls

    results, calls = asyncio.run(asyncio.wait_for(main(), 30))
    assert calls == [["a"], ["bc", "d", "e", "fg"]]
    assert results == [[[97]], [[98, 99], [100]], [[101]], [[102, 103]]]


def test_a_call_takes_at_most_max_clips_but_a_larger_request_whole() -> None:
    async def main() -> list:
        encoder = FakeEncoder()
        queue = EncodeQueue(encoder.encode_batch, in_thread, max_clips=3)
        first = asyncio.ensure_future(queue.encode(["a"]))
        await until(lambda: encoder.calls)
        rest = [asyncio.ensure_future(queue.encode(clips)) for clips in (["b", "c"], ["d", "e"], ["f", "g", "h", "i"])]
        await asyncio.sleep(0.05)
        encoder.release.set()
        await asyncio.gather(first, *rest)
        return encoder.calls

    assert asyncio.run(asyncio.wait_for(main(), 30)) == [["a"], ["b", "c"], ["d", "e"], ["f", "g", "h", "i"]]
    with pytest.raises(ValueError, match="max_clips must be >= 1"):
        EncodeQueue(FakeEncoder().encode_batch, in_thread, max_clips=0)


def test_a_request_gone_while_waiting_is_left_out_and_a_failure_fails_only_its_call() -> None:
    async def main() -> tuple:
        encoder = FakeEncoder()
        queue = EncodeQueue(encoder.encode_batch, in_thread)
        first = asyncio.ensure_future(queue.encode(["a"]))
        await until(lambda: encoder.calls)
        gone = asyncio.ensure_future(queue.encode(["x"]))
        failing = [asyncio.ensure_future(queue.encode(clips)) for clips in (["bad"], ["y"])]
        await asyncio.sleep(0.01)
        gone.cancel()  # its client went away
        encoder.release.set()
        outcomes = await asyncio.gather(first, *failing, return_exceptions=True)
        after = await queue.encode(["z"])  # the queue serves the next request
        return outcomes, after, encoder.calls, queue.batch_sizes

    outcomes, after, calls, sizes = asyncio.run(asyncio.wait_for(main(), 30))
    assert outcomes[0] == [[97]]
    assert [str(o) for o in outcomes[1:]] == ["encode failed", "encode failed"]
    assert after == [[122]]
    assert calls == [["a"], ["bad", "y"], ["z"]] and sizes == [1, 2, 1]
