"""`VocoderBatcher` with a recording test double: batching, ordering, flush, finish and abort.

(The real tiny vocoder runs through the batcher in the HTTP tests and tests/bench/test_pipeline.py.)
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Sequence

import numpy as np
import pytest

from deployments.batcher import END, BatchedStream, VocoderBatcher, VocoderStepError

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


def test_fifo_streams_with_pending_codes_share_one_step_and_get_all_their_samples() -> None:
    async def main() -> None:
        vocoder = RecordingVocoder()
        sizes: list[tuple[str, int]] = []
        batcher = VocoderBatcher(vocoder, max_batch_size=8, sample_rate=24000, policy="fifo",
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
        assert sizes == [("fifo", 2), ("finish", 2)]
        assert out_a == [1.0] * 4 + [2.0] * 4 + [3.0] * 4 + [4.0] * 4
        assert out_b == [7.0] * 4
        assert (a.num_codes, a.num_samples, b.num_samples) == (4, 16, 4)
        assert vocoder.finished == ["default-1", "default-2"]  # one finish_many call
        assert batcher.num_open_sessions == 0 and batcher.num_streams == 0
        await batcher.shutdown()

    asyncio.run(main())


def test_fifo_max_batch_size_takes_the_longest_waiting_streams_first() -> None:
    async def main() -> None:
        vocoder = RecordingVocoder()
        batcher = VocoderBatcher(vocoder, max_batch_size=2, sample_rate=24000, policy="fifo")
        streams = [await batcher.open("v", seed=i) for i in range(3)]
        for index, stream in enumerate(streams):
            batcher.push(stream, [index])
            batcher.end(stream)
        await asyncio.gather(*(drain(s.out) for s in streams))
        assert vocoder.steps == [[("v-0", [0]), ("v-1", [1])], [("v-2", [2])]]
        await batcher.shutdown()

    asyncio.run(main())


def test_batcher_options_are_validated() -> None:
    for kwargs in ({"urgent_buffer_s": -1.0}, {"policy": "buffer"}, {"step_code_budget": 0},
                   {"step_code_budget": 8, "urgent_step_code_budget": 4}):
        with pytest.raises(ValueError, match="urgent_buffer_s|policy|step_code_budget"):
            VocoderBatcher(RecordingVocoder(), max_batch_size=4, sample_rate=24000, **kwargs)
    assert VocoderBatcher(RecordingVocoder(), max_batch_size=4, sample_rate=24000).policy == "deadline"


def test_close_closes_the_session_and_drops_its_output() -> None:
    async def main() -> None:
        vocoder = RecordingVocoder()
        batcher = VocoderBatcher(vocoder, max_batch_size=4, sample_rate=24000, policy="fifo")
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


class ChunkVocoder(RecordingVocoder):
    """A double that computes scheduled chunks: chunk k spans SCHEDULE[min(k, -1)] codes and can be computed
    once LOOKAHEAD codes follow it; `finish_many` emits the rest. SAMPLES per code, valued as the code."""

    SCHEDULE = (2, 3, 5)
    pad_rows = False  # True: steps pad their rows to a power of two, as bucketed graphs do

    def _next(self, session: Session, pending: int) -> int:
        size = self.SCHEDULE[min(session.chunks, len(self.SCHEDULE) - 1)]
        return size if session.emitted + size + LOOKAHEAD <= len(session.codes) + pending else 0

    def open(self, voice: str, *, seed: int = 0) -> Session:
        session = super().open(voice, seed=seed)
        session.chunks = 0
        return session

    def next_chunk_codes(self, session: Session, pending: int = 0) -> int:
        return self._next(session, pending)

    def unvocoded_codes(self, session: Session, pending: int = 0) -> int:
        return len(session.codes) + pending - session.emitted

    def bucket_rows(self, n: int) -> int:
        return 1 << (n - 1).bit_length() if self.pad_rows else n

    def step(self, work: list[tuple[Session, Sequence[int]]], *, max_chunks: int | None = None,
             finish: Sequence[Session] = ()) -> list[np.ndarray]:
        self.steps.append([(s.name, list(codes)) for s, codes in work])
        outs = []
        for session, codes in work:
            assert not session.closed
            session.codes.extend(codes)
            if session in finish:  # the rest of the stream, then closed
                session.closed = True
                self.finished.append(session.name)
                outs.append(self._emit(session, len(session.codes)))
                continue
            start, chunks = session.emitted, 0
            while (size := self._next(session, 0)) and (max_chunks is None or chunks < max_chunks):
                session.emitted += size
                session.chunks += 1
                chunks += 1
            upto, session.emitted = session.emitted, start
            outs.append(self._emit(session, upto))
        return outs


def test_deadline_steps_one_chunk_per_stream_and_ends_streams_inside_steps() -> None:
    async def main() -> None:
        vocoder = ChunkVocoder()
        kinds: list[tuple[str, int]] = []
        batcher = VocoderBatcher(vocoder, max_batch_size=8, sample_rate=24000, policy="deadline",
                                 on_step=lambda kind, n, seconds: kinds.append((kind, n)))
        a, b, c = [await batcher.open("v", seed=i) for i in (1, 2, 3)]
        batcher.push(a, list(range(12)))  # chunks [0, 2), [2, 5), [5, 10); codes 10, 11 at the end
        batcher.push(b, list(range(20, 25)))  # chunk [0, 2); codes 2..4 at the end
        batcher.push(c, [40, 41, 42])  # too few for a chunk: its end is its only chunk
        for stream in (a, b, c):
            batcher.end(stream)
        out_a, out_b, out_c = await asyncio.gather(drain(a.out), drain(b.out), drain(c.out))
        # 1: every first chunk and c's end; 2: a's second chunk and b's end (its next chunk needs 7 codes);
        # 3: a's third chunk; 4: a's end. No call of finish_many.
        assert vocoder.steps == [[("v-1", list(range(12))), ("v-2", list(range(20, 25))), ("v-3", [40, 41, 42])],
                                 [("v-1", []), ("v-2", [])], [("v-1", [])], [("v-1", [])]]
        assert kinds == [("first", 3), ("urgent", 2), ("urgent", 1), ("urgent", 1)]
        assert vocoder.finished == ["v-3", "v-2", "v-1"]
        assert out_a == [float(c) for c in range(12) for _ in range(SAMPLES)]
        assert out_b == [float(c) for c in range(20, 25) for _ in range(SAMPLES)]
        assert out_c == [float(c) for c in (40, 41, 42) for _ in range(SAMPLES)]
        assert batcher.num_open_sessions == 0 and batcher.num_streams == 0
        await batcher.shutdown()

    asyncio.run(main())


def test_deadline_pick_takes_newcomers_then_deadlines_while_the_padded_step_fits_the_budget() -> None:
    async def main() -> None:
        vocoder = ChunkVocoder()
        batcher = VocoderBatcher(vocoder, max_batch_size=8, sample_rate=128, policy="deadline",
                                 urgent_buffer_s=0.5, step_code_budget=10)
        s = {name: await batcher.open("v", seed=i) for i, name in enumerate("xbcdeg")}
        now = 1024.0
        # (first audio at, samples at 128 Hz, codes in the session, chunks done): next chunk 2, 3, 5, 5, ...
        setup = {"x": (None, 0, 3, 0), "b": (now - 1.0, 160, 7, 1), "c": (now - 1.0, 384, 7, 1),
                 "d": (now - 1.0, 256, 12, 2), "e": (now - 1.0, 224, 7, 1), "g": (now - 1.0, 64, 6, 1)}
        for name, (at, samples, num_codes, chunks) in setup.items():
            stream = s[name]
            stream.first_pcm_at, stream.num_samples = at, samples
            session = stream.session
            session.codes, session.chunks = list(range(num_codes)), chunks
            session.emitted = sum(ChunkVocoder.SCHEDULE[min(k, 2)] for k in range(chunks))
        # x lacks a code for its first chunk, g one for its second. By buffer: b 0.25 (3 codes), e 0.75 (3),
        # d 1.0 (5), c 2.0 (3). b, e fit (2 x 3); d would make 3 x 5 > 10, so it is passed over; c fits (3 x 3).
        assert batcher.pick(now) == ("urgent", [s["b"], s["e"], s["c"]])
        batcher.push(s["x"], [7])  # a newcomer goes first, though b is more urgent; then b, e (3 x 3)
        assert batcher.pick(now) == ("first", [s["x"], s["b"], s["e"]])
        s["x"].pending = []
        batcher.step_code_budget = 20  # d's 5-code chunk joins and pads the others: 4 x 5
        assert batcher.pick(now) == ("urgent", [s["b"], s["e"], s["d"], s["c"]])
        batcher.step_code_budget = 6
        assert batcher.pick(now) == ("urgent", [s["b"], s["e"]])
        batcher.step_code_budget = 10
        vocoder.pad_rows = True  # 3 rows would run as 4: 4 x 3 > 10
        assert batcher.pick(now) == ("urgent", [s["b"], s["e"]])
        vocoder.pad_rows = False
        batcher.step_code_budget = 2  # smaller than one chunk: the first stream still goes, alone
        assert batcher.pick(now) == ("urgent", [s["b"]])
        batcher.urgent_step_code_budget = 10  # b has 0.25 s buffered (< 0.5): the urgent budget applies
        assert batcher.pick(now) == ("urgent", [s["b"], s["e"], s["c"]])
        s["b"].num_samples = 320  # now b has 1.5 s and nobody is under 0.5 s: back to the budget of 2
        assert batcher.pick(now) == ("background", [s["e"]])
        s["b"].num_samples, batcher.urgent_step_code_budget = 160, None
        for name in "bce":
            s[name].session.emitted, s[name].session.chunks = 5, 2  # their next chunks now wait for codes
        assert batcher.pick(now) == ("background", [s["d"]])  # buffer 1.0 >= 0.5
        await batcher.shutdown()

    asyncio.run(main())


def test_deadline_ends_a_stream_after_its_last_chunk_as_a_chunk_of_its_unvocoded_codes() -> None:
    async def main() -> None:
        batcher = VocoderBatcher(ChunkVocoder(), max_batch_size=8, sample_rate=128, policy="deadline",
                                 step_code_budget=10)
        streams = [await batcher.open("v", seed=i) for i in range(4)]
        # (codes, codes emitted, chunks done): s0's first chunk is ready (2 + 2 <= 4); the others' 3-code
        # chunks are not (2 + 3 + 2 > codes), so their ends are chunks of 2, 3 and 4 codes.
        for i, (num_codes, emitted, chunks) in enumerate(((4, 0, 0), (4, 2, 1), (5, 2, 1), (6, 2, 1))):
            stream = streams[i]
            stream.session.codes, stream.session.emitted, stream.session.chunks = list(range(num_codes)), emitted, chunks
            stream.first_pcm_at, stream.num_samples = 0.0, 128 * i  # buffers -1, 0, 1, 2 at now = 1
            batcher.end(stream)
        assert [batcher._ends_now(s) for s in streams] == [False, True, True, True]
        # by buffer: s0 (2 codes), s1 (2), s2 (3: 3 x 3 <= 10); s3's 4 would make 4 x 4 > 10
        assert batcher.pick(1.0) == ("urgent", streams[:3])
        streams[1].pending = [9, 9, 9]  # pending codes count: its 3-code chunk is ready now (2 + 3 + 2 <= 7)
        assert not batcher._ends_now(streams[1])
        await batcher.shutdown()

    asyncio.run(main())


def test_deadline_on_the_tiny_vocoder_gives_fifos_audio() -> None:
    """The real StreamingVocoder through the batcher: codes arriving in bursts, three streams; "deadline"
    steps chunk by chunk, and each stream's PCM equals what "fifo" gives for the same codes."""
    from vocoder import SAMPLES_PER_CODE, StreamingVocoder

    voc = StreamingVocoder.from_preset("tiny")
    rng = np.random.default_rng(5)
    utterances = [rng.integers(0, 16384, n).tolist() for n in (31, 9, 4)]

    async def run(policy: str) -> tuple[list[np.ndarray], list[str]]:
        kinds: list[str] = []
        batcher = VocoderBatcher(voc, max_batch_size=8, sample_rate=24000, policy=policy, step_code_budget=12,
                                 on_step=lambda kind, n, seconds: kinds.append(kind))
        streams = [await batcher.open("default", seed=i) for i in range(len(utterances))]
        for stream, codes in zip(streams, utterances, strict=True):
            batcher.push(stream, codes[:20])
        pcm = [[] for _ in streams]
        for item in [await streams[0].out.get()]:  # the first chunk is out: the rest arrives in one burst
            pcm[0].append(item)
        batcher.push(streams[0], utterances[0][20:])
        for stream in streams:
            batcher.end(stream)
        for i, stream in enumerate(streams):
            while (item := await stream.out.get()) is not END:
                pcm[i].append(item)
        await batcher.shutdown()
        return [np.concatenate(p) for p in pcm], kinds

    fifo, fifo_kinds = asyncio.run(run("fifo"))
    deadline, kinds = asyncio.run(run("deadline"))
    for codes, a, b in zip(utterances, fifo, deadline, strict=True):
        assert len(a) == len(b) == len(codes) * SAMPLES_PER_CODE
        assert float(np.abs(a - b).max()) < 1e-5
    assert set(fifo_kinds) == {"fifo", "finish"}
    assert kinds[0] == "first" and "finish" not in kinds and "urgent" in kinds
    assert voc.num_open_sessions == 0


