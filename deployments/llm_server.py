"""`LLMServer`: the Ray Serve deployment around `runtime.engine.Engine` (no model logic here).

`generate` streams small dict events for one request: `text`, `codes`, then `finished` ("stop" or
"length"); or, in place of any of them, one `error` event: when the engine refuses the request on its first
step (validation, context length, overload), so the ingress can answer with a proper HTTP status, or when
it ends otherwise than normally (a failed step, a queue timeout, the replica shutting down:
`unfinished_error`), so that no client takes a cut-short answer for a whole one. When the caller goes away (Serve
cancels the call) or anything fails, the request is aborted in the engine, which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from deployments.errors import RETRY_AFTER_S, error_event, internal_error, overloaded
from deployments.metrics import LLMMetrics, RecentWindow
from deployments.timeline import stamp_codes
from runtime.errors import InvalidRequestError

logger = logging.getLogger("ray.serve")

METRICS_REFRESH_S = 1.0


def build_generation_request(engine: Any, request: dict[str, Any]) -> Any:
    """Turn the ingress's request dict into a `GenerationRequest` (tokenizes; raises ValueError)."""
    from runtime.prompts import ChatMessage, build_prompt_rows
    from runtime.request import GenerationRequest
    from runtime.sampling import SamplingParams

    messages = [ChatMessage(role="system" if role == "developer" else role, content=prompt_content(content))
                for role, content in request["messages"]]
    rows = build_prompt_rows(engine.tokenizer, messages, output_modality=request["output_modality"])
    text_sampling = SamplingParams(**request.get("text_sampling", {}))
    audio_sampling = SamplingParams(**request.get("audio_sampling", {}))
    text_sampling.validate()
    audio_sampling.validate()
    return GenerationRequest(
        request_id=request["request_id"], prompt_rows=tuple(rows), text_sampling=text_sampling,
        audio_sampling=audio_sampling, max_new_tokens=request["max_new_tokens"],
        min_new_tokens=request.get("min_new_tokens", 0), seed=request.get("seed"))


def prompt_content(content: Any) -> Any:
    """A request message's content for `runtime.prompts.ChatMessage`: text as it is; a list of parts
    (`{"type": "text", "text"}`, `{"type": "audio", "codes"}` after the vocoder encoded the speech) as a
    tuple of str and AudioContent. ValueError (PromptError) for anything else."""
    from runtime.prompts import AudioContent, PromptError

    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise PromptError(f"message content must be text or a non-empty list of parts, got {content!r:.80}")
    parts: list[Any] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind == "audio" and "codes" in part:
            parts.append(AudioContent(tuple(part["codes"])))
        else:  # e.g. speech samples that no encoder replaced
            raise PromptError(f"message part must be text or audio codes, got {kind!r}")
    return tuple(parts)


def to_event(event: Any) -> dict[str, Any]:
    """Engine event dataclass -> plain dict."""
    from runtime.request import AudioCodes, Finished, TextDelta

    if isinstance(event, TextDelta):
        return {"type": "text", "text": event.text}
    if isinstance(event, AudioCodes):
        return {"type": "codes", "codes": list(event.codes)}
    assert isinstance(event, Finished), f"unknown engine event {event!r}"
    timeline = event.timeline
    return {"type": "finished", "reason": event.reason, "num_prompt_tokens": event.num_prompt_tokens,
            "num_generated_tokens": event.num_generated_tokens, "num_audio_codes": event.num_audio_codes,
            "num_cached_prompt_tokens": event.num_cached_prompt_tokens, "error": event.error,
            "timeline": {} if timeline is None else {
                "engine_arrived": timeline.arrived, "engine_first_scheduled": timeline.first_scheduled,
                "engine_codes": list(timeline.codes)}}


def unfinished_error(finished: dict[str, Any]) -> dict[str, Any] | None:
    """The error event a `finished` event stands for, or None for a normal end ("stop", "length").

    "abort" reaches a reader only when the server ended the request (a replica shutting down: a caller's own
    cancel leaves no reader), so it is a 503 to retry elsewhere, as is an "error" of a request the engine
    never scheduled (it expired in the queue, or the engine failed before its turn); an "error" after it ran
    is a 500."""
    reason = finished["reason"]
    if reason == "abort":
        return overloaded("generation aborted: the LLM replica is shutting down", RETRY_AFTER_S).to_event()
    if reason != "error":
        return None
    if not finished["timeline"].get("engine_first_scheduled"):
        return overloaded(f"generation not started: {finished['error']}", RETRY_AFTER_S).to_event()
    return internal_error(f"generation failed: {finished['error']}").to_event()


# (LLMMetrics counter, EngineStats field): the engine's lifetime totals, exported by their increase
COUNTED_TOTALS = (("prefix_cache_query_tokens", "prefix_cache_queries"),
                  ("prefix_cache_hit_tokens", "prefix_cache_hits"), ("preemptions", "num_preemptions"),
                  ("step_failures", "num_step_failures"))


