"""bench/pipeline.py in process on the tiny presets, and the GPU benchmark config it shares with Serve."""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.measure import RequestResult, closed_loop, playback_left_s, requests_per_level, summarize
from bench.pipeline import build, parse_args, settings_from_config
from deployments.app import GpuUnavailableError, check_gpus
from deployments.args import AppArgs
from runtime.engine import EngineConfig

CODES = 6


def test_tiny_pipeline_yields_exactly_the_codes_as_pcm_and_times_them_after_the_engine() -> None:
    args = parse_args(["--preset", "tiny", "--device", "cpu", "--kv-cache-bytes", str(16 * 2**20),
                       "--max-num-running", "4"])

    async def go() -> tuple[list, float]:
        pipeline, settings = build(args)
        assert settings["engine"] == {"model": "tiny", "device": "cpu", "kv_cache_bytes": 16 * 2**20,
                                      "max_num_running": 4}
        assert settings["vocoder"] == {"preset": "tiny", "device": "cpu", "max_batch_size": 32}
        try:
            def make() -> object:
                return pipeline.request("Hi there", max_new_tokens=CODES, min_new_tokens=CODES, seed=1,
                                        temperature=None)
            results, wall_s = await pipeline.closed_loop(make, 2, 3)
        finally:
            await pipeline.batcher.shutdown()
            await pipeline.engine.shutdown()
        return results, wall_s

    results, wall_s = asyncio.run(go())
    assert [(r.status, r.error, r.num_audio_codes) for r in results] == [(200, None, CODES)] * 3
    for r in results:
        assert r.num_samples == CODES * 1920
        # each request lies inside the loop's wall time (a start time added instead of subtracted, on
        # either side, gives durations of twice the clock's reading)
        assert 0 < r.first_codes_s <= r.ttfa_s <= r.e2e_s <= wall_s < 600
        assert len(r.chunk_gaps_s) == r.num_chunks - 1
    summary = summarize(results, 1.0, concurrency=2)
    assert (summary["num_ok"], summary["num_audio_codes_seen"], summary["first_codes_s"]["count"]) == (3, [CODES], 3)


def test_a_failed_vocoder_step_is_a_failed_request_and_frees_what_it_held() -> None:
    """The batcher puts a VocoderStepError on the queues of the streams a failed step carried; the pipeline read
    it as PCM (a TypeError that ended the whole level)."""
    args = parse_args(["--preset", "tiny", "--device", "cpu", "--kv-cache-bytes", str(16 * 2**20),
                       "--max-num-running", "4"])

    async def go() -> tuple[list, int, int, int]:
        pipeline, _ = build(args)
        step, calls = pipeline.batcher.vocoder.step, []

        def third_fails(*a: object, **k: object) -> object:
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected")
            return step(*a, **k)

        pipeline.batcher.vocoder.step = third_fails
        try:
            def make() -> object:
                return pipeline.request("Hi there", max_new_tokens=CODES, min_new_tokens=CODES, seed=1,
                                        temperature=None)
            results, _ = await pipeline.closed_loop(make, 2, 4)
            used = pipeline.engine.stats().num_blocks_used
            return results, used, len(pipeline.engine._streams), pipeline.batcher.num_open_sessions
        finally:
            await pipeline.batcher.shutdown()
            await pipeline.engine.shutdown()

    results, used, tracked, sessions = asyncio.run(go())
    outcomes = [(r.status, r.error) for r in results]
    assert len(outcomes) == 4 and (500, "VocoderStepError: vocoder step failed: RuntimeError('injected')") in outcomes
    assert set(outcomes) <= {(200, None), (500, "VocoderStepError: vocoder step failed: RuntimeError('injected')")}
    assert (used, tracked, sessions) == (0, 0, 0)


def test_closed_loop_ramp_staggers_the_workers_first_requests() -> None:
    """With ramp_s, worker k waits k * ramp_s / workers before its first request (a recorded sleep)."""
    async def go(concurrency: int, num_requests: int, ramp_s: float) -> tuple[list[float], list[str]]:
        waits: list[float] = []
        ids = iter(range(100))

        async def sleep(seconds: float) -> None:
            waits.append(seconds)

        async def run_one() -> RequestResult:
            request_id = f"r{next(ids)}"
            await asyncio.sleep(0)
            return RequestResult(request_id=request_id)

        results, _ = await closed_loop(run_one, concurrency, num_requests, ramp_s, sleep=sleep)
        return waits, sorted(r.request_id for r in results)

    assert asyncio.run(go(4, 10, 2.0)) == ([0.5, 1.0, 1.5], sorted(f"r{i}" for i in range(10)))
    assert asyncio.run(go(4, 10, 0.0))[0] == []
    assert asyncio.run(go(8, 2, 2.0)) == ([1.0], ["r0", "r1"])  # 2 requests: 2 workers