class FailingVocoder(ChunkVocoder):
    """ChunkVocoder whose step raises while any session named in `poison` is in it."""

    def __init__(self, poison: set[str]) -> None:
        super().__init__()
        self.poison = poison

    def step(self, work: list[tuple[Session, Sequence[int]]], **options: object) -> list[np.ndarray]:
        if any(session.name in self.poison for session, _ in work):
            self.steps.append([("failed", [])])
            raise RuntimeError("CUDA error: an illegal memory access")
        return super().step(work, **options)


def test_a_failing_step_fails_its_streams_and_the_loop_serves_the_next_ones() -> None:
    async def main() -> None:
        vocoder = FailingVocoder(poison={"v-1"})
        batcher = VocoderBatcher(vocoder, max_batch_size=8, sample_rate=24000, policy="deadline")
        a, b = [await batcher.open("v", seed=i) for i in (1, 2)]
        batcher.push(a, list(range(12)))
        batcher.push(b, [20, 21, 22, 23])  # a chunk ready: b joins a's step, which fails
        batcher.end(a)
        error_a, error_b = await asyncio.gather(a.out.get(), b.out.get())
        for error in (error_a, error_b):
            assert isinstance(error, VocoderStepError)
            assert str(error) == "vocoder step failed: RuntimeError('CUDA error: an illegal memory access')"
        assert a.out.empty() and b.out.empty()  # nothing after the error, not even END
        c = await batcher.open("v", seed=3)  # the loop is alive: a later stream is served in full
        batcher.push(c, [40, 41, 42, 43, 44])
        batcher.end(c)
        assert await drain(c.out) == [float(x) for x in (40, 41, 42, 43, 44) for _ in range(SAMPLES)]
        assert vocoder.steps[0] == [("failed", [])]
        assert sorted(vocoder.closed) == ["v-1", "v-2"]  # both failed sessions were closed
        batcher.close(a)  # the server's cleanup after the error: a no-op now
        assert batcher.num_open_sessions == 0 and batcher.num_streams == 0
        # a CUDA error: the replica's health check fails from now on (Serve replaces it)
        assert batcher.health_problem(60.0) == (
            "a vocoder call failed with a device error: RuntimeError('CUDA error: an illegal memory access')")
        await batcher.shutdown()

    asyncio.run(main())


