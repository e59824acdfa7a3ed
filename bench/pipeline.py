"""The speech workload in process: `runtime.Engine` -> `VocoderBatcher(StreamingVocoder)`, no Ray, no HTTP.

    python bench/pipeline.py --preset tiny --device cpu --concurrency 1,4 --max-new-tokens 24
    python bench/pipeline.py --preset full --random-weights --device cuda --concurrency 1,8,64 \
        --prompt-tokens 512 --max-new-tokens 100 --config config/serve-h200.yaml

Each request: the read-aloud prompt (same rows the ingress builds), codes from `Engine.generate` pushed
into the same `VocoderBatcher` the vocoder deployment uses (one `StreamingVocoder.step` per round), PCM
timed as it comes out. Prints ONE JSON summary with the fields of `bench/client.py` (see
`bench/measure.py`) plus `first_codes_s` (engine-only time to the first codes), so engine time can be
told apart from serving overhead. `--config` takes engine/vocoder settings from a Serve YAML.

`--speech-input-s S`: speech in. Each request is then a user turn holding an S-second clip (distinct noise
per request) that the replica's speech encoder (`speech_encoder` of the config, built as the vocoder
deployment builds it) turns into codes on the batcher's side thread, as `VocoderServer` does, before the engine
sees it; times count from before the encode. Each level runs twice, back to back: `prompt_input` "speech",
then "text", a user turn of text with as many prompt rows (the baseline: the same prefill, no encode).
Without it, `prompt_input` is "read_aloud" (the speech route's prompt).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.measure import (  # the repo root is on sys.path now
    FILLER,
    AudioTimeline,
    LoopLag,
    RequestResult,
    closed_loop,
    percentiles,
    plot_levels,
    requests_per_level,
    speech_prompt_text,
    summarize,
)
from deployments.batcher import END, VocoderBatcher, VocoderStepError  # pure asyncio: no Ray import

_ids = itertools.count()


class Pipeline:
    """One engine and one batched vocoder, driven the way the deployments drive them."""

    def __init__(self, engine: Any, vocoder: Any, max_batch_size: int, speech_encoder: Any = None,
                 **batcher_options: Any) -> None:
        """`batcher_options`: VocoderBatcher's `policy` / `urgent_buffer_s` / `step_code_budget`. Every
        vocoder call the batcher makes is kept in `steps` (kind, streams, seconds), an encode of speech input
        as kind "encode"."""
        from vocoder.config import SAMPLE_RATE

        self.engine = engine
        self.vocoder = vocoder
        self.speech_encoder = speech_encoder
        self.steps: list[tuple[str, int, float]] = []
        self.batcher = VocoderBatcher(vocoder, max_batch_size=max_batch_size, sample_rate=SAMPLE_RATE,
                                      on_step=lambda *step: self.steps.append(step), **batcher_options)

    def request(self, text: str, *, max_new_tokens: int, min_new_tokens: int, seed: int | None,
                temperature: float | None) -> Any:
        """A GenerationRequest with the ingress's read-aloud prompt."""
        return speech_request(self.engine.tokenizer, text, max_new_tokens=max_new_tokens,
                              min_new_tokens=min_new_tokens, seed=seed, temperature=temperature)

    def speech_question(self, clip: Any, *, max_new_tokens: int, min_new_tokens: int, seed: int | None,
                        temperature: float | None) -> SpeechQuestion:
        """A request whose prompt is one user turn of speech (`clip`: 16 kHz float32), to be encoded first."""
        return SpeechQuestion(f"bench-{next(_ids)}", clip, {"max_new_tokens": max_new_tokens,
                                                             "min_new_tokens": min_new_tokens, "seed": seed,
                                                             "temperature": temperature})

    async def encode(self, question: SpeechQuestion) -> Any:
        """The GenerationRequest of a speech question: its clip encoded on the side thread (`VocoderBatcher.run`, as
        `VocoderServer` does), the codes one user turn of audio, audio output."""
        from runtime.prompts import AudioContent

        if self.speech_encoder is None:
            raise ValueError("this pipeline has no speech encoder")
        t0 = time.perf_counter()
        codes = await self.batcher.run(self.speech_encoder.encode, question.clip)
        self.steps.append(("encode", 1, time.perf_counter() - t0))
        return question_request(self.engine.tokenizer, question.request_id, AudioContent(tuple(codes)),
                                **question.options)

    async def run_request(self, request: Any) -> RequestResult:
        """Generate and vocode one request (a SpeechQuestion is encoded first, inside the timing); an engine
        refusal or failure, a vocoder step that failed or a session that did not open is a failed result,
        counted with the others, as the server's error statuses are over HTTP."""
        from runtime.errors import EngineOverloadedError, EngineUnhealthyError, InvalidRequestError

        result = RequestResult(request_id=request.request_id)
        started = time.perf_counter()
        try:
            return await self._run_request(request, result, started)
        except Exception as exc:  # noqa: BLE001 - a failed request, not a failed run
            statuses = {InvalidRequestError: 400, EngineOverloadedError: 503, EngineUnhealthyError: 503}
            result.status = next((code for kind, code in statuses.items() if isinstance(exc, kind)), 500)
            result.error = f"{type(exc).__name__}: {exc}"
            return result

    async def _run_request(self, request: Any, result: RequestResult, started: float) -> RequestResult:
        from runtime.request import AudioCodes, Finished

        timeline = AudioTimeline(started, result)
        if isinstance(request, SpeechQuestion):
            request = await self.encode(request)
        stream = await self.batcher.open("default", request.seed or 0)
        finished: list[Finished] = []

        async def read_engine() -> None:
            try:
                async for event in self.engine.generate(request):
                    if isinstance(event, AudioCodes):
                        if result.first_codes_s is None:
                            result.first_codes_s = time.perf_counter() - started
                        self.batcher.push(stream, event.codes)
                    elif isinstance(event, Finished):
                        finished.append(event)
            finally:
                self.batcher.end(stream)

        reader = asyncio.get_running_loop().create_task(read_engine())
        try:
            while (item := await stream.out.get()) is not END:
                if isinstance(item, VocoderStepError):  # the batcher closed the stream; nothing more comes
                    raise item
                timeline.add(time.perf_counter(), len(item))
        finally:
            if not reader.done():  # the vocoder failed: the engine's request is aborted, not left running
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
            if not stream.is_closed:
                self.batcher.close(stream)
        timeline.finish(time.perf_counter())
        await reader  # an engine refusal or failure raises here
        end = finished[0]
        result.status = 200 if end.reason in ("stop", "length") else 500
        result.error = None if result.status == 200 else f"finished with {end.reason}: {end.error}"
        result.num_audio_codes, result.num_prompt_tokens = end.num_audio_codes, end.num_prompt_tokens
        return result

    async def closed_loop(self, make_request: Any, concurrency: int, num_requests: int,
                          ramp_s: float = 0.0, listen: bool = False) -> tuple[list[RequestResult], float]:
        """`concurrency` workers run `num_requests` requests back to back -> (results, wall seconds);
        `ramp_s` spreads the workers' first requests, `listen` makes each worker hear its reply in real time
        before the next one (`bench.measure.closed_loop`, as `bench/client.py --listen`)."""
        return await closed_loop(lambda: self.run_request(make_request()), concurrency, num_requests, ramp_s,
                                 listen)