def heard(ttfa_s: float, audio_s: float, stall_s: float, e2e_s: float, ok: bool = True) -> RequestResult:
    return RequestResult(status=200 if ok else 503, error=None if ok else "overloaded", ttfa_s=ttfa_s,
                         num_samples=round(audio_s * 24000), stall_s=stall_s, e2e_s=e2e_s)


def test_playback_left_is_what_a_listener_still_has_to_hear_when_the_response_ends() -> None:
    # playback starts at the first audio (0.1 s), lasts 2 s of audio plus 0.25 s of stalls: ends at 2.35 s
    assert playback_left_s(heard(0.1, 2.0, 0.25, 0.6)) == pytest.approx(1.75)
    assert playback_left_s(heard(0.1, 2.0, 0.0, 3.0)) == 0.0  # the response outlasted its playback
    assert playback_left_s(heard(0.1, 2.0, 0.0, 0.6, ok=False)) == 0.0  # nothing to hear


def test_listening_workers_wait_for_each_reply_to_be_heard_before_the_next_request() -> None:
    async def go(listen: bool) -> list[float]:
        waits: list[float] = []
        replies = iter([heard(0.1, 1.0, 0.2, 0.5), heard(0.1, 1.0, 0.0, 0.3, ok=False), heard(0.2, 2.0, 0.0, 1.0)])

        async def sleep(seconds: float) -> None:
            waits.append(seconds)

        async def run_one() -> RequestResult:
            await asyncio.sleep(0)
            return next(replies)

        results, _ = await closed_loop(run_one, 1, 3, listen=listen, sleep=sleep)
        assert len(results) == 3
        return waits

    # after the first reply 0.1 + 1 + 0.2 - 0.5 s; after the failed one nothing; none after the last
    assert asyncio.run(go(True)) == pytest.approx([0.8, 0.0])
    assert asyncio.run(go(False)) == []


def test_a_listeners_wait_counts_from_the_end_of_the_response() -> None:
    """Work after the response (the client fetching the server's summary) is time the listener already spent
    listening: the next request goes out when the reply has been heard, not that much later."""
    now = [0.0]
    waits: list[float] = []
    replies = iter([heard(0.1, 1.0, 0.0, 0.5), heard(0.1, 1.0, 0.0, 0.5), heard(0.1, 1.0, 0.0, 0.5)])
    spent = iter([0.5, 0.7, 2.0])  # the first: only its response; the others 0.2 s and 1.5 s longer

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        now[0] += seconds

    async def run_one() -> RequestResult:
        now[0] += next(spent)
        return next(replies)

    asyncio.run(closed_loop(run_one, 1, 3, listen=True, sleep=sleep, clock=lambda: now[0]))
    assert waits == pytest.approx([0.6, 0.4])  # 0.1 + 1.0 - 0.5 s left of each reply, less the extra 0 / 0.2 s


def test_requests_per_level_accepts_one_count_or_one_per_level() -> None:
    assert requests_per_level([1, 8, 64], None) == [8, 16, 128]
    assert requests_per_level([1, 4], "5") == [5, 5]
    assert requests_per_level([1, 8], "4,16") == [4, 16]
    with pytest.raises(ValueError, match="one per level"):
        requests_per_level([1, 8, 64], "4,16")
    # 8 requests at 64 ran 8 workers under the label 64
    with pytest.raises(ValueError, match="^--requests '8': concurrency 64 needs at least 64 requests, got 8$"):
        requests_per_level([1, 64], "8")


