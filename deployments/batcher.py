"""`VocoderBatcher`: advances many utterance streams with one `StreamingVocoder.step` per round.

Pure asyncio (no Ray), so it is unit-tested directly. Every vocoder call (open, step, finish_many,
close) runs on one worker thread, in submission order: the vocoder never sees two calls at once, and
the replica's event loop stays free to move bytes while a step computes.

Policy "deadline" (the default) steps chunks, not codes: each step computes at most one chunk per stream
(`StreamingVocoder.step(max_chunks=1)`), so its shape is one the warm-up captured however far the codes
ran ahead; codes that arrive while a step runs wait in their stream's `pending` list. Streams with a
chunk ready are taken in deadline order: newcomers (no audio yet, longest waiting first), then the
others by their listener's buffer (`BatchedStream.buffer_s`: audio delivered minus time since the first
chunk; least first). Each joins the step while its padded size, rows (as the vocoder pads them,
`bucket_rows`) x the largest chunk's codes, stays within `step_code_budget`; one that does not fit is
passed over for smaller chunks further down, and the first always goes. While some listener has less than
`urgent_buffer_s` buffered, the budget is `urgent_step_code_budget` instead (by default the same): small
steps keep a newcomer's wait short, larger ones move more audio per GPU second when streams run behind.
A stream whose codes have all arrived and whose scheduled chunks are all computed ends in such a step too (`step(finish=...)`: its
tail is one more chunk, of its unvocoded codes), not in a call of its own. So no step grows past the
budget (a newcomer waits for at most one such step), and the steady streams' chunks and ends share the
steps that newcomers need anyway. A step is reported as "first" when it leads with a newcomer, else
"urgent" (its first stream has less than `urgent_buffer_s` buffered) or "background". Nothing is lost
by waiting: a stream's PCM depends only on its codes.

Fast lane (`fast_lane_code_budget`, "deadline" only; the vocoder needs a second lane, `StreamingVocoder.
add_lane`): a second loop on a second worker thread runs small steps on the vocoder's lane 1, a CUDA stream
of its own, while lane 0's step runs: newcomers (their first chunk) and then listeners with less than
`urgent_buffer_s` buffered, least first, while rows x the largest chunk's codes stays within
`fast_lane_code_budget`. Newcomers then go only there, and sessions open there too, so neither waits for a
large step in flight. A stream is in at most one step at a time; an aborted stream's session is closed
only after the step that carries it. These steps are reported as "fast-first" and "fast-urgent".
`background_yield` (needs the fast lane) holds lane 0's "background" steps (every listener in one has at
least `urgent_buffer_s` buffered, so it can wait) for newcomers:
- "first_chunk": while a "fast-first" step runs, so that the newcomer's first chunk shares the GPU with at
  most the lane-0 step already in flight;
- "newcomer": also while a newcomer waits for the codes of its first chunk (from its session's opening, at
  most `yield_max_s`), so the LLM computes those codes with less of the GPU taken by the vocoder.
While it holds, the loop wakes itself when the least buffered held listener would turn urgent or the
newcomer's hold expires, so a held listener never waits for an event that may not come. "off" holds
nothing.

A vocoder call that raises fails the streams it carried, not the loop: each gets a `VocoderStepError` on
its queue instead of more PCM (its session is closed), and the other streams go on.

Policy "fifo" is the earlier rule, kept for A/B runs: every stream with pending codes (up to
`max_batch_size`, longest waiting first) in one step, as many chunks as its codes allow, and ended streams
in a `finish_many` call after it. (A third rule, "buffer": newcomers, then urgent, then the rest in
separate steps, lost to fifo in bench/results/e2e-h200-batching-ab/ and was removed.)
"""
from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from runtime.errors import is_device_error
from vocoder.session import check_codes

END = None  # put on a stream's queue after its last PCM chunk
POLICIES = ("deadline", "fifo")
YIELDS = ("off", "first_chunk", "newcomer")  # `background_yield` settings
SIDE = -1  # `_call`'s lane key for `run`'s thread
BUSY_WINDOW_S = 30.0  # `busy_fraction`'s window