def test_a_failing_close_fails_no_live_stream() -> None:
    """A session whose `close` raises (the stream was aborted) is logged and counted closed; the other
    streams keep being served, and a non-device error leaves the replica healthy."""
    async def main() -> None:
        vocoder = RecordingVocoder()
        real_close = vocoder.close

        def close(session: Session) -> None:
            if session.name == "v-9":
                raise RuntimeError("close failed")
            real_close(session)

        vocoder.close = close
        batcher = VocoderBatcher(vocoder, max_batch_size=4, sample_rate=24000, policy="fifo")
        healthy, doomed, other = [await batcher.open("v", seed=i) for i in (1, 9, 2)]
        batcher.close(doomed)
        batcher.close(other)
        batcher.push(healthy, [1, 2, 3])
        batcher.end(healthy)
        assert await drain(healthy.out) == [float(x) for x in (1, 2, 3) for _ in range(SAMPLES)]
        assert vocoder.closed == ["v-2"]  # the failing close did not stop the next one
        assert batcher.num_open_sessions == 0 and batcher.health_problem(60.0) is None
        await batcher.shutdown()

    asyncio.run(main())


def test_a_device_error_in_open_fails_the_health_check() -> None:
    """An idle replica's only vocoder calls are its opens: a CUDA error there makes it unhealthy too."""
    class BrokenOpen(RecordingVocoder):
        def open(self, voice: str, *, seed: int = 0) -> Session:
            raise RuntimeError(f"CUDA error: an illegal memory access ({voice})" if voice == "gpu" else "no voice")

    async def main() -> None:
        batcher = VocoderBatcher(BrokenOpen(), max_batch_size=4, sample_rate=24000)
        with pytest.raises(RuntimeError, match="no voice"):
            await batcher.open("missing", 0)
        assert batcher.health_problem(60.0) is None  # not the device
        with pytest.raises(RuntimeError, match="CUDA error"):
            await batcher.open("gpu", 0)
        assert batcher.health_problem(60.0) == ("a vocoder call failed with a device error: "
                                                "RuntimeError('CUDA error: an illegal memory access (gpu)')")
        assert batcher.num_open_sessions == 0
        await batcher.shutdown()

    asyncio.run(main())


def test_a_session_whose_caller_went_away_while_it_opened_is_closed() -> None:
    """The caller of `open` is cancelled while the worker thread still opens the session (a slow open, or one
    queued behind a step): once it exists, the next round closes it; nothing stays open or counted."""
    release = threading.Event()

    class SlowOpen(RecordingVocoder):
        def open(self, voice: str, *, seed: int = 0) -> Session:
            release.wait(10)
            return super().open(voice, seed=seed)

    async def main() -> None:
        vocoder = SlowOpen()
        batcher = VocoderBatcher(vocoder, max_batch_size=4, sample_rate=24000)
        opening = asyncio.ensure_future(batcher.open("v", seed=5))
        await asyncio.sleep(0.05)  # the open runs on the worker thread
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening
        release.set()
        for _ in range(200):  # the worker finishes the open, the loop closes the session
            if vocoder.closed:
                break
            await asyncio.sleep(0.01)
        assert (vocoder.num_opened, vocoder.closed) == (1, ["v-5"])
        assert batcher.num_open_sessions == 0 and batcher.num_streams == 0
        await batcher.shutdown()

    asyncio.run(main())


def test_a_bug_outside_the_vocoder_calls_fails_every_stream_instead_of_killing_the_loop() -> None:
    async def main() -> None:
        vocoder = ChunkVocoder()
        batcher = VocoderBatcher(vocoder, max_batch_size=8, sample_rate=24000, policy="deadline")
        a = await batcher.open("v", seed=1)

        def broken(session: Session, pending: int = 0) -> int:
            raise KeyError("chunk schedule")

        vocoder.next_chunk_codes = broken  # pick() raises in the loop, outside any vocoder call
        batcher.push(a, [1, 2, 3, 4])
        error = await a.out.get()
        assert isinstance(error, VocoderStepError) and "KeyError('chunk schedule')" in str(error)
        assert batcher.health_problem(60.0) is None  # a bug, not the device: the replica stays healthy
        del vocoder.next_chunk_codes
        b = await batcher.open("v", seed=2)
        batcher.push(b, [5, 6, 7])
        batcher.end(b)
        assert await drain(b.out) == [float(x) for x in (5, 6, 7) for _ in range(SAMPLES)]
        assert vocoder.closed == ["v-1"] and batcher.num_open_sessions == 0
        await batcher.shutdown()

    asyncio.run(main())