@dataclass(frozen=True)
class SpeechQuestion:
    """A request of speech input before its encode: the clip and the GenerationRequest's other fields."""

    request_id: str
    clip: Any  # 16 kHz float32 samples
    options: dict[str, Any]


def question_rows(tokenizer: Any, content: Any) -> list[Any]:
    """Prompt rows of one user turn, `content` text or AudioContent (speech input), with audio output."""
    from runtime.prompts import ChatMessage, build_prompt_rows

    return build_prompt_rows(tokenizer, [ChatMessage("user", content)], output_modality="audio")


def question_request(tokenizer: Any, request_id: str, content: Any, **options: Any) -> Any:
    """A GenerationRequest of one user turn (`question_rows`); `options` as `generation_request`'s."""
    return generation_request(question_rows(tokenizer, content), request_id, **options)


def text_question(num_codes: int, variant: int) -> str:
    """User text whose one-turn prompt has as many rows as a speech question of `num_codes` codes with the
    presets' byte-level tokenizer (one row per ASCII character; audio: a row per code and two more), starting
    with the variant's digits reversed so that no two variants share a prefix-cache block."""
    from runtime.prompts import AudioContent
    from runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer.tiny()
    chars = len(question_rows(tokenizer, AudioContent((0,) * num_codes))) - len(question_rows(tokenizer, ""))
    head = f"{variant % 10**7:07d}"[::-1] + " "
    if chars < len(head):
        raise ValueError(f"a speech question of {num_codes} codes is too short for a text baseline")
    text = (head + FILLER * (chars // len(FILLER) + 1))[:chars]
    assert len(question_rows(tokenizer, text)) == chars + len(question_rows(tokenizer, ""))
    return text


def speech_request(tokenizer: Any, text: str, **options: Any) -> Any:
    """A GenerationRequest with the ingress's read-aloud prompt; `options` as `generation_request`'s."""
    from runtime.prompts import read_aloud_rows

    return generation_request(read_aloud_rows(tokenizer, text), f"bench-{next(_ids)}", **options)


def generation_request(rows: list[Any], request_id: str, *, max_new_tokens: int, min_new_tokens: int,
                       seed: int | None, temperature: float | None) -> Any:
    """A GenerationRequest of prompt `rows` (audio sampling at `temperature`, its default when None)."""
    from runtime.request import GenerationRequest
    from runtime.sampling import SamplingParams

    audio = SamplingParams() if temperature is None else SamplingParams(temperature=temperature)
    return GenerationRequest(request_id=request_id, prompt_rows=tuple(rows), audio_sampling=audio,
                             max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, seed=seed)


def app_args(path: str) -> dict[str, Any]:
    """A Serve YAML's first application `args`."""
    import yaml

    with open(path) as f:
        return yaml.safe_load(f)["applications"][0].get("args", {})


def settings_from_config(path: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(engine kwargs, vocoder settings) from a Serve YAML's first application `args` (empty without one)."""
    if path is None:
        return {}, {}
    args = app_args(path)
    # every vocoder_* setting but the Serve deployment's options (a config file holds AppArgs fields only)
    vocoder = {k.removeprefix("vocoder_"): v for k, v in args.items()
               if k.startswith("vocoder_") and k != "vocoder_options"}
    return dict(args.get("engine", {})), vocoder


def split_vocoder_settings(vocoder_kwargs: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Take the batcher's settings out of `vocoder_kwargs` (what is left builds the vocoder, as the vocoder
    deployment does) -> (max batch size, VocoderBatcher options)."""
    max_batch = vocoder_kwargs.pop("max_batch_size", 32)
    batcher_options = {k: vocoder_kwargs.pop(k)
                       for k in ("urgent_buffer_s", "step_code_budget", "urgent_step_code_budget",
                                 "background_yield", "yield_max_s")
                       if k in vocoder_kwargs}
    if "batching" in vocoder_kwargs:
        batcher_options["policy"] = vocoder_kwargs.pop("batching")
    if vocoder_kwargs.get("fast_lane_code_budget") is not None:  # the vocoder's second lane, the batcher's loop
        batcher_options["fast_lane_code_budget"] = vocoder_kwargs["fast_lane_code_budget"]
    return max_batch, batcher_options


def build(args: argparse.Namespace) -> tuple[Pipeline, dict[str, Any]]:
    """Engine + vocoder from the config file, then the command-line overrides -> (pipeline, settings)."""
    from runtime.engine import Engine, EngineConfig
    from vocoder.speech_encoder import build_speech_encoder_for_serving
    from vocoder.streaming import build_for_serving

    engine_kwargs, vocoder_kwargs = settings_from_config(args.config)
    # the replicas' memory caps split one card between two processes; here both share one process
    engine_kwargs.pop("memory_cap_bytes", None)
    vocoder_kwargs.pop("memory_cap_bytes", None)
    if args.checkpoint:
        engine_kwargs["model"] = args.checkpoint
    elif args.preset:
        engine_kwargs["model"] = args.preset
    overrides = {"device": args.device, "dtype": args.dtype, "kv_cache_bytes": args.kv_cache_bytes,
                 "max_num_running": args.max_num_running, "max_model_len": args.max_model_len}
    engine_kwargs.update({k: v for k, v in overrides.items() if v is not None})
    engine_kwargs.setdefault("model", "tiny")
    if engine_kwargs["model"] == "full" and not args.random_weights:
        raise SystemExit("the 'full' preset has random weights: pass --random-weights to say you mean it")
    vocoder_kwargs.setdefault("preset", "full" if engine_kwargs["model"] != "tiny" else "tiny")
    vocoder_kwargs.setdefault("device", engine_kwargs.get("device", "cpu"))
    if args.vocoder_preset:
        vocoder_kwargs["preset"] = args.vocoder_preset
    if args.device is not None:
        vocoder_kwargs["device"] = args.device
    max_batch, batcher_options = split_vocoder_settings(vocoder_kwargs)
    loaded = time.perf_counter()
    engine = Engine.from_config(EngineConfig(**engine_kwargs))
    vocoder, warm = build_for_serving(**vocoder_kwargs)  # as deployments/vocoder_server.py builds it
    settings = {"engine": engine_kwargs, "vocoder": {**vocoder_kwargs, "max_batch_size": max_batch,
                                                     **batcher_options},
                "vocoder_warm_up": warm, "build_s": time.perf_counter() - loaded}
    encoder = None
    if getattr(args, "speech_input_s", None):
        spec = args.speech_encoder or (app_args(args.config).get("speech_encoder") if args.config else None) \
            or vocoder_kwargs["preset"]
        if spec == "none":
            raise SystemExit("--speech-input-s needs a speech encoder: the config says none (--speech-encoder)")
        t0 = time.perf_counter()
        encoder = build_speech_encoder_for_serving(spec, vocoder_kwargs)  # as the vocoder deployment does
        settings["speech_encoder"] = {"spec": spec, "build_s": time.perf_counter() - t0}
    return Pipeline(engine, vocoder, max_batch, encoder, **batcher_options), settings


async def run(args: argparse.Namespace, levels: list[int], text: str,
              summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Build, then warm up and measure every concurrency level -> level summaries (also saved to
    --out after each level, so a run cut short keeps what it measured)."""
    pipeline, summary["settings"] = build(args)
    summary.update(_device_info(summary["settings"]["engine"].get("device", "cpu")))
    min_new = args.max_new_tokens if args.fixed_length else 0

    variants = itertools.count()
    options = {"max_new_tokens": args.max_new_tokens, "min_new_tokens": min_new, "seed": args.seed,
               "temperature": args.temperature}
    clip_samples = round((args.speech_input_s or 0) * 16000)
    if clip_samples:
        num_codes = pipeline.speech_encoder.config.num_codes(clip_samples)
        summary["request"]["speech_input"] = {"seconds": args.speech_input_s, "samples": clip_samples,
                                              "codes": num_codes}

    def make_request() -> Any:
        if args.prompt_tokens and not args.same_prompt:  # as bench/client.py: distinct user text
            return pipeline.request(speech_prompt_text(args.prompt_tokens, variant=next(variants)), **options)
        return pipeline.request(text, **options)

    def make_speech_question() -> Any:  # distinct noise per request: no two prompts share their codes
        rng = np.random.default_rng(next(variants))
        return pipeline.speech_question((0.1 * rng.standard_normal(clip_samples)).astype(np.float32), **options)

    def make_text_question() -> Any:  # the baseline: the same one-turn prompt length, in text
        return question_request(pipeline.engine.tokenizer, f"bench-{next(_ids)}",
                                text_question(num_codes, next(variants)), **options)

    inputs = [("speech", make_speech_question), ("text", make_text_question)] if clip_samples else \
        [("read_aloud", make_request)]
    out: list[dict[str, Any]] = []
    lag = LoopLag()
    policies = parse_policies(args.policies) or [(pipeline.batcher.policy, None)]
    default_budget = pipeline.batcher.step_code_budget
    try:
        for concurrency, count in zip(levels, requests_per_level(levels, args.requests), strict=True):
            for (policy, budget), (prompt_input, make_request) in itertools.product(policies, inputs):
                pipeline.batcher.policy = policy  # the same level under each policy and input, back to back
                pipeline.batcher.step_code_budget = budget or default_budget
                if args.warmup:
                    await pipeline.closed_loop(make_request, concurrency, args.warmup)
                lag.start()
                del pipeline.steps[:]
                # the engine's and the batcher's counters run for the process: this level's are differences
                preemptions_before, steps_before = pipeline.engine.stats().num_preemptions, pipeline.batcher.num_steps
                results, wall_s = await pipeline.closed_loop(make_request, concurrency, count, args.ramp_s,
                                                             args.listen)
                stats = pipeline.engine.stats()
                out.append(summarize(results, wall_s, concurrency=concurrency, ramp_s=args.ramp_s, listen=args.listen,
                                     prompt_input=prompt_input, vocoder_batching=policy,
                                     step_code_budget=pipeline.batcher.step_code_budget,
                                     driver_loop_lag_s=lag.stop(),
                                     engine_preemptions=stats.num_preemptions - preemptions_before,
                                     vocoder_steps=pipeline.batcher.num_steps - steps_before,
                                     vocoder_step_kinds=step_kinds(pipeline.steps)))
            summary.update(_device_info(summary["settings"]["engine"].get("device", "cpu")), levels=out)
            if args.out:
                Path(args.out).write_text(json.dumps(summary) + "\n")
    finally:
        await pipeline.batcher.shutdown()
        await pipeline.engine.shutdown()
    return out


def parse_policies(text: str | None) -> list[tuple[str, int | None]]:
    """`--policies`: "POLICY[:BUDGET],..." -> [(policy, step code budget or None)]; SystemExit if bad."""
    from deployments.batcher import POLICIES

    out: list[tuple[str, int | None]] = []
    for spec in text.split(",") if text else []:
        policy, colon, budget = spec.partition(":")
        if policy not in POLICIES or colon and not (budget.isdigit() and int(budget) >= 1):
            raise SystemExit(f"--policies takes a comma list of POLICY or POLICY:BUDGET with POLICY in "
                             f"{POLICIES}, got {spec!r}")
        out.append((policy, int(budget) if colon else None))
    return out


def step_kinds(steps: list[tuple[str, int, float]]) -> dict[str, Any]:
    """Per kind of vocoder call ("first", "fifo", "finish", ...): how many, streams per call and wall
    seconds per call (percentiles)."""
    kinds: dict[str, Any] = {}
    for kind in sorted({k for k, _, _ in steps}):
        mine = [(n, sec) for k, n, sec in steps if k == kind]
        kinds[kind] = {"count": len(mine), "streams": percentiles([float(n) for n, _ in mine]),
                       "seconds": percentiles([sec for _, sec in mine])}
    return kinds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="Serve YAML to take engine/vocoder settings from")
    p.add_argument("--preset", choices=("tiny", "full"), default=None)
    p.add_argument("--random-weights", action="store_true", help="required with --preset full")
    p.add_argument("--checkpoint", default=None, help="checkpoint folder instead of a preset")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--vocoder-preset", choices=("tiny", "full"), default=None)
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--max-num-running", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--concurrency", default="1,8,64")
    p.add_argument("--requests", default=None,
                   help="measured requests per level: N, or one per level (default max(8, 2 x concurrency))")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--policies", default=None,
                   help="comma list of vocoder batching policies to run each level under, back to back; "
                        "POLICY:N also sets the step code budget (default: the config's)")
    p.add_argument("--ramp-s", type=float, default=0.0,
                   help="spread the workers' first requests over this many seconds (0: a burst)")
    p.add_argument("--listen", action="store_true",
                   help="each worker plays its reply in real time before its next request (concurrency = "
                        "listeners), as bench/client.py --listen")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--input", default="Hello there, this is a streaming speech benchmark.")
    text.add_argument("--prompt-tokens", type=int, default=None, help="prompt of exactly this many tokens")
    p.add_argument("--same-prompt", action="store_true", help="with --prompt-tokens: one text for all")
    p.add_argument("--speech-input-s", type=float, default=None,
                   help="speech in: each request a user turn of this many seconds of audio, encoded first; "
                        "each level also runs with a text prompt of as many rows (the baseline)")
    p.add_argument("--speech-encoder", default=None,
                   help="with --speech-input-s: tiny, full or a folder (default: the config's speech_encoder, "
                        "else the vocoder preset)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--fixed-length", action="store_true", help="min_new_tokens = max_new_tokens")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--label", default="")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run, print one JSON line, write --out / --plot; returns the summary."""
    args = parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    requests_per_level(levels, args.requests)  # fail on a bad --requests before building anything
    parse_policies(args.policies)  # fail on a bad --policies before building anything
    if args.speech_input_s is not None and (args.speech_input_s < 1.0 or args.prompt_tokens):
        raise SystemExit("--speech-input-s takes at least 1 (seconds) and excludes --prompt-tokens")
    text = speech_prompt_text(args.prompt_tokens) if args.prompt_tokens else args.input
    summary: dict[str, Any] = {
        "benchmark": "inprocess_speech",
        "command": shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(argv),
        "label": args.label, "mode": "closed", "concurrency_levels": levels, "warmup_per_level": args.warmup,
        "request": {"input_chars": len(text), "prompt_tokens_asked": args.prompt_tokens,
                    "same_prompt": args.same_prompt,
                    "max_new_tokens": args.max_new_tokens, "fixed_length": args.fixed_length,
                    "seed": args.seed, "temperature": args.temperature},
        "complete": False, "levels": [],
    }
    results = asyncio.run(run(args, levels, text, summary))
    summary["complete"] = True
    if args.plot:
        plot_levels(results, args.plot, title=f"{args.label} {summary['command']}"[:160])
        summary["plot"] = args.plot
    line = json.dumps(summary)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")
    return summary


def _device_info(device: str) -> dict[str, Any]:
    import torch

    if not device.startswith("cuda"):
        return {"device_name": "cpu", "torch": torch.__version__}
    return {"device_name": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "max_memory_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30}


if __name__ == "__main__":
    main()
