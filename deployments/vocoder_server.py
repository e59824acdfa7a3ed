"""`VocoderServer`: the Ray Serve deployment around `vocoder.StreamingVocoder` (no model logic here).

`synthesize` is ONE long streaming call per utterance. It calls the LLM deployment itself, so the
codes of an utterance flow LLM replica -> this replica -> ingress, and the utterance's vocoder session
is opened, advanced and finished inside this one call: its state can never be routed to another
replica. Codes are pushed into the replica's `VocoderBatcher`, which advances the streams that need it
most with one `StreamingVocoder.step` per round (deployments/batcher.py). The LLM is asked to send the
codes of a stream's first two chunks at once and later ones in batches (`codes_stream` in the request;
`Engine.generate`), so each stream costs a few Ray streaming items per second instead of one per step.

Events yielded (plain dicts): `started` (the engine accepted the request), `text`, `audio` (PCM16
bytes), `done` (usage), or `error` (first item only, or mid-stream when the engine fails).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from deployments.batcher import END, BatchedStream, VocoderBatcher, VocoderStepError, VocoderUnhealthyError
from deployments.errors import error_event, internal_error, overloaded
from deployments.framing import pcm16_bytes
from deployments.metrics import RecentWindow, VocoderMetrics
from deployments.timeline import stamp_codes
from runtime.errors import InvalidRequestError
from vocoder.speech_encoder import INPUT_SAMPLE_RATE

logger = logging.getLogger("ray.serve")


class VocoderServer:
    """One StreamingVocoder per replica, plus a handle to the LLM deployment."""

    async def __init__(self, vocoder_kwargs: dict[str, Any], max_batch_size: int, llm: Any,
                       streaming: dict[str, Any] | None = None, call_timeout_s: float = 60.0,
                       retry_after_s: float = 1.0, speech_encoder: str = "tiny") -> None:
        """`streaming`: `codes_batch_s`, `policy`, `urgent_buffer_s`, `step_code_budget`, `urgent_step_code_budget`,
        `fast_lane_code_budget`, `background_yield`, `yield_max_s` (AppArgs). `call_timeout_s`: AppArgs'
        `vocoder_call_timeout_s` (`check_health`). `retry_after_s`: AppArgs' `retry_after_s`, the Retry-After of
        the 503 when the LLM deployment is over capacity. `speech_encoder`: AppArgs' `speech_encoder`, built
        on the vocoder's device and dtype (seeded by its seed)."""
        from vocoder.config import SAMPLE_RATE
        from vocoder.speech_encoder import build_speech_encoder_for_serving
        from vocoder.streaming import build_for_serving

        batcher_options = dict(streaming or {})  # VocoderBatcher's policy options; its defaults otherwise
        codes_batch_s = batcher_options.pop("codes_batch_s", 0.0)
        kwargs = dict(vocoder_kwargs)
        self._vocoder, warm = build_for_serving(kwargs.pop("preset"), **kwargs)
        # after the vocoder: under its memory cap (set by build_for_serving), its graphs captured first
        self._encoder = None if speech_encoder == "none" else build_speech_encoder_for_serving(speech_encoder, kwargs)
        if warm:
            logger.info("vocoder warm-up: %d graphs captured in %.1f s (%d steps)",
                        warm["graphs_captured"], warm["seconds"], warm["steps"])
        if "eager_steps" in warm:
            logger.info("vocoder eager warm-up: %d steps in %.1f s", warm["eager_steps"], warm["eager_seconds"])
        self._llm = llm
        self._call_timeout_s = call_timeout_s
        self._retry_after_s = retry_after_s
        self._metrics = VocoderMetrics.create()
        self._batch_sizes = RecentWindow(window_s=30.0)
        self._batcher = VocoderBatcher(self._vocoder, max_batch_size=max_batch_size, sample_rate=SAMPLE_RATE,
                                       on_step=self._on_step, **batcher_options)
        self._codes_stream = {"eager_codes": self._vocoder.codes_for_two_chunks, "batch_s": codes_batch_s}
        self._num_active = 0
        self._metrics.active_streams.set(0)

    def _on_step(self, kind: str, num_streams: int, seconds: float) -> None:
        self._metrics.step_seconds.observe(seconds, tags={"kind": kind})
        if kind != "finish":
            self._metrics.batch_size.observe(num_streams)
            if not kind.startswith("fast-"):
                # occupancy is the main lane's: the fast lane's steps (newcomers' first chunks, a code budget
                # of their own) are small by design and would pull the mean down, and with it the scaling
                self._batch_sizes.add(num_streams)

    def check_health(self) -> None:
        """Serve's replica health check: raises VocoderUnhealthyError after a vocoder call failed with a device
        error, or while one has run longer than `vocoder_call_timeout_s`, so that Serve replaces the replica."""
        problem = self._batcher.health_problem(self._call_timeout_s)
        if problem is not None:
            raise VocoderUnhealthyError(problem)

    def voices(self) -> list[str]:
        """Names of the voices this replica can speak with."""
        return sorted(self._vocoder.voices.names())

    def stats(self) -> dict[str, Any]:
        """Counts for /admin/stats and tests, and the allocator's bytes on CUDA (None elsewhere)."""
        from runtime.device_memory import memory_stats

        return {"active_streams": self._num_active, "open_sessions": self._vocoder.num_open_sessions,
                "batched_streams": self._batcher.num_streams, "num_steps": self._batcher.num_steps,
                "device_memory": memory_stats(self._vocoder.device)}

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metrics (see deployments.autoscaling:vocoder_policy). Async: on the replica's loop,
        where the batcher changes what it reads; Serve runs a sync one on a thread pool, where reading the
        step window and the stream list raced with their changes (about 1 read in 3 failed in a tight loop)."""
        occupancy = self._batch_sizes.mean() / self._batcher.max_batch_size
        # load whatever the step cap (occupancy at a cap of 2 only says whether the replica serves)
        return {"batch_occupancy": float(min(1.0, occupancy)), "busy_fraction": self._batcher.busy_fraction(),
                "lag_s": float(self._batcher.lag_s())}

    def _set_active(self, delta: int) -> None:
        self._num_active += delta
        self._metrics.active_streams.set(self._num_active)

    async def synthesize(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream one utterance: see the module docstring for the events."""
        started = time.monotonic()
        received_at = time.time()  # wall clock: the request's timeline (deployments/timeline.py)
        encoded_at: dict[str, float] = {}
        if any(not isinstance(content, str) for _, content in request.get("messages", ())):
            try:
                request = {**request, "messages": await self._encode_speech(request["messages"])}
            except Exception as exc:
                logger.exception("encoding speech input failed")
                yield error_event(exc, retry_after_s=self._retry_after_s)
                return
            encoded_at["vocoder_speech_encoded"] = time.time()
        if request["with_audio"]:
            request = {**request, "codes_stream": self._codes_stream}
        llm_stream = self._llm.generate.options(stream=True).remote(request)
        # The vocoder session opens while the LLM prefills (the worker thread may be busy with a step).
        opening = (asyncio.ensure_future(self._batcher.open(request["voice"], request.get("seed") or 0))
                   if request["with_audio"] else None)
        try:
            first = await anext(llm_stream)
        except asyncio.CancelledError:  # the caller went away during the prefill
            llm_stream.cancel()
            self._discard(opening)
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the ingress as an error event
            llm_stream.cancel()
            self._discard(opening)
            yield error_event(exc, retry_after_s=self._retry_after_s)
            return
        if first["type"] == "error":
            self._discard(opening)
            yield first
            return
        self._set_active(+1)
        stream: BatchedStream | None = None
        reader: asyncio.Task | None = None
        is_done = False  # True only when the utterance completed normally
        try:
            if opening is not None:
                try:
                    stream = await opening
                except Exception as exc:  # noqa: BLE001 - e.g. a voice file gone: an error event
                    yield error_event(exc, retry_after_s=self._retry_after_s)
                    return
            out: asyncio.Queue = stream.out if stream is not None else asyncio.Queue()
            finished: dict[str, Any] = {}
            codes_received: list[float] = []
            reader = asyncio.get_running_loop().create_task(
                self._read_llm(first, llm_stream, stream, out, finished, codes_received))
            yield {"type": "started"}
            num_samples = 0
            while True:
                item = await out.get()
                if item is END:
                    break
                if isinstance(item, VocoderStepError):  # the batcher closed the stream's session
                    yield internal_error(str(item)).to_event()
                    return
                if isinstance(item, dict):  # text or error from the reader
                    yield item
                    if item["type"] == "error":
                        return
                    continue
                if not num_samples:
                    self._metrics.time_to_first_pcm.observe(time.monotonic() - started)
                num_samples += len(item)
                yield {"type": "audio", "pcm": pcm16_bytes(item)}
            await reader
            is_done = True
            timeline = {**finished.pop("timeline", {}), "vocoder_received": received_at, **encoded_at,
                        "vocoder_codes_received": codes_received,
                        **(stream.first_pcm_marks if stream is not None else {})}
            yield {"type": "done", **finished, "num_audio_samples": num_samples, "timeline": timeline}
        finally:
            self._set_active(-1)
            if reader is not None and not reader.done():
                reader.cancel()
            if not is_done:
                llm_stream.cancel()  # no-op when the LLM stream already ended
            if stream is not None and not stream.is_closed:
                self._batcher.close(stream)
            elif stream is None:
                # cancelled after the session opened but before `await opening` resumed: the task holds it
                self._discard(opening)

    async def _encode_speech(self, messages: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """The messages with every speech part's samples (16 kHz float32, decoded by the ingress) replaced by
        its codes, `{"type": "audio", "codes": [...]}`: all clips of the request in one call on the vocoder's
        side thread (`VocoderBatcher.run`; the encoder has its own CUDA stream)."""
        if self._encoder is None:  # the ingress refuses speech input when it is off: this is a second line
            raise InvalidRequestError("speech input is not enabled on this server (speech_encoder: none)")
        clips = [part["samples"] for _, content in messages if not isinstance(content, str)
                 for part in content if part["type"] == "audio"]
        started = time.monotonic()
        codes = iter(await self._batcher.run(lambda: [self._encoder.encode(clip) for clip in clips]))
        self._metrics.step_seconds.observe(time.monotonic() - started, tags={"kind": "encode"})
        self._metrics.speech_input_seconds.inc(sum(clip.size for clip in clips) / INPUT_SAMPLE_RATE)
        return [(role, content if isinstance(content, str) else [
            {"type": "audio", "codes": next(codes)} if part["type"] == "audio" else part for part in content])
            for role, content in messages]

    def _discard(self, opening: asyncio.Future | None) -> None:
        """Close the session `opening` gives (now, or when it opens): its request ended first."""
        if opening is None:
            return

        def close(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is None:
                self._batcher.close(done.result())

        opening.add_done_callback(close)

    async def _read_llm(self, first: dict[str, Any], llm_stream: Any, stream: BatchedStream | None,
                        out: asyncio.Queue, finished: dict[str, Any], codes_received: list[float]) -> None:
        """Move LLM events into the batcher (codes) or straight to `out` (text); END after the tail.
        The `finished` event's fields land in `finished`; the first codes' arrival times in `codes_received`."""
        try:
            item = first
            while True:
                if item["type"] == "text":
                    out.put_nowait(item)
                elif item["type"] == "codes":
                    stamp_codes(codes_received, len(item["codes"]))
                    if stream is not None:
                        self._batcher.push(stream, item["codes"])
                elif item["type"] == "finished":
                    finished.update({k: v for k, v in item.items() if k != "type"})  # a normal end (LLMServer)
                    break
                elif item["type"] == "error":
                    out.put_nowait(item)
                    return
                item = await anext(llm_stream)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # `synthesize` cancelled this reader: nobody reads `out` any more
            # raised by the LLM stream itself: Ray's handle raises CancelledError when the remote generation was
            # cancelled by someone else (its replica stopping); without an event `synthesize` would wait on
            out.put_nowait(overloaded("server unavailable: the LLM deployment cancelled the generation",
                                      self._retry_after_s).to_event())
            return
        except Exception as exc:
            logger.exception("reading the LLM stream failed")
            out.put_nowait(error_event(exc, retry_after_s=self._retry_after_s))
            return
        if stream is not None:
            self._batcher.end(stream)  # the batcher flushes, finishes and puts END
        else:
            out.put_nowait(END)

    async def __del__(self) -> None:
        await self._batcher.shutdown()