logger = logging.getLogger(__name__)


class VocoderStepError(RuntimeError):
    """Put on a stream's queue (then nothing more) when a vocoder call carrying the stream failed."""


class VocoderUnhealthyError(RuntimeError):
    """The replica's vocoder can serve no more (`VocoderBatcher.health_problem`); raised by the deployment's
    health check, so that Serve replaces the replica."""


class BatchedStream:
    """One utterance's vocoder session plus the codes waiting for the next step."""

    def __init__(self, session: Any, out: asyncio.Queue) -> None:
        self.session = session
        self.out = out  # receives float32 PCM arrays, then END (or a VocoderStepError)
        self.pending: list[int] = []
        self.pending_since = 0.0
        self.is_ended = False   # no more codes will come: flush, then finish the session
        self.is_closed = False  # the session is finished (or queued to be)
        self.is_aborted = False  # closed by `close`: its output is dropped
        self.num_codes = 0
        self.num_samples = 0
        self.opened_at = time.monotonic()
        self.first_pcm_at: float | None = None
        # Timeline marks (wall clock, deployments/timeline.py): the step that made the first PCM, when it
        # started and how many codes the stream had by then, and when that PCM reached the event loop.
        self.step_started_wall: float | None = None
        self.step_codes = 0
        self.first_pcm_marks: dict[str, float | int] = {}

    def lag_s(self, now: float, sample_rate: int) -> float:
        """Seconds a real-time listener who started at the first chunk would be waiting now."""
        if self.first_pcm_at is None:
            return 0.0
        return max(0.0, -self.buffer_s(now, sample_rate))

    def buffer_s(self, now: float, sample_rate: int) -> float:
        """Seconds of audio a real-time listener who started at the first chunk still has to play
        (negative: it has been waiting that long); -inf before the first chunk."""
        if self.first_pcm_at is None:
            return -math.inf
        return self.num_samples / sample_rate - (now - self.first_pcm_at)