class LLMServer:
    """One engine per replica; `generate` is called with `handle.options(stream=True)`."""

    async def __init__(self, engine_kwargs: dict[str, Any]) -> None:
        from runtime.engine import Engine, EngineConfig

        self._engine = Engine.from_config(EngineConfig(**engine_kwargs))
        checks = self._engine.core.matmul_checks
        if checks:  # (a wrong product raised MatmulCheckError above: this replica never starts then)
            logger.info("matrix products checked before serving: %d right, largest relative error %.3g",
                        len(checks), max(c.rel_err for c in checks))
        self._metrics = LLMMetrics.create()
        self._ttfa = RecentWindow(window_s=60.0)
        self._seen = dict.fromkeys((field for _, field in COUNTED_TOTALS), 0)  # totals exported so far
        self._refresh_task = asyncio.get_running_loop().create_task(self._refresh_loop())

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream one request's events; see the module docstring."""
        started = time.monotonic()
        received_at = time.time()  # wall clock: the request's timeline (deployments/timeline.py)
        request_id = request["request_id"]
        try:
            codes_stream = request.get("codes_stream") or {}
            try:
                generation = build_generation_request(self._engine, request)
            except ValueError as exc:  # the client's text or sampling values: a 400 (InvalidRequestError)
                raise InvalidRequestError(str(exc)) from exc
            stream = self._engine.generate(generation,
                                           eager_codes=int(codes_stream.get("eager_codes", 0)),
                                           codes_batch_s=float(codes_stream.get("batch_s", 0.0)))
            first = await anext(stream)
        except Exception as exc:  # noqa: BLE001 - refused before any event: report it as an event
            yield error_event(exc, prompt_param=request.get("prompt_param", "input"))
            return
        is_finished = False
        codes_sent: list[float] = []  # when the event carrying each of the first codes left
        try:
            event = first
            while True:
                item = to_event(event)
                if item["type"] == "codes":
                    if not codes_sent:
                        first_code_s = time.monotonic() - started
                        self._ttfa.add(first_code_s)
                        self._metrics.time_to_first_code.observe(first_code_s)
                    stamp_codes(codes_sent, len(item["codes"]))
                is_finished = item["type"] == "finished"
                if is_finished:
                    item["timeline"].update(llm_received=received_at, llm_codes_sent=codes_sent)
                    failed = unfinished_error(item)
                    if failed is not None:  # never a normal end: the caller reports the error
                        yield failed
                        return
                yield item
                if is_finished:
                    return
                event = await anext(stream)
        finally:
            if not is_finished:  # cancelled by the caller, or failed mid-stream
                logger.info("aborting request %s", request_id)
                self._engine.abort(request_id)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    def check_health(self) -> None:
        """Serve's replica health check (every `health_check_period_s`): raises EngineUnhealthyError while the
        engine can serve no more (a stopped step thread, a device error, failed steps in a row, a hung step), so
        that Serve replaces this replica; the engine refuses new requests meanwhile."""
        self._engine.check_health()

    def stats(self) -> dict[str, Any]:
        """Engine stats as a dict (for /admin/stats and tests)."""
        from runtime.device_memory import memory_stats

        stats, config = self._engine.stats(), self._engine.config
        return {**{name: getattr(stats, name) for name in (
            "num_running", "num_waiting", "num_blocks_total", "num_blocks_used", "num_blocks_free",
            "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_step_failures",
            "num_tracked_requests")},
            # what the cache holds and how many tokens fit (an FP8 cache holds ~1.9x a bf16 one's)
            "kv_cache_dtype": str(config.kv_dtype).removeprefix("torch."),
            "kv_capacity_tokens": stats.num_blocks_total * config.block_size,
            "device_memory": memory_stats(config.device)}  # None off CUDA

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metrics (see deployments.autoscaling:llm_policy). Async: on the replica's loop,
        where `generate` adds to the first-audio window (a sync one runs on Serve's thread pool)."""
        stats = self._engine.stats()
        usage = stats.num_blocks_used / stats.num_blocks_total if stats.num_blocks_total else 0.0
        return {"kv_cache_usage": float(usage), "num_waiting": float(stats.num_waiting),
                "num_running": float(stats.num_running), "ttfa_p90_s": self._ttfa.quantile(0.9)}

    def _refresh_metrics(self) -> None:
        stats = self._engine.stats()
        self._metrics.queued_requests.set(stats.num_waiting)
        self._metrics.kv_blocks_used.set(stats.num_blocks_used)
        self._metrics.kv_blocks_free.set(stats.num_blocks_free)
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        self._metrics.prefix_cache_hit_rate.set(hits / queries if queries else 0.0)
        for counter, field in COUNTED_TOTALS:
            total = getattr(stats, field)
            if total > self._seen[field]:
                getattr(self._metrics, counter).inc(total - self._seen[field])
                self._seen[field] = total

    async def _refresh_loop(self) -> None:
        while True:
            try:
                self._refresh_metrics()
            except Exception:  # metrics must never take the replica down
                logger.exception("refreshing LLM metrics failed")
            await asyncio.sleep(METRICS_REFRESH_S)

    async def __del__(self) -> None:
        self._refresh_task.cancel()
        await self._engine.shutdown()