def test_lag_counts_only_streams_the_vocoder_holds_work_for() -> None:
    """Every stream below started playing 3 s ago with 1 s of audio made (its listener waits 2 s); the lag
    signal, which scales the vocoder up, counts only those whose wait the vocoder could end."""
    batcher = VocoderBatcher(ChunkVocoder(), max_batch_size=8, sample_rate=24000, policy="deadline")

    def stream(seed: int, pending: list[int], ended: bool = False) -> BatchedStream:
        s = BatchedStream(batcher.vocoder.open("v", seed=seed), asyncio.Queue())
        s.first_pcm_at, s.num_samples, s.pending, s.is_ended = time.monotonic() - 3.0, 24000, pending, ended
        return s

    waiting_for_llm = stream(1, [])
    short_of_a_chunk = stream(2, [7])  # a chunk needs 2 codes plus 2 of lookahead
    batcher._streams = [waiting_for_llm, short_of_a_chunk]
    assert batcher.lag_s() == 0.0
    for behind in (stream(3, [1, 2, 3, 4]), stream(4, [], ended=True)):
        batcher._streams = [waiting_for_llm, short_of_a_chunk, behind]
        assert 2.0 <= batcher.lag_s() < 2.5
    batcher._streams, batcher._in_flight = [waiting_for_llm], {waiting_for_llm}  # in a step now
    assert 2.0 <= batcher.lag_s() < 2.5


async def until_error(queue: asyncio.Queue) -> tuple[list[float], object]:
    """The samples a stream got before its first non-PCM item, and that item (END or an error)."""
    values: list[float] = []
    while isinstance(item := await asyncio.wait_for(queue.get(), 5), np.ndarray):  # a hang fails
        values.extend(item.tolist())
    return values, item


@pytest.mark.parametrize(("policy", "failing"), [("deadline", "first"), ("fifo", "finish")])
def test_a_bug_after_a_vocoder_call_ends_every_stream_of_the_call(policy: str, failing: str) -> None:
    """The report of a call that finished a stream's session (a metrics callback) raises after the vocoder
    returned: that stream gets the error too (it had left the batcher's list before the call) and its session
    is not closed again; a stream outside the failed call goes on; the loop serves the next stream."""
    reports: list[str] = []

    def on_step(kind: str, streams: int, seconds: float) -> None:
        reports.append(kind)
        if kind == failing and reports.count(kind) == 1:
            raise RuntimeError("metrics backend hiccup")

    async def main() -> None:
        vocoder = ChunkVocoder()
        batcher = VocoderBatcher(vocoder, max_batch_size=8, sample_rate=24000, policy=policy, on_step=on_step)
        live, ending = [await batcher.open("v", seed=i) for i in (1, 2)]
        batcher.push(live, list(range(10)))
        batcher.push(ending, [1, 2, 3])
        batcher.end(ending)
        got, error = await until_error(ending.out)
        assert got == [] and str(error) == "vocoder step failed: RuntimeError('metrics backend hiccup')"
        assert vocoder.finished == ["v-2"]  # finished by the failed call, never closed
        if policy == "deadline":  # one step carried both newcomers and failed before delivering: both fail
            assert await until_error(live.out) == ([], error)
            for _ in range(200):
                if vocoder.closed:
                    break
                await asyncio.sleep(0.01)
            assert vocoder.closed == ["v-1"]
        else:  # finish_many carried only the ending stream (its three codes made no chunk before)
            batcher.end(live)
            assert await until_error(live.out) == ([float(x) for x in range(10) for _ in range(SAMPLES)], END)
            assert (vocoder.finished, vocoder.closed) == (["v-2", "v-1"], [])
        assert batcher.num_open_sessions == 0 and batcher.num_streams == 0
        assert batcher.health_problem(60.0) is None  # a bug, not the device
        nxt = await batcher.open("v", seed=3)
        batcher.push(nxt, [5, 6, 7])
        batcher.end(nxt)
        assert await until_error(nxt.out) == ([float(x) for x in (5, 6, 7) for _ in range(SAMPLES)], END)
        await batcher.shutdown()

    asyncio.run(main())


class Recorder:
    """A metric double: every observed or set value, in order."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def observe(self, value: float, tags: dict | None = None) -> None:
        self.values.append(value)

    def set(self, value: float) -> None:
        self.values.append(value)


class LLMStream:
    """What handle.options(stream=True).remote(request) gives: `events`, then it waits (a long utterance)
    when `hold` is set, raises CancelledError when `remote_cancel` is, else it ends; cancel() is recorded."""

    def __init__(self, events: list[dict], hold: bool = False, remote_cancel: bool = False) -> None:
        self.events, self.hold, self.remote_cancel, self.cancelled = iter(events), hold, remote_cancel, False

    def __aiter__(self) -> LLMStream:
        return self

    async def __anext__(self) -> dict:
        await asyncio.sleep(0)
        try:
            return next(self.events)
        except StopIteration:
            if self.hold:
                await asyncio.sleep(3600)
            if self.remote_cancel:  # as Ray's handle does when another caller cancelled the remote generation
                raise asyncio.CancelledError from None
            raise StopAsyncIteration from None

    def cancel(self) -> None:
        self.cancelled = True


def vocoder_server(vocoder: RecordingVocoder, llm_stream: LLMStream) -> object:
    """A `VocoderServer` replica without a model or Ray (its vocoder is the double, its LLM handle gives
    `llm_stream`)."""
    from deployments.metrics import RecentWindow
    from deployments.vocoder_server import VocoderServer

    llm = type("LLM", (), {})()
    llm.generate = type("Method", (), {"options": lambda self, **kw: self, "remote": lambda self, r: llm_stream})()

    class Replica(VocoderServer):
        def __del__(self) -> None:  # Ray's asynchronous destructor
            pass

    server = Replica.__new__(Replica)
    server._llm, server._num_active, server._batch_sizes = llm, 0, RecentWindow(window_s=30.0)
    server._metrics = type("Metrics", (), {"active_streams": Recorder(), "time_to_first_pcm": Recorder(),
                                           "step_seconds": Recorder(), "batch_size": Recorder()})()
    server._batcher = VocoderBatcher(vocoder, max_batch_size=8, sample_rate=24000, policy="deadline")
    server._codes_stream = {"eager_codes": 5, "batch_s": 0.0}
    server._retry_after_s = 1.0
    return server


def test_codes_out_of_range_fail_their_push_not_the_step_of_every_stream() -> None:
    """A bad code (the EOSP id, a bool) is refused when its stream pushes it; its batch-mates are served."""

    async def main() -> None:
        batcher = VocoderBatcher(ChunkVocoder(), max_batch_size=8, sample_rate=24000, policy="deadline")
        good, bad = [await batcher.open("v", seed=i) for i in (1, 2)]
        for codes, message in (([1, 16384], "codes\\[1\\] = 16384 is out of range 0..16383"),
                               ([True], "is a boolean, not a code")):
            with pytest.raises(ValueError, match=message):
                batcher.push(bad, codes)
        assert bad.pending == [] and bad.num_codes == 0
        batcher.push(good, [5, 6, 7])
        batcher.end(good)
        assert await asyncio.wait_for(drain(good.out), 5) == [float(x) for x in (5, 6, 7) for _ in range(SAMPLES)]
        await batcher.shutdown()

    asyncio.run(main())


def test_batch_occupancy_is_the_main_lanes() -> None:
    """The fast lane's one-stream steps do not pull the occupancy (which scales the vocoder up) down."""
    server = vocoder_server(ChunkVocoder(), LLMStream([]))
    for kind, streams in (("background", 8), ("fast-first", 1), ("urgent", 4), ("fast-urgent", 1), ("finish", 2)):
        server._on_step(kind, streams, 0.01)
    assert asyncio.run(server.record_autoscaling_stats())["batch_occupancy"] == (8 + 4) / 2 / 8
    assert server._metrics.batch_size.values == [8, 1, 4, 1]  # the histogram keeps every step's size


