"""`VocoderBatcher` with a recording test double: batching, ordering, flush, finish and abort.

(The real tiny vocoder runs through the batcher in the HTTP tests and tests/bench/test_pipeline.py.)
"""
from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import numpy as np
import pytest

from deployments.batcher import END, VocoderBatcher

SAMPLES = 4  # per code, for the double
LOOKAHEAD = 2


class Session:
    def __init__(self, name: str) -> None:
        self.name = name
        self.codes: list[int] = []
        self.emitted = 0
        self.closed = False


class RecordingVocoder:
    """Emits SAMPLES per code once LOOKAHEAD later codes exist; each sample's value is its code."""

    def __init__(self) -> None:
        self.steps: list[list[tuple[str, list[int]]]] = []
        self.finished: list[str] = []
        self.closed: list[str] = []
        self.num_opened = 0

    def open(self, voice: str, *, seed: int = 0) -> Session:
        self.num_opened += 1
        return Session(f"{voice}-{seed}")

    def _emit(self, session: Session, upto: int) -> np.ndarray:
        out = np.repeat(np.asarray(session.codes[session.emitted:upto], dtype=np.float32), SAMPLES)
        session.emitted = max(session.emitted, upto)
        return out

    def step(self, work: list[tuple[Session, Sequence[int]]]) -> list[np.ndarray]:
        self.steps.append([(s.name, list(codes)) for s, codes in work])
        outs = []
        for session, codes in work:
            assert not session.closed
            session.codes.extend(codes)
            outs.append(self._emit(session, max(0, len(session.codes) - LOOKAHEAD)))
        return outs

    def finish_many(self, sessions: list[Session]) -> list[np.ndarray]:
        outs = []
        for session in sessions:
            assert not session.closed
            session.closed = True
            self.finished.append(session.name)
            outs.append(self._emit(session, len(session.codes)))
        return outs

    def close(self, session: Session) -> None:
        session.closed = True
        self.closed.append(session.name)


async def drain(queue: asyncio.Queue) -> list[float]:
    values: list[float] = []
    while (item := await queue.get()) is not END:
        values.extend(item.tolist())
    return values


def test_streams_with_pending_codes_share_one_step_and_get_all_their_samples() -> None:
    async def main() -> None:
        vocoder = RecordingVocoder()
        sizes: list[tuple[str, int]] = []
        batcher = VocoderBatcher(vocoder, max_batch_size=8, sample_rate=24000,
                                 on_step=lambda kind, n, seconds: sizes.append((kind, n)))
        a = await batcher.open("default", seed=1)
        b = await batcher.open("default", seed=2)
        batcher.push(a, [1, 2, 3])
        batcher.push(b, [7])
        batcher.push(a, [4])  # arrives before the loop runs: joins a's pending codes
        batcher.end(b)
        batcher.end(a)
        out_a, out_b = await asyncio.gather(drain(a.out), drain(b.out))
        assert vocoder.steps == [[("default-1", [1, 2, 3, 4]), ("default-2", [7])]]
        assert sizes == [("first", 2), ("finish", 2)]  # no audio yet
        assert out_a == [1.0] * 4 + [2.0] * 4 + [3.0] * 4 + [4.0] * 4
        assert out_b == [7.0] * 4
        assert (a.num_codes, a.num_samples, b.num_samples) == (4, 16, 4)
        assert vocoder.finished == ["default-1", "default-2"]  # one finish_many call
        assert batcher.num_open_sessions == 0 and batcher.num_streams == 0
        await batcher.shutdown()

    asyncio.run(main())


def test_max_batch_size_takes_the_longest_waiting_streams_first() -> None:
    async def main() -> None:
        vocoder = RecordingVocoder()
        batcher = VocoderBatcher(vocoder, max_batch_size=2, sample_rate=24000)
        streams = [await batcher.open("v", seed=i) for i in range(3)]
        for index, stream in enumerate(streams):
            batcher.push(stream, [index])
            batcher.end(stream)
        await asyncio.gather(*(drain(s.out) for s in streams))
        assert vocoder.steps == [[("v-0", [0]), ("v-1", [1])], [("v-2", [2])]]
        await batcher.shutdown()

    asyncio.run(main())