class VocoderBatcher:
    """Owns the vocoder's worker thread and the batching loop of one replica."""

    def __init__(self, vocoder: Any, *, max_batch_size: int, sample_rate: int, policy: str = "deadline",
                 urgent_buffer_s: float = 0.5, step_code_budget: int = 256,
                 urgent_step_code_budget: int | None = None, fast_lane_code_budget: int | None = None,
                 background_yield: str = "off", yield_max_s: float = 0.3,
                 on_step: Callable[[str, int, float], None] | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not urgent_buffer_s >= 0:
            raise ValueError(f"urgent_buffer_s must be >= 0, got {urgent_buffer_s}")
        if step_code_budget < 1:
            raise ValueError(f"step_code_budget must be >= 1, got {step_code_budget}")
        if urgent_step_code_budget is not None and urgent_step_code_budget < step_code_budget:
            raise ValueError(f"urgent_step_code_budget must be >= step_code_budget ({step_code_budget}), "
                             f"got {urgent_step_code_budget}")
        if fast_lane_code_budget is not None:
            if fast_lane_code_budget < 1:
                raise ValueError(f"fast_lane_code_budget must be >= 1, got {fast_lane_code_budget}")
            if policy != "deadline":
                raise ValueError("the fast lane needs policy 'deadline'")
            if getattr(vocoder, "num_lanes", 1) < 2:
                raise ValueError("the fast lane needs a vocoder with a second lane (StreamingVocoder.add_lane)")
        if background_yield not in YIELDS:
            raise ValueError(f"background_yield must be one of {YIELDS}, got {background_yield!r}")
        if background_yield != "off" and fast_lane_code_budget is None:
            raise ValueError("background_yield needs the fast lane (fast_lane_code_budget)")
        if not yield_max_s > 0:
            raise ValueError(f"yield_max_s must be > 0, got {yield_max_s}")
        self.vocoder = vocoder
        self.fast_lane_code_budget = fast_lane_code_budget
        self.max_batch_size = max_batch_size
        self.sample_rate = sample_rate
        self.policy = policy
        self.urgent_buffer_s = urgent_buffer_s
        self.step_code_budget = step_code_budget  # "deadline": rows x chunk codes per step
        self.urgent_step_code_budget = urgent_step_code_budget  # the same while some listener is urgent
        self.background_yield = background_yield
        self.yield_max_s = yield_max_s  # "newcomer": the longest a newcomer waiting for codes holds lane 0
        self._timed_wake: asyncio.TimerHandle | None = None
        self._on_step = on_step  # (kind: "first" | "urgent" | "background" | "fifo" | "finish", streams, s)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vocoder")
        self._fast_executor = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="vocoder-fast")
                               if fast_lane_code_budget is not None else None)
        # `run`'s thread (the speech encoder): its work never waits for a vocoder step to end
        self._side_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vocoder-side")
        self._executors = {0: self._executor, 1: self._fast_executor, SIDE: self._side_executor}  # by lane
        self._streams: list[BatchedStream] = []
        self._discard: list[Any] = []  # sessions of aborted streams, closed by the loop
        self._in_flight: set[BatchedStream] = set()  # streams in a step now (on either lane)
        self._wake = asyncio.Event()
        self._fast_wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._fast_task: asyncio.Task | None = None
        self.num_open_sessions = 0
        self.num_steps = 0
        # health: the first device error a vocoder call raised, and when the call now running on each lane
        # began (monotonic, set in the worker thread)
        self.device_error: str | None = None
        self._busy_since: dict[int, float] = {}
        # load: the spans (start, end) in which some vocoder call ran on any lane, counted on the loop
        self._calls_running = 0
        self._busy_from = 0.0
        self._busy_spans: deque[tuple[float, float]] = deque()
        self._created = time.monotonic()

    @property
    def num_streams(self) -> int:
        """Streams registered and not yet finished."""
        return len(self._streams)

    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run(self._round, self._wake), name="vocoder-batcher")
        if self._fast_executor is not None and (self._fast_task is None or self._fast_task.done()):
            self._fast_task = loop.create_task(self._run(self._fast_round, self._fast_wake), name="vocoder-fast")

    async def _call(self, fn: Callable[..., Any], *args: Any, lane: int = 0) -> Any:
        executor = self._executors[lane]

        def timed() -> Any:
            self._busy_since[lane] = time.monotonic()
            try:
                return fn(*args)
            finally:
                del self._busy_since[lane]

        self._calls_running += 1
        if self._calls_running == 1:
            self._busy_from = time.monotonic()
        try:
            return await asyncio.get_running_loop().run_in_executor(executor, timed)
        finally:
            self._calls_running -= 1
            if not self._calls_running:
                now = time.monotonic()
                self._busy_spans.append((self._busy_from, now))
                while self._busy_spans[0][1] < now - BUSY_WINDOW_S:
                    self._busy_spans.popleft()

    def busy_fraction(self, now: float | None = None) -> float:
        """The share of the last BUSY_WINDOW_S (of the batcher's life while shorter) in which some vocoder call
        ran, on any lane: the replica's load whatever its step cap. Two lanes at once count once."""
        now = time.monotonic() if now is None else now
        start = max(now - BUSY_WINDOW_S, self._created)
        spans = [*self._busy_spans, *([(self._busy_from, now)] if self._calls_running else [])]
        busy = sum(max(0.0, end - max(begin, start)) for begin, end in spans)
        return min(1.0, busy / (now - start)) if now > start else 0.0

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on a worker thread of its own (one call at a time), beside the lanes' steps: other work on
        the vocoder's device (the speech encoder, on a CUDA stream of its own), which so waits for no step.
        (The graphs are captured in thread-local mode: kernels another thread launches do not break a
        capture.) Timed by the health check like every vocoder call; a device error marks the replica."""
        try:
            return await self._call(fn, *args, lane=SIDE)
        except Exception as exc:
            self._note_device_error(exc)
            raise

    def health_problem(self, call_timeout_s: float) -> str | None:
        """Why this replica's vocoder can serve no more, or None: a call failed with a device error (a CUDA
        error leaves the process's context unusable), or a call has run longer than `call_timeout_s` (a hung
        kernel)."""
        if self.device_error is not None:
            return f"a vocoder call failed with a device error: {self.device_error}"
        now = time.monotonic()
        for lane, since in list(self._busy_since.items()):
            if now - since > call_timeout_s:
                where = "the side thread (speech input)" if lane == SIDE else f"lane {lane}"
                return f"a vocoder call on {where} has run for {now - since:.0f} s (limit {call_timeout_s:g})"
        return None

    def _wake_all(self) -> None:
        self._wake.set()
        self._fast_wake.set()

    async def open(self, voice: str, seed: int) -> BatchedStream:
        """Open a vocoder session for one utterance (raises what `StreamingVocoder.open` raises); with the
        fast lane, on that lane."""
        self._ensure_loop()
        lane = 0 if self._fast_executor is None else 1
        options = {"lane": lane} if lane else {}  # a one-lane vocoder need not take the argument
        # Sessions queued for closing are closed first, on this call: at capacity (the vocoder's reserved
        # sessions = its max_ongoing_requests), a session its client just left must not make the state pool
        # grow, which drops the captured flow graphs.
        closable = self._take_closable()

        def close_then_open() -> tuple[Any, Exception | None, list[Exception]]:
            errors = self._close_sessions(closable)
            try:
                return self.vocoder.open(voice, seed=seed, **options), None, errors
            except Exception as exc:  # noqa: BLE001 - raised by the awaiting side
                return None, exc, errors

        call = asyncio.ensure_future(self._call(close_then_open, lane=lane))
        if closable:
            call.add_done_callback(functools.partial(self._after_closes, closable))
        try:
            session, failure, _ = await asyncio.shield(call)
        except asyncio.CancelledError:
            # the caller went away while the worker thread opens the session: close it once it exists
            call.add_done_callback(self._discard_opened)
            raise
        if failure is not None:
            self._note_device_error(failure)  # an idle replica's only vocoder calls are its opens
            raise failure
        self.num_open_sessions += 1
        stream = BatchedStream(session, asyncio.Queue())
        self._streams.append(stream)
        return stream

    def _discard_opened(self, call: asyncio.Future) -> None:
        """An open whose caller was cancelled finished: its session (if it opened) is closed by the next round."""
        if call.cancelled() or call.exception() is not None:
            return
        session, failure, _ = call.result()
        if failure is not None:
            self._note_device_error(failure)
            return
        self.num_open_sessions += 1
        self._discard.append(session)
        self._wake_all()

    def _take_closable(self) -> list[Any]:
        """The sessions queued for closing whose steps are not running, taken off the queue."""
        busy = {id(s.session) for s in self._in_flight}  # an aborted stream's step may still be running
        closable = [session for session in self._discard if id(session) not in busy]
        if closable:
            self._discard = [session for session in self._discard if id(session) in busy]
        return closable

    def _after_closes(self, closable: list[Any], call: asyncio.Future) -> None:
        """Count `closable` closed once the open that closed them first returned (with their errors)."""
        if call.cancelled() or call.exception() is not None:
            return  # the executor never ran it (shutdown)
        self._closed(closable, call.result()[2])

    def _closed(self, closable: list[Any], errors: list[Exception]) -> None:
        self.num_open_sessions -= len(closable)  # a session whose close failed is not retried either
        for exc in errors:
            logger.error("closing a vocoder session failed: %r", exc)
            self._note_device_error(exc)

    def _note_device_error(self, exc: BaseException) -> None:
        """Keep the first device error (a CUDA error poisons the process): `health_problem` reports it."""
        if self.device_error is None and is_device_error(exc):
            self.device_error = repr(exc)

    def push(self, stream: BatchedStream, codes: Sequence[int]) -> None:
        """Queue codes for the next step (never blocks). Codes outside 0..16383 are a ValueError here, for
        this stream's producer alone: in a step they would fail every stream of the batch."""
        assert not stream.is_ended, "push after end"
        if not codes:
            return
        codes = check_codes(codes)
        if not stream.pending:
            stream.pending_since = time.monotonic()
        stream.pending.extend(codes)
        stream.num_codes += len(codes)
        self._wake_all()

    def end(self, stream: BatchedStream) -> None:
        """No more codes: the loop flushes what is pending, finishes the session and puts END."""
        stream.is_ended = True
        self._wake_all()

    def close(self, stream: BatchedStream) -> None:
        """Abort: drop pending codes; the loop closes the session (`StreamingVocoder.close`, no tail)."""
        if stream.is_closed:
            return
        stream.is_closed = True
        stream.is_aborted = True
        stream.pending.clear()
        if stream in self._streams:
            self._streams.remove(stream)
        self._discard.append(stream.session)
        self._wake_all()

    def lag_s(self) -> float:
        """The largest lag behind real time among the streams the vocoder holds work for (0 when none): in a
        step now, ended (the rest of their audio is due), or with pending codes a step can turn into audio.
        A listener waiting for codes the LLM has not sent is not the vocoder's lag (more vocoder replicas
        would not help it)."""
        now = time.monotonic()
        return max((s.lag_s(now, self.sample_rate) for s in self._streams if self._holds_work(s)), default=0.0)

    def _holds_work(self, stream: BatchedStream) -> bool:
        if stream in self._in_flight or stream.is_ended:
            return True
        if not stream.pending:
            return False
        # "fifo" steps whatever codes are pending; "deadline" only whole chunks
        return self.policy == "fifo" or self.vocoder.next_chunk_codes(stream.session, len(stream.pending)) > 0

    async def _run(self, round_fn: Callable[[], Any], wake: asyncio.Event) -> None:
        while True:
            await wake.wait()
            wake.clear()
            try:
                while await round_fn():
                    pass
            except Exception as exc:  # a bug outside the vocoder calls: no stream may wait forever
                logger.exception("vocoder batching round failed: failing every stream")
                self._fail(list(self._streams), exc)

    def _fail(self, streams: Sequence[BatchedStream], exc: BaseException,
              finished: Sequence[BatchedStream] = ()) -> None:
        """End `streams` with a VocoderStepError; their sessions are closed by the next round, except those of
        `finished` (among `streams`), which the failed round had finished already."""
        self._note_device_error(exc)
        error = VocoderStepError(f"vocoder step failed: {exc!r}")
        for stream in streams:
            if stream in self._streams:
                self._streams.remove(stream)
            if stream.is_aborted:
                continue  # closed by `close`: its session is being discarded already
            stream.is_aborted = True  # nothing more is delivered to it
            stream.is_closed = True
            stream.pending.clear()
            stream.out.put_nowait(error)
            if stream not in finished:
                self._discard.append(stream.session)  # StreamingVocoder.close is a no-op on a closed session
        if streams:
            self._wake_all()

    async def _round(self) -> bool:
        """One step over ready streams plus any finishes; False when there was nothing to do."""
        did_work = False
        closable = self._take_closable()
        if closable:
            self._closed(closable, await self._call(self._close_sessions, closable))
            did_work = True
        now = time.monotonic()
        kind, ready = self.pick(now)
        if ready and kind == "background" and (hold_s := self._yield_s(now)) > 0:
            # left for after the newcomer's first chunk (that step's end, or a push, wakes this loop) or
            # until the least buffered of them turns urgent, whichever comes first
            urgent_in = ready[0].buffer_s(now, self.sample_rate) - self.urgent_buffer_s
            self._wake_in(min(hold_s, urgent_in))
            ready = []
        if ready:
            await self._step(kind, ready, lane=0)
            did_work = True
        finishing = ([s for s in self._streams if s.is_ended and not s.pending][: self.max_batch_size]
                     if self.policy == "fifo" else [])
        if finishing:
            for stream in finishing:
                stream.is_closed = True
                self._streams.remove(stream)
            started = time.monotonic()
            try:
                tails = await self._call(self.vocoder.finish_many, [s.session for s in finishing])
            except Exception as exc:
                logger.exception("vocoder finish of %d streams failed", len(finishing))
                self._fail(finishing, exc)
                return True
            self.num_open_sessions -= len(finishing)
            self._deliver_call("finish", finishing, tails, finishing, started)
            did_work = True
        return did_work

    def _close_sessions(self, sessions: Sequence[Any]) -> list[Exception]:
        """`StreamingVocoder.close` each session (worker thread); one failing close neither stops the others
        nor fails any live stream. -> the errors raised."""
        errors = []
        for session in sessions:
            try:
                self.vocoder.close(session)
            except Exception as exc:  # noqa: BLE001 - returned, logged by the loop
                errors.append(exc)
        return errors

    async def _fast_round(self) -> bool:
        """One step on the fast lane; False when it had nothing to do."""
        kind, ready = self._pick_deadline(time.monotonic(), lane=1)
        if not ready:
            return False
        await self._step(f"fast-{kind}", ready, lane=1)
        return True

    async def _step(self, kind: str, ready: list[BatchedStream], lane: int) -> None:
        """One vocoder step over `ready` on `lane`, its PCM delivered (or its streams failed)."""
        # "deadline": one chunk per stream, and a stream can end inside the step (its last codes, then
        # the rest of its audio); "fifo": every chunk the codes allow, ends in finish_many
        ending = [s for s in ready if self._ends_now(s)] if self.policy == "deadline" else []
        options: dict[str, Any] = ({"max_chunks": 1, "finish": [s.session for s in ending]}
                                   if self.policy == "deadline" else {})
        if lane:
            options["lane"] = lane
        work = [(s.session, s.pending) for s in ready]
        for stream in ready:
            stream.pending = []
        for stream in ending:
            stream.is_closed = True
            self._streams.remove(stream)
        self._in_flight.update(ready)
        started = time.monotonic()
        wall = time.time()
        for stream in ready:
            if stream.first_pcm_at is None:
                stream.step_started_wall, stream.step_codes = wall, stream.num_codes
        try:
            pcms = await self._call(lambda: self.vocoder.step(work, **options), lane=lane)
        except Exception as exc:
            logger.exception("vocoder step of %d streams failed", len(work))
            self._fail(ready, exc)
            return
        finally:
            self._in_flight.difference_update(ready)
            if self._fast_executor is not None:
                self._wake_all()  # its streams are free for the other lane again
        self.num_steps += 1
        self.num_open_sessions -= len(ending)
        self._deliver_call(kind, ready, pcms, ending, started)

    def _deliver_call(self, kind: str, streams: list[BatchedStream], pcms: Sequence[np.ndarray],
                      done: list[BatchedStream], started: float) -> None:
        """After a vocoder call over `streams` (`done`: those whose sessions it finished, out of `_streams`
        already): report it, deliver each stream's PCM, then END the `done` ones. A failure here is a bug
        outside the vocoder; it ends every stream of the call with the error, so none waits for END."""
        try:
            self._report(kind, len(streams), started)
            for stream, pcm in zip(streams, pcms, strict=True):
                self._deliver(stream, pcm)
        except Exception as exc:
            logger.exception("delivering a vocoder %s call of %d streams failed", kind, len(streams))
            self._fail(streams, exc, finished=done)
            return
        for stream in done:
            stream.out.put_nowait(END)

    def _yield_s(self, now: float) -> float:
        """How long lane 0 should still hold background steps for newcomers (`background_yield`); 0: not.
        A first chunk in flight holds until its step ends (which wakes the loop): reported as
        `yield_max_s`, the timed wake's fallback."""
        if self.background_yield == "off":
            return 0.0
        # with the fast lane, a "fast-first" step carries every first chunk in flight
        if any(s.first_pcm_at is None for s in self._in_flight):
            return self.yield_max_s
        if self.background_yield == "first_chunk":
            return 0.0
        return max((self.yield_max_s - (now - s.opened_at) for s in self._streams
                    if s.first_pcm_at is None and not s.is_closed), default=0.0)

    def _wake_in(self, delay_s: float) -> None:
        """Wake lane 0 after `delay_s` (at least 1 ms), replacing the wake set before."""
        if self._timed_wake is not None:
            self._timed_wake.cancel()
        self._timed_wake = asyncio.get_running_loop().call_later(max(delay_s, 0.001), self._wake.set)

    def _ends_now(self, stream: BatchedStream) -> bool:
        """"deadline": the stream has no more codes coming and none of its scheduled chunks is left."""
        return stream.is_ended and not self.vocoder.next_chunk_codes(stream.session, len(stream.pending))

    def pick(self, now: float) -> tuple[str, list[BatchedStream]]:
        """(kind, streams) the next step advances (see the module docstring); ("", []) when none."""
        if self.policy == "deadline":
            return self._pick_deadline(now)
        ready = sorted((s for s in self._streams if s.pending), key=lambda s: s.pending_since)
        return ("fifo", ready[: self.max_batch_size]) if ready else ("", [])

    def _pick_deadline(self, now: float, lane: int = 0) -> tuple[str, list[BatchedStream]]:
        """`pick` for policy "deadline" on `lane` (module docstring)."""
        fast = self._fast_executor is not None
        sizes: dict[BatchedStream, int] = {}  # codes of the chunk each stream would compute
        buffered: dict[BatchedStream, float] = {}  # seconds of audio its listener has left (playing streams)
        for s in self._streams:
            if s in self._in_flight:
                continue
            if s.first_pcm_at is None:
                if fast and lane == 0:
                    continue  # newcomers go to the fast lane only
            else:
                buffered[s] = s.buffer_s(now, self.sample_rate)
                if lane == 1 and buffered[s] >= self.urgent_buffer_s:
                    continue  # the fast lane takes newcomers and urgent listeners
            if size := self.vocoder.next_chunk_codes(s.session, len(s.pending)):
                sizes[s] = size
            elif s.is_ended:  # its end: the codes not yet vocoded (at least 1: it still has to close)
                sizes[s] = max(1, self.vocoder.unvocoded_codes(s.session, len(s.pending)))
        if not sizes:
            return "", []
        fresh = sorted((s for s in sizes if s.first_pcm_at is None), key=lambda s: s.pending_since)
        playing = sorted((s for s in sizes if s.first_pcm_at is not None),
                         key=lambda s: (buffered[s], s.pending_since))
        budget = self.step_code_budget
        if lane == 1:
            budget = self.fast_lane_code_budget
        elif (self.urgent_step_code_budget is not None and playing  # least buffered first: is it urgent?
                and buffered[playing[0]] < self.urgent_buffer_s):
            budget = self.urgent_step_code_budget
        picked: list[BatchedStream] = []
        largest = 0
        for s in fresh + playing:
            if len(picked) == self.max_batch_size:
                break
            codes = max(largest, sizes[s])  # the step pads every chunk to its largest
            if picked and self.vocoder.bucket_rows(len(picked) + 1) * codes > budget:
                continue  # a smaller chunk further down may still fit
            picked.append(s)
            largest = codes
        head = picked[0]
        if head.first_pcm_at is None:
            return "first", picked
        return ("urgent" if buffered[head] < self.urgent_buffer_s else "background"), picked

    def _report(self, kind: str, num_streams: int, started: float) -> None:
        if self._on_step is not None:
            self._on_step(kind, num_streams, time.monotonic() - started)

    def _deliver(self, stream: BatchedStream, pcm: np.ndarray) -> None:
        if stream.is_aborted:
            return  # aborted while its step ran
        if len(pcm):
            if stream.first_pcm_at is None:
                stream.first_pcm_at = time.monotonic()
                stream.first_pcm_marks = {"vocoder_first_step_started": stream.step_started_wall,
                                          "vocoder_first_chunk_codes": stream.step_codes,
                                          "vocoder_first_pcm": time.time()}
            stream.num_samples += len(pcm)
            stream.out.put_nowait(pcm)

    async def shutdown(self) -> None:
        """Stop the loops and the worker threads."""
        if self._timed_wake is not None:
            self._timed_wake.cancel()
        for task in (self._task, self._fast_task):
            if task is not None:
                task.cancel()
        for executor in self._executors.values():
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)