def test_autoscaling_stats_are_read_on_the_replicas_event_loop() -> None:
    """Ray Serve 2.60 runs a sync `record_autoscaling_stats` on a thread pool, beside the loop that adds to the
    windows and stream lists it reads ("deque mutated during iteration"); an async one runs on that loop."""
    import inspect

    from deployments.llm_server import LLMServer
    from deployments.vocoder_server import VocoderServer

    assert inspect.iscoroutinefunction(LLMServer.record_autoscaling_stats)
    assert inspect.iscoroutinefunction(VocoderServer.record_autoscaling_stats)


def test_busy_fraction_is_the_share_of_the_window_with_any_call_running() -> None:
    """Calls on two lanes at once make one busy span (counted once); the fraction divides by the window, or by
    the batcher's life while that is shorter, and counts a call still running up to now."""
    import threading

    from deployments.batcher import BUSY_WINDOW_S

    batcher = VocoderBatcher(LaneVocoder(), max_batch_size=4, sample_rate=24000, fast_lane_code_budget=8)
    gate, entered = threading.Event(), threading.Barrier(3)

    def held() -> None:
        entered.wait(10)
        gate.wait(10)

    async def main() -> tuple[int, int]:
        calls = [asyncio.ensure_future(batcher._call(held, lane=lane)) for lane in (0, 1)]
        await asyncio.to_thread(entered.wait, 10)  # both calls are running now
        running = batcher._calls_running
        gate.set()
        await asyncio.gather(*calls)
        return running, len(batcher._busy_spans)

    assert asyncio.run(main()) == (2, 1)
    batcher._created = 100.0
    batcher._busy_spans.clear()
    batcher._busy_spans.extend([(101.0, 103.0), (109.0, 110.0)])
    assert batcher.busy_fraction(now=110.0) == 3.0 / 10.0  # 10 s of life
    assert batcher.busy_fraction(now=102.0 + BUSY_WINDOW_S) == 2.0 / BUSY_WINDOW_S  # (101, 103) half out
    batcher._calls_running, batcher._busy_from = 1, 140.0
    assert batcher.busy_fraction(now=145.0) == 5.0 / BUSY_WINDOW_S  # a call running since 140, no span left
    batcher._calls_running = 0
    for executor in (batcher._executor, batcher._fast_executor, batcher._side_executor):
        executor.shutdown()


def test_the_vocoder_server_ends_a_stream_whose_step_failed_with_a_500_event() -> None:
    from deployments.errors import internal_error

    async def main() -> None:
        llm_stream = LLMStream([{"type": "codes", "codes": list(range(8))},
                                {"type": "finished", "reason": "length", "error": None}])
        vocoder = FailingVocoder(poison={"default-5"})
        server = vocoder_server(vocoder, llm_stream)
        events = [e async for e in server.synthesize({"with_audio": True, "voice": "default", "seed": 5})]
        assert events == [{"type": "started"}, internal_error(
            "vocoder step failed: RuntimeError('CUDA error: an illegal memory access')").to_event()]
        for _ in range(500):  # the batcher closes the failed session in its next round, on its worker thread
            if server._batcher.num_open_sessions == 0:
                break
            await asyncio.sleep(0.01)
        assert llm_stream.cancelled and vocoder.closed == ["default-5"]
        assert server._batcher.num_streams == 0 and server._batcher.num_open_sessions == 0
        assert server._num_active == 0
        await server._batcher.shutdown()

    asyncio.run(main())


def test_a_client_gone_as_its_vocoder_session_opens_leaves_no_session_open() -> None:
    """The caller of `synthesize` is cancelled in the same loop turn as its session's open completes, so the
    open's result is never read: the replica still closes the session."""

    async def main() -> None:
        llm_stream = LLMStream([{"type": "codes", "codes": [1, 2]}], hold=True)
        vocoder = ChunkVocoder()
        server = vocoder_server(vocoder, llm_stream)
        real_open = server._batcher.open
        consumer: asyncio.Future | None = None

        async def open_then_disconnect(voice: str, seed: int) -> BatchedStream:
            stream = await real_open(voice, seed)
            asyncio.get_running_loop().call_soon(consumer.cancel)  # lands before synthesize resumes
            return stream

        server._batcher.open = open_then_disconnect

        async def consume() -> None:
            async for _ in server.synthesize({"with_audio": True, "voice": "default", "seed": 5}):
                pass

        consumer = asyncio.ensure_future(consume())
        with pytest.raises(asyncio.CancelledError):
            await consumer
        for _ in range(1000):  # the batcher closes the session in its next round, on its worker thread (10 s)
            if vocoder.closed:
                break
            await asyncio.sleep(0.01)
        assert (vocoder.num_opened, vocoder.closed) == (1, ["default-5"])
        assert server._batcher.num_streams == 0 and server._batcher.num_open_sessions == 0
        assert llm_stream.cancelled and server._num_active == 0
        await server._batcher.shutdown()

    asyncio.run(main())


def test_an_llm_generation_cancelled_from_its_side_ends_the_utterance_with_a_503_event() -> None:
    """The LLM stream raises CancelledError although nobody cancelled `synthesize` (Ray's handle does so when
    the remote generation was cancelled elsewhere, e.g. its replica stopping): the utterance ends at once with
    a retryable 503 event instead of waiting for the ingress' idle timeout; its session is closed."""

    async def main() -> None:
        llm_stream = LLMStream([{"type": "codes", "codes": list(range(12))}], remote_cancel=True)
        vocoder = ChunkVocoder()
        server = vocoder_server(vocoder, llm_stream)
        events = await asyncio.wait_for(_collect(server.synthesize({"with_audio": True, "voice": "default",
                                                                    "seed": 5})), 5)  # a hang fails
        assert events[0] == {"type": "started"} and {e["type"] for e in events[1:-1]} <= {"audio"}
        assert events[-1] == {"type": "error", "status": 503, "kind": "overloaded",
                              "message": "server unavailable: the LLM deployment cancelled the generation",
                              "error_type": "server_overloaded_error", "param": None, "code": "server_overloaded",
                              "retry_after_s": 1.0}
        for _ in range(1000):  # the batcher closes the session in its next round (10 s: a loaded machine)
            if vocoder.closed:
                break
            await asyncio.sleep(0.01)
        assert vocoder.closed == ["default-5"] and server._batcher.num_open_sessions == 0
        assert server._num_active == 0
        await server._batcher.shutdown()

    asyncio.run(main())


async def _collect(events: AsyncIterator[dict]) -> list[dict]:
    return [e async for e in events]