def test_urgent_streams_step_alone_and_background_steps_are_bounded() -> None:
    """`pick` at a fixed clock: listeners' buffers decide who goes into the next step."""
    async def main() -> None:
        batcher = VocoderBatcher(RecordingVocoder(), max_batch_size=3, sample_rate=128, urgent_buffer_s=0.5,
                                 background_max_streams=2)
        s = {name: await batcher.open("v", seed=i) for i, name in enumerate("abcdefg")}
        now = 1024.0
        # (first audio at, samples delivered at 128 Hz, codes pending since): buffer = samples/128 - (now - at)
        setup = {"a": (None, 0, 5.0), "b": (now - 1.0, 160, 1.0), "c": (now - 1.0, 384, 0.0),
                 "d": (now - 1.0, 256, 2.0), "e": (now - 1.0, 224, 3.0), "f": (None, 0, 4.0),
                 "g": (now - 1.0, 64, None)}
        for name, (at, samples, since) in setup.items():
            stream = s[name]
            stream.first_pcm_at, stream.num_samples = at, samples
            if since is not None:
                batcher.push(stream, [1])
                stream.pending_since = since
        assert s["b"].buffer_s(now, 128) == 0.25 and s["a"].buffer_s(now, 128) == -math.inf
        assert s["g"].lag_s(now, 128) == 0.5  # no codes pending: not stepped, though it lags
        kind, streams = batcher.pick(now)  # no audio yet: longest waiting first
        assert (kind, [x.session.name for x in streams]) == ("first", ["v-5", "v-0"])
        s["a"].pending, s["f"].pending = [], []
        kind, streams = batcher.pick(now)
        assert (kind, [x.session.name for x in streams]) == ("urgent", ["v-1"])
        s["b"].pending = []
        kind, streams = batcher.pick(now)  # buffers 2.0 (c), 1.0 (d), 0.75 (e): the 2 least buffered
        assert (kind, [x.session.name for x in streams]) == ("background", ["v-4", "v-3"])
        batcher.policy = "fifo"  # the earlier rule: everyone pending, longest waiting first
        kind, streams = batcher.pick(now)
        assert (kind, [x.session.name for x in streams]) == ("fifo", ["v-2", "v-3", "v-4"])
        batcher.policy = "buffer"
        s["c"].pending, s["d"].pending, s["e"].pending = [], [], []
        assert batcher.pick(now) == ("", [])
        await batcher.shutdown()

    asyncio.run(main())


def test_batcher_options_are_validated() -> None:
    for kwargs in ({"urgent_buffer_s": -1.0}, {"background_max_streams": 0}, {"policy": "edf"}):
        with pytest.raises(ValueError, match="urgent_buffer_s|background_max_streams|policy"):
            VocoderBatcher(RecordingVocoder(), max_batch_size=4, sample_rate=24000, **kwargs)
    assert VocoderBatcher(RecordingVocoder(), max_batch_size=4, sample_rate=24000,
                          background_max_streams=9).background_max_streams == 4


def test_close_closes_the_session_and_drops_its_output() -> None:
    async def main() -> None:
        vocoder = RecordingVocoder()
        batcher = VocoderBatcher(vocoder, max_batch_size=4, sample_rate=24000)
        kept = await batcher.open("v", seed=0)
        dropped = await batcher.open("v", seed=9)
        batcher.push(dropped, [5, 5, 5, 5])
        batcher.close(dropped)  # before any step: its codes never reach the vocoder
        batcher.push(kept, [1])
        batcher.end(kept)
        assert await drain(kept.out) == [1.0] * 4
        assert vocoder.steps == [[("v-0", [1])]]
        assert vocoder.finished == ["v-0"] and vocoder.closed == ["v-9"]
        assert dropped.out.empty()
        assert batcher.num_open_sessions == 0 and batcher.num_streams == 0
        await batcher.shutdown()

    asyncio.run(main())
