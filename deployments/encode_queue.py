"""`EncodeQueue`: the speech clips of concurrent requests, encoded together.

Each request hands its clips to `encode` and waits. One drain task at a time takes every request waiting
(up to `max_clips` clips) and encodes their clips in one call of `encode_batch` through `run` (the vocoder
replica: `SpeechEncoder.encode_batch` on `VocoderBatcher.run`'s side thread). A lone request's clip so keeps
its CUDA graph; a burst of questions is one batched pass instead of one pass each, queued. A request that
goes away while waiting is skipped when its codes come; a failed call fails the requests of that call only.
Pure asyncio: no Ray import.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


class EncodeQueue:
    def __init__(self, encode_batch: Callable[[list[Any]], list[list[int]]],
                 run: Callable[..., Awaitable[Any]], *, max_clips: int = 8) -> None:
        """`encode_batch(clips) -> codes per clip`; `run(fn, *args)` calls it where it must run (a worker
        thread); at most `max_clips` clips per call (a request with more is a call of its own)."""
        if max_clips < 1:
            raise ValueError(f"max_clips must be >= 1, got {max_clips}")
        self._encode_batch = encode_batch
        self._run = run
        self.max_clips = max_clips
        self._waiting: list[tuple[list[Any], asyncio.Future]] = []
        self._drain_task: asyncio.Task | None = None
        self.batch_sizes: list[int] = []  # clips per call, for tests and benchmarks (the last 1000)

    async def encode(self, clips: list[Any]) -> list[list[int]]:
        """Codes of each of `clips`, encoded with the clips of the other requests waiting now."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((list(clips), future))
        if self._drain_task is None or self._drain_task.done():
            self._drain_task = asyncio.get_running_loop().create_task(self._drain(), name="speech-encode")
        return await future

    async def _drain(self) -> None:
        while self._waiting:
            taken, clips = 0, []
            while taken < len(self._waiting) and (not clips or len(clips) + len(self._waiting[taken][0])
                                                   <= self.max_clips):
                clips += self._waiting[taken][0]
                taken += 1
            batch, self._waiting = self._waiting[:taken], self._waiting[taken:]
            batch = [(own, future) for own, future in batch if not future.done()]  # gone while waiting
            if not batch:
                continue
            clips = [clip for own, _ in batch for clip in own]
            self.batch_sizes = [*self.batch_sizes[-999:], len(clips)]
            try:
                codes = await self._run(self._encode_batch, clips)
            except Exception as exc:  # noqa: BLE001 - each caller gets it
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            at = 0
            for own, future in batch:
                if not future.done():
                    future.set_result(codes[at:at + len(own)])
                at += len(own)