class LaneVocoder(ChunkVocoder):
    """ChunkVocoder with two lanes: records each call's lane and thread; a lane-0 step can be held until
    `release` is set (a long step in flight)."""

    num_lanes = 2

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.lanes: list[tuple[str, int, str]] = []  # (call, lane, thread name)
        self.hold_lane0 = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.hold_lane1 = threading.Event()  # likewise for lane 1's steps
        self.release1 = threading.Event()
        self.release1.set()

    def open(self, voice: str, *, seed: int = 0, lane: int = 0) -> Session:
        import threading

        self.lanes.append(("open", lane, threading.current_thread().name))
        return super().open(voice, seed=seed)

    def step(self, work: list[tuple[Session, Sequence[int]]], *, max_chunks: int | None = None,
             finish: Sequence[Session] = (), lane: int = 0) -> list[np.ndarray]:
        import threading

        self.lanes.append(("step", lane, threading.current_thread().name))
        if lane == 0 and self.hold_lane0.is_set():
            assert self.release.wait(timeout=30)
        if lane == 1 and self.hold_lane1.is_set():
            assert self.release1.wait(timeout=30)
        return super().step(work, max_chunks=max_chunks, finish=finish)


def test_fast_lane_options_are_validated() -> None:
    with pytest.raises(ValueError, match="policy 'deadline'"):
        VocoderBatcher(LaneVocoder(), max_batch_size=4, sample_rate=24000, policy="fifo", fast_lane_code_budget=8)
    with pytest.raises(ValueError, match="fast_lane_code_budget must be >= 1"):
        VocoderBatcher(LaneVocoder(), max_batch_size=4, sample_rate=24000, fast_lane_code_budget=0)
    with pytest.raises(ValueError, match="second lane"):
        VocoderBatcher(ChunkVocoder(), max_batch_size=4, sample_rate=24000, fast_lane_code_budget=8)
    with pytest.raises(ValueError, match="background_yield needs the fast lane"):
        VocoderBatcher(LaneVocoder(), max_batch_size=4, sample_rate=24000, background_yield="newcomer")
    with pytest.raises(ValueError, match="background_yield must be one of"):
        VocoderBatcher(LaneVocoder(), max_batch_size=4, sample_rate=24000, fast_lane_code_budget=8,
                       background_yield="on")
    with pytest.raises(ValueError, match="yield_max_s must be > 0"):
        VocoderBatcher(LaneVocoder(), max_batch_size=4, sample_rate=24000, fast_lane_code_budget=8,
                       background_yield="newcomer", yield_max_s=0.0)


def test_fast_lane_pick_takes_newcomers_and_urgent_listeners_within_its_budget() -> None:
    async def main() -> None:
        batcher = VocoderBatcher(LaneVocoder(), max_batch_size=8, sample_rate=128, urgent_buffer_s=0.5,
                                 step_code_budget=100, fast_lane_code_budget=6)
        s = {name: await batcher.open("v", seed=i) for i, name in enumerate("xybce")}
        now = 1024.0
        # (first audio at, samples at 128 Hz, codes in the session, chunks done): x, y newcomers (2-code
        # chunks ready); b buffer 0.25 s, c 0.75 s, e 0.0 s (3-code chunks ready)
        setup = {"x": (None, 0, 4, 0), "y": (None, 0, 4, 0), "b": (now - 1.0, 160, 7, 1),
                 "c": (now - 1.0, 224, 7, 1), "e": (now - 1.0, 128, 7, 1)}
        for name, (at, samples, num_codes, chunks) in setup.items():
            stream = s[name]
            stream.first_pcm_at, stream.num_samples = at, samples
            stream.session.codes, stream.session.chunks = list(range(num_codes)), chunks
            stream.session.emitted = 2 * (chunks > 0)
        # lane 0 never takes a newcomer; lane 1 takes newcomers first, then the urgent listeners by buffer
        # while the padded step fits 6 code rows: x, y (2 x 2), then e would make 3 x 3 > 6
        assert batcher._pick_deadline(now, lane=0) == ("urgent", [s["e"], s["b"], s["c"]])
        assert batcher._pick_deadline(now, lane=1) == ("first", [s["x"], s["y"]])
        batcher._in_flight.update([s["x"], s["y"]])  # in a step now: neither lane picks them
        assert batcher._pick_deadline(now, lane=1) == ("urgent", [s["e"], s["b"]])  # c has 0.75 s: not urgent
        batcher._in_flight.update([s["e"], s["b"]])
        assert batcher._pick_deadline(now, lane=0) == ("background", [s["c"]])
        assert batcher._pick_deadline(now, lane=1) == ("", [])
        await batcher.shutdown()

    asyncio.run(main())


def test_fast_lane_serves_a_newcomer_while_a_long_step_holds_lane_zero() -> None:
    async def main() -> None:
        vocoder = LaneVocoder()
        kinds: list[tuple[str, int]] = []
        batcher = VocoderBatcher(vocoder, max_batch_size=8, sample_rate=24000, urgent_buffer_s=0.0,
                                 fast_lane_code_budget=8, on_step=lambda kind, n, seconds: kinds.append((kind, n)))
        old = await batcher.open("v", seed=1)
        batcher.push(old, list(range(4)))  # its first chunk, on the fast lane
        assert (await old.out.get()).tolist() == [0.0] * SAMPLES + [1.0] * SAMPLES
        vocoder.hold_lane0.set()
        vocoder.release.clear()
        batcher.push(old, list(range(4, 9)))  # its second chunk: lane 0 (it has audio, and 0.0 s is not urgent)
        while ("step", 0) not in [(call, lane) for call, lane, _ in vocoder.lanes]:  # lane 0's step is held
            await asyncio.sleep(0.01)
        new = await batcher.open("v", seed=2)  # opens and gets its first chunk while lane 0 is held
        batcher.push(new, [50, 51, 52, 53])
        first = await asyncio.wait_for(new.out.get(), timeout=10)
        assert first.tolist() == [50.0] * SAMPLES + [51.0] * SAMPLES
        assert old.out.empty()  # its step is still held
        aborted = await batcher.open("v", seed=3)
        batcher.push(aborted, [60, 61])  # no chunk ready yet
        vocoder.release.set()
        assert (await old.out.get()).tolist() == [float(c) for c in (2, 3, 4) for _ in range(SAMPLES)]
        batcher.close(aborted)
        for stream in (old, new):
            batcher.end(stream)
        await asyncio.gather(drain(old.out), drain(new.out))
        while batcher.num_open_sessions:
            await asyncio.sleep(0.01)
        opens = [(lane, thread) for call, lane, thread in vocoder.lanes if call == "open"]
        assert all(lane == 1 and thread.startswith("vocoder-fast") for lane, thread in opens)
        steps = [(lane, thread.startswith("vocoder-fast")) for call, lane, thread in vocoder.lanes if call == "step"]
        assert set(steps) == {(0, False), (1, True)}
        assert kinds[:3] == [("fast-first", 1), ("fast-first", 1), ("background", 1)]
        assert vocoder.closed == ["v-3"] and batcher.num_streams == 0
        await batcher.shutdown()

    asyncio.run(main())