def test_h200_config_is_valid_fits_one_gpu_and_feeds_the_pipeline_the_same_settings() -> None:
    path = REPO / "config" / "serve-h200.yaml"
    app_args = AppArgs.model_validate(yaml.safe_load(path.read_text())["applications"][0]["args"])
    EngineConfig(**app_args.engine)
    check_gpus(app_args, gpus_available=1.0)
    with pytest.raises(GpuUnavailableError):
        check_gpus(app_args, gpus_available=0.0)
    engine, vocoder = settings_from_config(str(path))
    assert engine == app_args.engine and engine["model"] == "full" and engine["device"] == "cuda"
    # the first-audio hold starts at the code before the last one the light-load first chunk needs (its codes
    # + 3 of lookahead): with asynchronous steps that last code is already on the GPU then
    first_chunk_codes = app_args.vocoder_light_load_schedule_codes[0] + 3
    assert (engine["first_audio_hold_codes"], engine["first_audio_hold_s"]) == (first_chunk_codes - 1, 0.03)
    assert vocoder == {"preset": "full", "device": "cuda", "dtype": "bfloat16", "seed": 0, "max_batch_size": 128,
                       "cuda_graphs": True, "triton_kernels": True, "bucket_shapes": True,
                       "warmup_rows": [1, 2, 4, 8, 16, 32, 48, 64], "reserved_sessions": 1024,
                       "chunk_schedule_codes": [4, 5, 10, 25], "light_load_schedule_codes": [2, 3, 5, 10, 25],
                       "urgent_buffer_s": 0.5, "batching": "deadline",
                       "step_code_budget": 512, "fast_lane_code_budget": 32, "background_yield": "newcomer"}


def test_pipeline_passes_ramp_and_listen_to_the_closed_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.pipeline as pipeline_module

    seen: list[tuple] = []

    async def fake_closed_loop(run_one: object, concurrency: int, num_requests: int, ramp_s: float,
                               listen: bool) -> tuple[list, float]:
        seen.append((concurrency, num_requests, ramp_s, listen))
        return [], 1.0

    monkeypatch.setattr(pipeline_module, "closed_loop", fake_closed_loop)
    pipeline = object.__new__(pipeline_module.Pipeline)  # only the wiring: no engine, no vocoder
    asyncio.run(pipeline.closed_loop(lambda: None, 64, 192, 8.5, True))
    asyncio.run(pipeline.closed_loop(lambda: None, 1, 6))
    assert seen == [(64, 192, 8.5, True), (1, 6, 0.0, False)]
    assert parse_args(["--listen"]).listen and not parse_args([]).listen



def test_speech_input_runs_each_level_encoded_first_then_as_text_of_the_same_prompt_length(
        tmp_path: Path) -> None:
    from bench.pipeline import main, text_question

    out = tmp_path / "speech.json"
    summary = main(["--preset", "tiny", "--device", "cpu", "--kv-cache-bytes", str(16 * 2**20),
                    "--speech-input-s", "1.5", "--concurrency", "1,2", "--requests", "2", "--warmup", "0",
                    "--max-new-tokens", str(CODES), "--fixed-length", "--out", str(out)])
    assert summary["settings"]["speech_encoder"]["spec"] == "tiny"  # no config: the vocoder's preset
    assert summary["request"]["speech_input"] == {"seconds": 1.5, "samples": 24000, "codes": 19}
    levels = summary["levels"]
    assert [(level["concurrency"], level["prompt_input"]) for level in levels] == [
        (1, "speech"), (1, "text"), (2, "speech"), (2, "text")]
    for level in levels:
        assert (level["num_ok"], level["num_audio_codes_seen"]) == (2, [CODES])
        # a user turn of 19 codes is 19 + 2 rows of audio between its header and the generation prefix
        assert level["num_prompt_tokens_seen"] == [41]
        encodes = level["vocoder_step_kinds"].get("encode", {}).get("count", 0)
        assert encodes == (2 if level["prompt_input"] == "speech" else 0)
        # this level's steps, not the process's running total
        assert level["vocoder_steps"] == sum(kind["count"] for name, kind in level["vocoder_step_kinds"].items()
                                             if name != "encode")
        assert level["engine_preemptions"] == 0
        assert level["first_codes_s"]["count"] == 2
    # the text in the audio's place: one byte-level token per character for the segment's 19 + 2 rows
    assert text_question(19, 5) == "5000000 The quick bro"
    assert json.loads(out.read_text())["complete"] is True


def test_speech_input_needs_at_least_a_second_and_no_prompt_tokens() -> None:
    from bench.pipeline import main

    for argv in (["--speech-input-s", "0.5"], ["--speech-input-s", "2", "--prompt-tokens", "200"]):
        with pytest.raises(SystemExit, match="--speech-input-s takes at least 1"):
            main(argv)