def test_an_open_closes_the_sessions_queued_for_closing_first() -> None:
    """A client leaves while a long step holds lane 0, so the loop cannot close its session yet; a newcomer's
    open (on the fast lane) closes it first: the open sessions never exceed the streams (at capacity the state
    pool would grow and drop its captured graphs). A close that fails is logged, not the open's failure."""

    class FailingClose(LaneVocoder):
        def close(self, session: Session) -> None:
            super().close(session)
            raise RuntimeError("close failed")

    async def main() -> None:
        vocoder = FailingClose()
        batcher = VocoderBatcher(vocoder, max_batch_size=8, sample_rate=24000, urgent_buffer_s=0.0,
                                 fast_lane_code_budget=8)
        old = await batcher.open("v", seed=1)
        batcher.push(old, list(range(4)))  # its first chunk, on the fast lane
        await old.out.get()
        vocoder.hold_lane0.set()
        vocoder.release.clear()
        batcher.push(old, list(range(4, 9)))  # its second chunk: lane 0, held
        while ("step", 0) not in [(call, lane) for call, lane, _ in vocoder.lanes]:
            await asyncio.sleep(0.01)
        left = await batcher.open("v", seed=2)
        batcher.close(left)  # queued: the loop's next round waits for the held step
        await batcher.open("v", seed=3)
        assert vocoder.closed == ["v-2"] and batcher.num_open_sessions == 2  # old and the newcomer
        vocoder.release.set()
        assert (await old.out.get()).tolist() == [float(c) for c in (2, 3, 4) for _ in range(SAMPLES)]
        await batcher.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["first_chunk", "newcomer", "off"])
def test_background_step_waits_for_a_newcomers_first_chunk_when_told(mode: str) -> None:
    """A listener with 1 s buffered (background) has a chunk ready while a newcomer's first chunk is held on
    the fast lane: with `background_yield` "first_chunk" or "newcomer" lane 0 starts nothing until that step
    ends, then steps the listener; with "off", lane 0 steps the listener at once. Audio is the same."""
    async def main() -> None:
        vocoder = LaneVocoder()
        kinds: list[str] = []
        batcher = VocoderBatcher(vocoder, max_batch_size=8, sample_rate=8, urgent_buffer_s=0.5,
                                 fast_lane_code_budget=8, background_yield=mode, yield_max_s=30.0,
                                 on_step=lambda kind, n, seconds: kinds.append(kind))
        old = await batcher.open("v", seed=1)
        batcher.push(old, list(range(4)))  # first chunk: 2 codes x SAMPLES = 1 s of audio at 8 Hz
        assert (await old.out.get()).tolist() == [0.0] * SAMPLES + [1.0] * SAMPLES
        vocoder.hold_lane1.set()
        vocoder.release1.clear()
        new = await batcher.open("v", seed=2)
        batcher.push(new, [50, 51, 52, 53])  # its first chunk, held on lane 1
        while ("step", 1) not in [(call, lane) for call, lane, _ in vocoder.lanes[-1:]]:
            await asyncio.sleep(0.01)
        batcher.push(old, list(range(4, 9)))  # a 3-code chunk for a listener with ~1 s buffered
        held = mode != "off"
        if held:  # lane 0 starts nothing while the newcomer's first chunk is held (0.2 s given to go wrong)
            await asyncio.sleep(0.2)
            assert not [lane for call, lane, _ in vocoder.lanes if (call, lane) == ("step", 0)]
            assert old.out.empty()
        else:  # lane 0 steps the listener at once: its chunk arrives while lane 1 is still held
            early = await asyncio.wait_for(old.out.get(), timeout=10)
            assert new.out.empty()
        vocoder.release1.set()
        assert (await asyncio.wait_for(new.out.get(), timeout=10)).tolist() == [50.0] * SAMPLES + [51.0] * SAMPLES
        second = await asyncio.wait_for(old.out.get(), timeout=10) if held else early
        assert second.tolist() == [float(c) for c in (2, 3, 4) for _ in range(SAMPLES)]
        assert kinds[:3] == (["fast-first", "fast-first", "background"] if held
                             else ["fast-first", "background", "fast-first"])
        for stream in (old, new):
            batcher.end(stream)
        await asyncio.gather(drain(old.out), drain(new.out))
        await batcher.shutdown()

    asyncio.run(main())


async def _listener_and_silent_newcomer(mode: str, **options: float) -> tuple[VocoderBatcher, LaneVocoder,
                                                                               list[str], BatchedStream,
                                                                               BatchedStream]:
    """A listener that has played its 1 s first chunk (at 8 Hz) and has its next chunk's codes pending, and
    a newcomer whose session is open but whose codes have not come."""
    vocoder = LaneVocoder()
    kinds: list[str] = []
    batcher = VocoderBatcher(vocoder, max_batch_size=8, sample_rate=8, fast_lane_code_budget=8,
                             background_yield=mode, on_step=lambda kind, n, seconds: kinds.append(kind),
                             **options)
    old = await batcher.open("v", seed=1)
    batcher.push(old, list(range(4)))
    assert (await old.out.get()).tolist() == [0.0] * SAMPLES + [1.0] * SAMPLES
    new = await batcher.open("v", seed=2)
    batcher.push(old, list(range(4, 9)))  # a 3-code chunk for a listener with ~1 s buffered
    return batcher, vocoder, kinds, old, new


@pytest.mark.parametrize("mode", ["newcomer", "first_chunk"])
def test_newcomer_mode_holds_background_steps_while_a_newcomer_waits_for_codes(mode: str) -> None:
    """"newcomer": the listener's background step waits while the newcomer has no codes, and runs right after
    the newcomer's first chunk (its step's end wakes lane 0; the 30 s hold never expires here).
    "first_chunk": it runs at once, before the newcomer's codes arrive."""
    async def main() -> None:
        batcher, _vocoder, kinds, old, new = await _listener_and_silent_newcomer(
            mode, urgent_buffer_s=0.5, yield_max_s=30.0)
        held = mode == "newcomer"
        if held:  # nothing runs while the newcomer has no codes (0.2 s given to go wrong)
            await asyncio.sleep(0.2)
            assert kinds == ["fast-first"] and old.out.empty()
        else:  # the listener's step runs at once, before the newcomer's codes come
            early = await asyncio.wait_for(old.out.get(), timeout=10)
            assert kinds == ["fast-first", "background"]
        batcher.push(new, [50, 51, 52, 53])
        assert (await asyncio.wait_for(new.out.get(), timeout=10)).tolist() == [50.0] * SAMPLES + [51.0] * SAMPLES
        second = await asyncio.wait_for(old.out.get(), timeout=10) if held else early
        assert second.tolist() == [float(c) for c in (2, 3, 4) for _ in range(SAMPLES)]
        assert kinds == (["fast-first", "fast-first", "background"] if held
                         else ["fast-first", "background", "fast-first"])
        await batcher.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize(("urgent_buffer_s", "yield_max_s", "kind"), [(0.0, 0.5, "background"), (0.5, 30.0, "urgent")])
def test_held_listener_is_stepped_without_an_event(urgent_buffer_s: float, yield_max_s: float, kind: str) -> None:
    """The newcomer never sends codes and nothing else happens; lane 0 wakes itself:
    - "background": the listener never turns urgent (0 s `urgent_buffer_s`), so it is stepped once
      `yield_max_s` has passed since the newcomer's session opened;
    - "urgent": the newcomer's hold would last 30 s, but the listener (1 s buffered at its first PCM) turns
      urgent 0.5 s later and is stepped then, in an urgent step, which no hold delays."""
    async def main() -> None:
        batcher, vocoder, kinds, old, new = await _listener_and_silent_newcomer(
            "newcomer", urgent_buffer_s=urgent_buffer_s, yield_max_s=yield_max_s)
        second = await asyncio.wait_for(old.out.get(), timeout=10)
        waited_since = new.opened_at if kind == "background" else old.first_pcm_at
        assert time.monotonic() - waited_since >= 0.5
        assert second.tolist() == [float(c) for c in (2, 3, 4) for _ in range(SAMPLES)]
        assert kinds == ["fast-first", kind]
        assert [lane for call, lane, _ in vocoder.lanes if call == "step"] == [1, 0]
        await batcher.shutdown()

    asyncio.run(main())


def test_fast_lane_on_the_tiny_vocoder_gives_the_one_lane_audio() -> None:
    from vocoder import SAMPLES_PER_CODE, StreamingVocoder

    rng = np.random.default_rng(6)
    utterances = [rng.integers(0, 16384, n).tolist() for n in (31, 12, 4)]

    async def run(voc: StreamingVocoder, fast: int | None) -> tuple[list[np.ndarray], list[str]]:
        kinds: list[str] = []
        batcher = VocoderBatcher(voc, max_batch_size=8, sample_rate=24000, step_code_budget=12,
                                 fast_lane_code_budget=fast, on_step=lambda kind, n, seconds: kinds.append(kind))
        streams = [await batcher.open("default", seed=i) for i in range(len(utterances))]
        for stream, codes in zip(streams, utterances, strict=True):
            for i in range(0, len(codes), 3):  # codes in small pieces, as an LLM sends them
                batcher.push(stream, codes[i : i + 3])
                await asyncio.sleep(0)
            batcher.end(stream)
        pcm = [np.concatenate([x for x in await collect(s.out)]) for s in streams]
        await batcher.shutdown()
        return pcm, kinds

    async def collect(queue: asyncio.Queue) -> list[np.ndarray]:
        items = []
        while (item := await queue.get()) is not END:
            items.append(item)
        return items

    one, _ = asyncio.run(run(StreamingVocoder.from_preset("tiny"), None))
    laned = StreamingVocoder.from_preset("tiny")
    laned.add_lane()
    two, kinds = asyncio.run(run(laned, 6))
    for codes, a, b in zip(utterances, one, two, strict=True):
        assert len(a) == len(b) == len(codes) * SAMPLES_PER_CODE
        assert float(np.abs(a - b).max()) < 1e-5
    assert "fast-first" in kinds and laned.num_open_sessions == 0


class HangingVocoder(ChunkVocoder):
    """ChunkVocoder whose first step blocks until `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def step(self, work: list[tuple[Session, Sequence[int]]], **options: object) -> list[np.ndarray]:
        self.release.wait(30)
        return super().step(work, **options)


def test_a_hung_vocoder_call_fails_the_health_check_until_it_returns() -> None:
    async def main() -> tuple[str | None, str | None, list[float]]:
        vocoder = HangingVocoder()
        batcher = VocoderBatcher(vocoder, max_batch_size=8, sample_rate=24000, policy="deadline")
        a = await batcher.open("v", seed=1)
        batcher.push(a, [1, 2, 3, 4, 5])
        batcher.end(a)
        problem = None
        while problem is None:  # the step hangs until released
            await asyncio.sleep(0.01)
            problem = batcher.health_problem(0.05)
        vocoder.release.set()
        samples = await drain(a.out)
        after = batcher.health_problem(0.05)
        await batcher.shutdown()
        return problem, after, samples

    problem, after, samples = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert problem.startswith("a vocoder call on lane 0 has run for ") and problem.endswith(" s (limit 0.05)")
    assert after is None
    assert samples == [float(x) for x in (1, 2, 3, 4, 5) for _ in range(SAMPLES)]


def test_run_works_beside_a_step_in_flight_and_is_watched_like_the_lanes() -> None:
    """`run` (the speech encoder's calls) has a thread of its own: it returns while a lane-0 step still hangs;
    a hung `run` fails the health check naming that thread, and a device error in it marks the replica."""
    async def main() -> tuple[str, str | None, str | None, list[float]]:
        vocoder = HangingVocoder()
        batcher = VocoderBatcher(vocoder, max_batch_size=8, sample_rate=24000, policy="deadline")
        a = await batcher.open("v", seed=1)
        batcher.push(a, [1, 2, 3, 4, 5])
        batcher.end(a)
        while batcher.health_problem(0.05) is None:  # lane 0's step is in flight, hanging
            await asyncio.sleep(0.01)
        thread = await asyncio.wait_for(batcher.run(lambda: threading.current_thread().name), timeout=10)
        vocoder.release.set()
        samples = await drain(a.out)
        release = threading.Event()
        hung = asyncio.ensure_future(batcher.run(release.wait, 30))
        problem = None
        while problem is None:
            await asyncio.sleep(0.01)
            problem = batcher.health_problem(0.05)
        release.set()
        assert await hung is True and batcher.health_problem(0.05) is None

        def broken() -> None:
            raise RuntimeError("CUDA error: an illegal memory access")
        with pytest.raises(RuntimeError, match="illegal memory access"):
            await batcher.run(broken)
        device = batcher.health_problem(60.0)
        await batcher.shutdown()
        return thread, problem, device, samples

    thread, problem, device, samples = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert thread.startswith("vocoder-side")
    assert problem.startswith("a vocoder call on the side thread (speech input) has run for ")
    assert device == "a vocoder call failed with a device error: RuntimeError('CUDA error: an illegal memory access')"
    assert samples == [float(x) for x in (1, 2, 3, 4, 5) for _ in range(SAMPLES)]


def test_the_vocoder_replicas_health_check_raises_the_batchers_problem() -> None:
    from types import SimpleNamespace

    from deployments.batcher import VocoderUnhealthyError
    from deployments.vocoder_server import VocoderServer

    limits: list[float] = []

    def problem(limit: float) -> str | None:
        limits.append(limit)
        return "a vocoder call failed with a device error: AcceleratorError('CUDA error')" if len(limits) > 1 else None

    server = object.__new__(VocoderServer)
    server._batcher = SimpleNamespace(health_problem=problem)
    server._call_timeout_s = 12.5  # AppArgs' vocoder_call_timeout_s, as the constructor keeps it
    server.check_health()
    with pytest.raises(VocoderUnhealthyError, match="device error"):
        server.check_health()
    assert limits == [12.5] * 2
