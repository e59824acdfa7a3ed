"""Engine acceptance tests on a tiny model (CPU): the paged, batched, chunked, preempting engine must
produce exactly the rows of a plain reference loop (whole-sequence forward + the same RequestSampler)."""
from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import re
import threading
import time
from collections import Counter

import pytest
import torch

import runtime.engine as engine_module
from runtime.config import (
    AUDIO_PAD_ID,
    EOSP_ID,
    IM_END_ID,
    IM_START_ID,
    MODALITY_PAD_ID,
    SOSP_ID,
    ModelConfig,
    Row,
)
from runtime.engine import (
    BROKEN_LOGITS_MESSAGE,
    Engine,
    EngineConfig,
    EngineCore,
    EngineStats,
    default_seed,
    num_kv_blocks,
)
from runtime.errors import (
    ContextLengthExceededError,
    EngineOverloadedError,
    EngineUnhealthyError,
    InvalidRequestError,
    is_device_error,
)
from runtime.kv_cache import FP8_KV_DTYPE, kv_bytes_per_block
from runtime.model import MossSpeechForCausalLM, build_model
from runtime.model_runner import ModelInput, RowFeed
from runtime.request import AudioCodes, Event, Finished, GenerationRequest, TextDelta, Timeline
from runtime.sampling import LaunchedRows, RequestSampler, SamplingParams, is_stop_row, sample_next_rows
from runtime.sequence import PENDING_ROW, IncrementalDetokenizer, Sequence
from runtime.tokenizer import Tokenizer

CONFIG = dataclasses.replace(ModelConfig.preset("tiny"), num_shared_layers=2, num_modality_layers=1)
GREEDY = SamplingParams(temperature=0.0)  # repetition penalty stays at the default 1.1
HOT = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
ASYNC_STEPS = [False, True]  # EngineCore's steps as written, and launched one ahead (async_scheduling)


@pytest.fixture(scope="module")
def model() -> MossSpeechForCausalLM:
    return build_model(CONFIG, seed=0)


def engine_config(num_blocks: int = 256, block_size: int = 4, **overrides: object) -> EngineConfig:
    kv_bytes = num_blocks * kv_bytes_per_block(CONFIG, block_size, torch.float32)
    return EngineConfig(block_size=block_size, kv_cache_bytes=kv_bytes, **overrides)  # type: ignore[arg-type]


def prompt(rng: random.Random, length: int, audio_out: bool) -> tuple[Row, ...]:
    """IM_START, random byte tokens, and for audio output a final [SOSP, AUDIO_PAD] row."""
    rows = [(IM_START_ID, AUDIO_PAD_ID)] + [(rng.randrange(256), AUDIO_PAD_ID) for _ in range(length - 1)]
    if audio_out:
        rows[-1] = (SOSP_ID, AUDIO_PAD_ID)
    return tuple(rows)


_REFERENCE: dict[tuple[MossSpeechForCausalLM, GenerationRequest], tuple[list[Row], RequestSampler]] = {}


def reference_rows(model: MossSpeechForCausalLM, request: GenerationRequest) -> tuple[list[Row], RequestSampler]:
    """No cache, no batching: full forward over all rows so far, sample the last position (memoised)."""
    key = (model, request)  # the dict keeps the model alive, so its identity is never reused
    if key not in _REFERENCE:
        _REFERENCE[key] = _reference_rows(model, request)
    return _REFERENCE[key]


def _reference_rows(model: MossSpeechForCausalLM, request: GenerationRequest) -> tuple[list[Row], RequestSampler]:
    seed = default_seed(request.request_id) if request.seed is None else request.seed
    sampler = RequestSampler(
        request.prompt_rows, request.text_sampling, request.audio_sampling,
        min_new_tokens=request.min_new_tokens, seed=seed,
    )
    rows = list(request.prompt_rows)
    for _ in range(request.max_new_tokens):
        text_logits, audio_logits = model.reference_forward(rows)  # [T, Vt], [T, Va]
        row = sample_next_rows(text_logits[-1:], audio_logits[-1:], [sampler])[0]
        rows.append(row)
        if is_stop_row(row):
            break
    return rows[len(request.prompt_rows) :], sampler


def run_core(core: EngineCore, arrivals: dict[int, list[GenerationRequest]]) -> tuple[dict[str, Sequence], dict[str, list[Event]]]:
    """Step the core to completion, adding arrivals[k] before step k."""
    seqs: dict[str, Sequence] = {}
    events: dict[str, list[Event]] = {}
    step = 0
    while core.has_work or any(k >= step for k in arrivals):
        for request in arrivals.get(step, []):
            seqs[request.request_id] = core.add_request(request)
        for request_id, event in core.step():
            events.setdefault(request_id, []).append(event)
        step += 1
        assert step < 10_000
    return seqs, events


def generated(seq: Sequence) -> list[Row]:
    return seq.rows[seq.num_prompt_rows :]


def check_events(events: list[Event], sampler: RequestSampler, seq: Sequence, reason: str) -> None:
    """Audio events carry exactly the sampler's output codes; the stream ends with one Finished."""
    codes = [c for e in events if isinstance(e, AudioCodes) for c in e.codes]
    assert codes == list(sampler.audio_codes)
    assert events[-1] == Finished(
        reason=reason, num_prompt_tokens=seq.num_prompt_rows, num_generated_tokens=seq.num_generated,  # type: ignore[arg-type]
        num_audio_codes=len(codes), num_cached_prompt_tokens=seq.num_cached_tokens,
    )
    assert sum(isinstance(e, Finished) for e in events) == 1


@pytest.mark.parametrize("async_steps", ASYNC_STEPS)
@pytest.mark.parametrize("audio_out", [True, False])
def test_single_request_greedy_matches_reference(model: MossSpeechForCausalLM, audio_out: bool, async_steps: bool) -> None:
    request = GenerationRequest("r", prompt(random.Random(1), 11, audio_out), GREEDY, GREEDY, max_new_tokens=9)
    core = EngineCore(model, Tokenizer.tiny(), engine_config(async_scheduling=async_steps))
    seqs, events = run_core(core, {0: [request]})
    ref, sampler = reference_rows(model, request)
    assert generated(seqs["r"]) == ref
    check_events(events["r"], sampler, seqs["r"], "stop" if is_stop_row(ref[-1]) else "length")
    assert (len(sampler.audio_codes) > 0) == audio_out


@pytest.mark.parametrize("async_steps", ASYNC_STEPS)
def test_finished_carries_the_timeline_of_arrival_first_step_and_first_codes(
        model: MossSpeechForCausalLM, async_steps: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    step = [0]
    monkeypatch.setattr(time, "time", lambda: float(step[0]))  # the wall clock reads the step number
    monkeypatch.setattr(engine_module, "TIMELINE_CODES", 4)
    rng = random.Random(12)
    a, b = (GenerationRequest(rid, prompt(rng, 9, audio_out=True), GREEDY, GREEDY, max_new_tokens=6,
                              min_new_tokens=6) for rid in "ab")
    # one running request at a time: b, arriving at step 2, waits in the queue until a has finished
    core = EngineCore(model, Tokenizer.tiny(), engine_config(async_scheduling=async_steps, max_num_running=1))
    events: list[tuple[str, Event]] = []
    finished_at: dict[str, int] = {}
    while step[0] == 0 or core.has_work:
        if step[0] in (0, 2):
            core.add_request(a if step[0] == 0 else b)
        for rid, event in core.step():
            events.append((rid, event))
            if isinstance(event, Finished):
                finished_at[rid] = step[0]
        step[0] += 1
    finished = {rid: e for rid, e in events if isinstance(e, Finished)}
    lag = 1 if async_steps else 0  # asynchronous steps read a step's rows one step later
    assert finished["a"].num_audio_codes == finished["b"].num_audio_codes == 6
    assert finished["a"].timeline == Timeline(0.0, 0.0, tuple(float(k + lag) for k in range(4)))
    # a's sixth code comes at step 5 (+ lag), freeing the slot; b is scheduled in the next step
    assert finished_at["a"] == 5 + lag
    first_b = finished_at["a"] + 1
    assert finished["b"].timeline == Timeline(2.0, float(first_b), tuple(float(first_b + k + lag) for k in range(4)))


@pytest.mark.parametrize("async_steps", ASYNC_STEPS)
def test_eight_staggered_requests_match_reference(model: MossSpeechForCausalLM, async_steps: bool) -> None:
    rng = random.Random(2)
    requests = [
        GenerationRequest(f"r{i}", prompt(rng, rng.randrange(3, 18), audio_out=i % 2 == 0), GREEDY, GREEDY,
                          max_new_tokens=rng.randrange(3, 8))
        for i in range(8)
    ]
    arrivals = {0: requests[:2], 1: requests[2:3], 3: requests[3:5], 4: requests[5:6], 7: requests[6:]}
    # A 10-row budget forces chunked prefills to share steps with decodes.
    core = EngineCore(model, Tokenizer.tiny(), engine_config(max_num_batched_tokens=10, async_scheduling=async_steps))
    seqs, events = run_core(core, arrivals)
    for request in requests:
        ref, sampler = reference_rows(model, request)
        seq = seqs[request.request_id]
        assert generated(seq) == ref, request.request_id
        check_events(events[request.request_id], sampler, seq, "stop" if is_stop_row(ref[-1]) else "length")
    assert core.stats().num_blocks_used == 0


@pytest.mark.parametrize("async_steps", ASYNC_STEPS)
def test_fast_path_matches_reference(async_steps: bool) -> None:
    plain = build_model(CONFIG, seed=0)
    fused = build_model(CONFIG, seed=0)  # fusing rewrites the model's parameters as views
    rng = random.Random(13)
    requests = [
        GenerationRequest(f"f{i}", prompt(rng, 4 + 5 * i, audio_out=i != 1), GREEDY, GREEDY, max_new_tokens=5)
        for i in range(3)
    ]
    core = EngineCore(fused, Tokenizer.tiny(), engine_config(fast_path=True, max_num_running=2,
                                                             max_num_batched_tokens=8, async_scheduling=async_steps))
    seqs, _ = run_core(core, {0: requests[:2], 2: requests[2:]})
    for request in requests:
        assert generated(seqs[request.request_id]) == reference_rows(plain, request)[0]
    paths = core.runner.num_steps_by_path
    assert paths["graph"] > 0 and paths["fast"] > 0 and paths["plain"] == 0
    log = list(core.step_log)  # one record per model step, in order
    assert Counter(r.path for r in log) == paths
    # every prompt row and every generated row but the last is computed exactly once (no preemption)
    assert sum(r.num_rows for r in log) == sum(len(r.prompt_rows) + 5 - 1 for r in requests)
    assert all(min(r.schedule_s, r.prepare_s, r.forward_s, r.sample_s, r.record_s) >= 0 for r in log)
    assert [r.num_decode_seqs for r in log if r.path == "graph"] == [r.num_seqs for r in log if r.path == "graph"]


def test_fp8_kv_cache_holds_more_blocks_and_the_fast_path_generates_the_plain_paths_rows() -> None:
    """kv_cache_dtype="fp8": the same byte budget holds 64 / 20 as many blocks (tiny: 16 float32 values per
    head against 16 one-byte codes and a 4-byte scale), and greedy rows of the fast path equal the plain
    path's on FP8 caches (both quantize once, the same way)."""
    rng = random.Random(13)
    requests = [GenerationRequest(f"q{i}", prompt(rng, 4 + 5 * i, audio_out=i != 1), GREEDY, GREEDY,
                                  max_new_tokens=6) for i in range(3)]
    per_block = kv_bytes_per_block(CONFIG, 4, torch.float32)
    assert kv_bytes_per_block(CONFIG, 4, FP8_KV_DTYPE) * 64 == per_block * 20
    rows = {}
    for fast in (False, True):
        config = EngineConfig(block_size=4, kv_cache_bytes=100 * per_block, kv_cache_dtype="fp8", fast_path=fast,
                              max_num_running=2, max_num_batched_tokens=8)
        assert config.kv_dtype == FP8_KV_DTYPE and num_kv_blocks(config, CONFIG) == 320
        core = EngineCore(build_model(CONFIG, seed=0), Tokenizer.tiny(), config)
        assert core.runner.kv_cache.k.dtype == FP8_KV_DTYPE and core.stats().num_blocks_total == 320
        seqs, _ = run_core(core, {0: requests[:2], 2: requests[2:]})
        rows[fast] = [generated(seqs[r.request_id]) for r in requests]
        assert core.stats().num_blocks_used == 0
    assert rows[True] == rows[False] and all(len(r) == 6 for r in rows[True])
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp16")


@pytest.mark.parametrize("fast_path", [False, True])
def test_the_start_up_largest_step_runs_and_changes_no_row(fast_path: bool) -> None:
    """check_largest_step: the start-up step (max_num_batched_tokens 12 rows over min(3, 12 // 2) = 3
    sequences) leaves no block used, no step counted, and the rows of every later request as without it."""
    plain = build_model(CONFIG, seed=0)
    rng = random.Random(17)
    requests = [GenerationRequest(f"l{i}", prompt(rng, 5 + 3 * i, audio_out=i != 0), GREEDY, GREEDY,
                                  max_new_tokens=5) for i in range(3)]
    core = EngineCore(build_model(CONFIG, seed=0), Tokenizer.tiny(),
                      engine_config(num_blocks=8, fast_path=fast_path, max_num_running=3,
                                    max_num_batched_tokens=12, check_largest_step=True))
    assert core.largest_step == engine_module.LargestStep(num_rows=12, num_seqs=3, free_reserved_bytes=None)
    assert core.stats().num_blocks_used == 0 and not core.runner.num_steps_by_path
    seqs, _ = run_core(core, {0: requests})
    for request in requests:
        assert generated(seqs[request.request_id]) == reference_rows(plain, request)[0]
    off = EngineCore(build_model(CONFIG, seed=0), Tokenizer.tiny(), engine_config(check_largest_step=None))
    assert off.largest_step is None  # on CPU the default does not run it
    # one sequence can hold at most max_model_len rows: the budget's 128 rows were one sequence of 128 over a
    # block table of 64 tokens (on CUDA the prefill graphs refused it, and the engine did not start)
    short = EngineCore(build_model(CONFIG, seed=0), Tokenizer.tiny(),
                       engine_config(num_blocks=40, fast_path=fast_path, max_num_running=1, max_model_len=64,
                                     max_num_batched_tokens=128, check_largest_step=True))
    assert short.largest_step == engine_module.LargestStep(num_rows=64, num_seqs=1, free_reserved_bytes=None)


def test_warmed_step_shapes_run_off_the_graphs_within_the_settings_and_change_no_row(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """warm_step_shapes: every shape fits the settings (here 32 sequences, 512 rows, 4096-token model length,
    decode graphs up to 32 rows: max_num_running) and takes the eager fast path, which is what it warms, with
    each sequence's context in front of its new rows; the rows of later requests are those of the plain model,
    and no step count is left behind."""
    plain = build_model(CONFIG, seed=0)
    rng = random.Random(23)
    requests = [GenerationRequest(f"w{i}", prompt(rng, 4 + 5 * i, audio_out=i != 1), GREEDY, GREEDY,
                                  max_new_tokens=4) for i in range(3)]
    seen = []  # (query lens, seq lens, positions, block table widths) of every forward
    forward = engine_module.ModelRunner.forward

    def recording(self: engine_module.ModelRunner, inp: engine_module.ModelInput, *args: object) -> object:
        attn = inp.attn
        seen.append((list(attn.query_lens), list(attn.seq_lens), inp.positions.tolist(),
                     [len(t) for t in attn.block_tables]))
        return forward(self, inp, *args)

    monkeypatch.setattr(engine_module.ModelRunner, "forward", recording)
    core = EngineCore(build_model(CONFIG, seed=0), Tokenizer.tiny(),
                      engine_config(num_blocks=64, fast_path=True, max_num_running=32, max_num_batched_tokens=512,
                                    max_model_len=4096, warm_step_shapes=True))
    shapes = [(sum(q), len(q), path) for q, _, path in core.warmed_shapes]
    assert shapes == [(3, 2, "fast"), (6, 3, "fast"), (16, 15, "fast"), (24, 2, "fast"), (32, 16, "fast"),
                      (40, 8, "fast"), (64, 2, "fast"), (64, 32, "fast"), (200, 4, "fast"), (256, 16, "fast")]
    assert len(seen) == len(shapes)  # one forward each (check_largest_step is off on CPU)
    # M 40: 8 sequences of 5 new rows after 80 cached tokens (block size 4: 85 tokens take 22 blocks)
    assert seen[5] == ([5] * 8, [85] * 8, [80, 81, 82, 83, 84] * 8, [22] * 8)
    # M 200: three decode rows after 16 tokens, then 197 new rows after 100
    assert seen[8] == ([1, 1, 1, 197], [17, 17, 17, 297], [16, 16, 16, *range(100, 297)], [5, 5, 5, 75])
    assert not core.runner.num_steps_by_path
    seqs, _ = run_core(core, {0: requests})
    for request in requests:
        assert generated(seqs[request.request_id]) == reference_rows(plain, request)[0]
    # 8 sequences, 64 rows, model length 100, graphs up to 4 rows: decode steps of 5 rows run eagerly (16
    # exceed 8 sequences); 1 + 63 rows after 40 tokens of context exceed the model length
    small = engine_module.step_shapes(engine_config(max_num_running=8, max_num_batched_tokens=64,
                                                    max_model_len=100), 4)
    assert [(sum(q), len(q)) for q, _ in small] == [(3, 2), (6, 3), (24, 2), (40, 8), (5, 5)]
    assert small[-1] == ((1,) * 5, (16,) * 5) and small[3] == ((5,) * 8, (80,) * 8)
    # graphs up to 15 rows: 16 decode rows are both the first above them and a multiple of 16, warmed once
    above = [q for q, _ in engine_module.step_shapes(engine_config(max_num_running=40), 15) if set(q) == {1}]
    assert above == [(1,) * 16]
    assert EngineCore(build_model(CONFIG, seed=0), Tokenizer.tiny(), engine_config()).warmed_shapes == []  # CPU
    for query_lens, context_lens in (((2, 0), None), ((2, 3), (4,)), ((2, 3), (0, -1))):
        with pytest.raises(ValueError, match="one context length >= 0 per query length >= 1"):
            core.runner.run_step_shape(query_lens, context_lens)


def test_a_warm_up_step_out_of_memory_stops_the_engine_naming_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    def out_of_memory(self: object, query_lens: tuple[int, ...], context_lens: tuple[int, ...]) -> str:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")

    monkeypatch.setattr(engine_module.ModelRunner, "run_step_shape", out_of_memory)
    config = engine_config(fast_path=True, warm_step_shapes=True)
    with pytest.raises(engine_module.EngineMemoryError, match=r"start-up step of 3 rows over 2 sequences "
                       r"\(warm_step_shapes\) does not fit .* or set warm_step_shapes false \(CUDA out of memory"):
        EngineCore(build_model(CONFIG, seed=0), Tokenizer.tiny(), config)


def test_a_largest_step_out_of_memory_stops_the_engine_naming_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    def out_of_memory(self: object, num_rows: int, num_seqs: int) -> None:
        assert (num_rows, num_seqs) == (64, 24)  # max_num_batched_tokens; min(max_num_running, 64 // 2)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.00 MiB.")

    monkeypatch.setattr(engine_module.ModelRunner, "run_largest_step", out_of_memory)
    config = engine_config(max_num_running=24, max_num_batched_tokens=64, check_largest_step=True)
    with pytest.raises(engine_module.EngineMemoryError, match=r"\(64 rows, max_num_batched_tokens, over 24 "
                       r"sequences\) does not fit .* lower max_num_batched_tokens or kv_cache_bytes, or raise "
                       r"memory_cap_bytes \(CUDA out of memory\. Tried to allocate 24\.00 MiB\.\)"):
        EngineCore(build_model(CONFIG, seed=0), Tokenizer.tiny(), config)


def test_audio_only_steps_skip_the_text_head_and_change_no_row() -> None:
    """A text-output request beside audio-output ones: while it runs, every step computes the text logits;
    after it ends (max_new_tokens 2), the audio-mode rows alone skip them. Rows and events are those of the
    engine that never skips, and those of the reference."""
    rng = random.Random(21)
    requests = [GenerationRequest("text", prompt(rng, 6, audio_out=False), HOT, HOT, max_new_tokens=2),
                GenerationRequest("a1", prompt(rng, 5, audio_out=True), HOT, HOT, max_new_tokens=7),
                GenerationRequest("a2", prompt(rng, 9, audio_out=True), HOT, HOT, max_new_tokens=7)]
    results = {}
    for audio_only in (True, False):
        core = EngineCore(build_model(CONFIG, seed=0), Tokenizer.tiny(),
                          engine_config(fast_path=True, audio_only_steps=audio_only))
        results[audio_only] = (*run_core(core, {0: requests}), core.runner)
    (seqs, events, runner), (seqs_whole, events_whole, runner_whole) = results[True], results[False]
    reference = build_model(CONFIG, seed=0)
    for request in requests:
        assert generated(seqs[request.request_id]) == reference_rows(reference, request)[0], request.request_id
    assert {k: generated(v) for k, v in seqs.items()} == {k: generated(v) for k, v in seqs_whole.items()}
    assert events == events_whole
    assert [r[0] for r in generated(seqs["text"])] != [MODALITY_PAD_ID] * 2  # it did sample text
    # one prefill step (all three prompts fit), one decode step beside "text", then 5 audio-only decode steps
    assert runner.num_steps_by_path == runner_whole.num_steps_by_path == Counter(fast=1, graph=6)
    assert runner.num_audio_only_steps == 5 and runner_whole.num_audio_only_steps == 0


def test_bfloat16_logits_sample_the_rows_of_their_float32_widening(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 engine's multi-row steps hand the sampler bf16 logits (runtime/fast_forward.py `float_logits`):
    a text request beside two speech requests, sampled hot, gets the rows and events of the engine whose steps
    widen the logits to float32 themselves."""
    import functools

    from runtime import fast_forward

    rng = random.Random(31)
    requests = [GenerationRequest("text", prompt(rng, 6, audio_out=False), HOT, HOT, max_new_tokens=4),
                GenerationRequest("a1", prompt(rng, 5, audio_out=True), HOT, HOT, max_new_tokens=7),
                GenerationRequest("a2", prompt(rng, 9, audio_out=True), HOT, HOT, max_new_tokens=7)]
    results = []
    for float_logits in (False, True):
        if float_logits:
            monkeypatch.setattr(fast_forward, "FastForward",
                                functools.partial(fast_forward.FastForward, float_logits=True))
        core = EngineCore(build_model(CONFIG, seed=0, dtype=torch.bfloat16), Tokenizer.tiny(),
                          engine_config(fast_path=True, dtype="bfloat16"))
        seqs, events = run_core(core, {0: requests})
        assert core.runner.fast.float_logits is float_logits
        assert core.runner.num_steps_by_path["graph"] >= 6  # decode steps of 2-3 rows
        results.append(({k: generated(v) for k, v in seqs.items()}, events))
    assert results[0] == results[1]
    assert [r[0] for r in results[0][0]["text"]] != [MODALITY_PAD_ID] * 4  # it did sample text


@pytest.mark.parametrize("async_steps", ASYNC_STEPS)
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_and_recompute_keep_outputs(
    model: MossSpeechForCausalLM, prefix_caching: bool, async_steps: bool
) -> None:
    rng = random.Random(3)
    requests = [
        GenerationRequest(f"p{i}", prompt(rng, 6 + i, audio_out=i != 1), GREEDY, GREEDY, max_new_tokens=8)
        for i in range(3)
    ]
    # 3 requests of 14..16 rows need 12 blocks of 4 rows; the pool has 6.
    core = EngineCore(model, Tokenizer.tiny(), engine_config(num_blocks=6, enable_prefix_caching=prefix_caching,
                                                             async_scheduling=async_steps))
    seqs, _ = run_core(core, {0: requests})
    assert core.stats().num_preemptions > 0
    assert max(s.num_admissions for s in seqs.values()) > 1
    for request in requests:
        assert generated(seqs[request.request_id]) == reference_rows(model, request)[0]
    assert core.stats().num_blocks_used == 0
    assert all(b.ref_count == 0 for b in core.block_manager.blocks)
    # the prefix cache counts prompts looked up at their first admission, not a preempted one's recompute
    assert core.stats().prefix_cache_queries == sum(len(r.prompt_rows) for r in requests)


@pytest.mark.parametrize("async_steps", ASYNC_STEPS)
def test_prefix_cache_hits_are_counted_and_do_not_change_outputs(model: MossSpeechForCausalLM, async_steps: bool) -> None:
    rng = random.Random(4)
    shared = prompt(rng, 10, audio_out=False)
    first = GenerationRequest("a", shared + ((1, 512), (2, 512), (SOSP_ID, 512)), GREEDY, GREEDY, max_new_tokens=3)
    second = GenerationRequest("b", shared + ((3, 512), (SOSP_ID, 512)), GREEDY, GREEDY, max_new_tokens=3)
    same = GenerationRequest("c", first.prompt_rows, GREEDY, GREEDY, max_new_tokens=3)
    core = EngineCore(model, Tokenizer.tiny(), engine_config(block_size=4, async_scheduling=async_steps))
    # a runs first (13 rows: 3 full blocks cached); b shares 2 full blocks = 8 rows; c repeats a's
    # prompt: 3 blocks = 12 rows (the last prompt row is always computed).
    seqs, events = run_core(core, {0: [first], 30: [second], 60: [same]})
    stats = core.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (13 + 12 + 13, 0 + 8 + 12)
    assert [seqs[k].num_cached_tokens for k in "abc"] == [0, 8, 12]
    assert events["b"][-1].num_cached_prompt_tokens == 8  # type: ignore[union-attr]
    for request in (first, second, same):
        assert generated(seqs[request.request_id]) == reference_rows(model, request)[0]


@pytest.mark.parametrize("async_steps", ASYNC_STEPS)
def test_seeded_sampling_is_the_same_alone_and_interleaved(model: MossSpeechForCausalLM, async_steps: bool) -> None:
    rng = random.Random(5)
    requests = [
        GenerationRequest(f"s{i}", prompt(rng, 5 + 3 * i, audio_out=i % 2 == 1), HOT, HOT, max_new_tokens=5,
                          seed=None if i == 0 else 1000 + i)
        for i in range(3)
    ]
    alone = {}
    for request in requests:
        seqs, _ = run_core(EngineCore(model, Tokenizer.tiny(), engine_config()), {0: [request]})
        alone[request.request_id] = generated(seqs[request.request_id])
    core = EngineCore(model, Tokenizer.tiny(), engine_config(max_num_batched_tokens=12, async_scheduling=async_steps))
    together, _ = run_core(core, {0: requests[:2], 2: requests[2:]})
    for request in requests:
        assert generated(together[request.request_id]) == alone[request.request_id]
    for request in requests[:2]:  # and both equal the reference loop with the same seed
        assert alone[request.request_id] == reference_rows(model, request)[0]
    # Different seeds really give different samples (so the equality above is not vacuous).
    assert len({tuple(r) for r in alone.values()}) == 3


def test_text_stream_is_the_detokenized_text_channel(model: MossSpeechForCausalLM) -> None:
    # Make the text head favour byte tokens so that text is actually produced.
    rigged = build_model(CONFIG, seed=0)
    with torch.no_grad():
        rigged.text_lm_head.weight[256:] = 0.0
        rigged.text_lm_head.weight[:256] *= 20.0
    tokenizer = Tokenizer.tiny()
    request = GenerationRequest("t", prompt(random.Random(6), 6, audio_out=False), GREEDY, GREEDY, max_new_tokens=16)
    seqs, events = run_core(EngineCore(rigged, tokenizer, engine_config()), {0: [request]})
    text_ids = [row[0] for row in generated(seqs["t"])]
    assert all(t < 256 for t in text_ids)
    deltas = [e.text for e in events["t"] if isinstance(e, TextDelta)]
    assert "".join(deltas) == tokenizer.decode(text_ids, skip_special_tokens=True) != ""


def test_detokenizer_never_splits_a_character() -> None:
    tokenizer = Tokenizer.tiny()
    text = "añ€😀b"
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(t) for t in tokenizer.encode(text)]
    assert deltas == ["a", "", "ñ", "", "", "€", "", "", "", "😀", "b"]
    assert detok.flush() == ""


@pytest.mark.parametrize("async_steps", ASYNC_STEPS)
def test_a_request_whose_kv_fills_the_whole_pool_exactly_runs_to_its_end(
        model: MossSpeechForCausalLM, async_steps: bool) -> None:
    """5 prompt rows + 4 generated: K/V for 8 rows (the last row is never fed back), so a pool of two 4-row
    blocks holds it; admission refused it as needing 3 blocks."""
    request = GenerationRequest("r", prompt(random.Random(0), 5, audio_out=True), GREEDY, GREEDY,
                                max_new_tokens=4, min_new_tokens=4)
    core = EngineCore(model, Tokenizer.tiny(), engine_config(num_blocks=2, block_size=4,
                                                             async_scheduling=async_steps))
    seqs, events = run_core(core, {0: [request]})
    ref, sampler = reference_rows(model, request)
    assert generated(seqs["r"]) == ref and len(ref) == 4
    check_events(events["r"], sampler, seqs["r"], "length")
    assert core.stats().num_blocks_used == 0 and core.scheduler.num_preemptions == 0


def test_typed_errors_at_admission(model: MossSpeechForCausalLM) -> None:
    core = EngineCore(model, Tokenizer.tiny(), engine_config(num_blocks=8, max_model_len=64, max_num_waiting=1))
    rows = prompt(random.Random(7), 10, audio_out=True)
    with pytest.raises(ContextLengthExceededError, match="max_model_len"):
        core.add_request(GenerationRequest("a", rows, max_new_tokens=60))
    with pytest.raises(ContextLengthExceededError, match="whole cache holds 8 blocks"):
        core.add_request(GenerationRequest("a", rows, max_new_tokens=30))
    with pytest.raises(InvalidRequestError, match="prompt row 1"):
        core.add_request(GenerationRequest("a", ((1, 512), (1, 20000))))
    with pytest.raises(InvalidRequestError, match="temperature"):
        core.add_request(GenerationRequest("a", rows, SamplingParams(temperature=-1.0), max_new_tokens=4))
    with pytest.raises(InvalidRequestError, match="^text_sampling must be a SamplingParams, got NoneType$"):
        core.add_request(GenerationRequest("a", rows, None, max_new_tokens=4))
    with pytest.raises(InvalidRequestError, match="^audio_sampling must be a SamplingParams, got dict$"):
        core.add_request(GenerationRequest("a", rows, audio_sampling={"top_k": 5}, max_new_tokens=4))
    core.add_request(GenerationRequest("a", rows, max_new_tokens=4))
    with pytest.raises(InvalidRequestError, match="already in flight"):
        core.add_request(GenerationRequest("a", rows, max_new_tokens=4))
    with pytest.raises(EngineOverloadedError) as info:
        core.add_request(GenerationRequest("b", rows, max_new_tokens=4))
    assert info.value.retry_after_s > 0
    assert core.stats().num_waiting == 1


def test_queue_timeout_ends_a_waiting_request(model: MossSpeechForCausalLM) -> None:
    core = EngineCore(model, Tokenizer.tiny(), engine_config(max_num_running=1, queue_timeout_s=10.0))
    now = [0.0]
    core.scheduler.clock = lambda: now[0]
    rows = prompt(random.Random(11), 5, audio_out=True)
    core.add_request(GenerationRequest("a", rows, GREEDY, GREEDY, max_new_tokens=3))
    core.add_request(GenerationRequest("b", rows, GREEDY, GREEDY, max_new_tokens=3))
    core.step()  # a runs, b waits (max_num_running=1)
    now[0] = 10.5
    events = core.step()
    assert ("b", Finished("error", 5, 0, 0, 0, "request waited more than 10 s in the queue")) in events
    assert core.stats().num_waiting == 0 and core.stats().num_running == 1


def test_queue_timeout_spares_a_preempted_request_that_has_streamed(model: MossSpeechForCausalLM) -> None:
    """The timeout is for requests that never started: a preempted one, back at the head of the queue after
    streaming codes, runs to its end however long the steps take."""
    rng = random.Random(3)
    requests = [GenerationRequest(name, prompt(rng, 6, audio_out=True), GREEDY, GREEDY, max_new_tokens=24,
                                  min_new_tokens=24) for name in "ab"]
    core = EngineCore(model, Tokenizer.tiny(), engine_config(num_blocks=8, queue_timeout_s=2.0))
    now = [0.0]
    core.scheduler.clock = lambda: now[0]
    for request in requests:
        core.add_request(request)
    finished: dict[str, Finished] = {}
    while core.has_work:
        finished |= {rid: e for rid, e in core.step() if isinstance(e, Finished)}
        now[0] += 0.25  # a slow step: the preempted request waits longer than the timeout
    assert core.stats().num_preemptions >= 1
    assert {rid: (e.reason, e.error) for rid, e in finished.items()} == {"a": ("length", None), "b": ("length", None)}


def test_async_steps_preempt_nobody_for_a_row_whose_sampled_stop_is_not_read_yet() -> None:
    """The next step is scheduled before this step's rows are read; a request whose newest row is still being
    sampled (here a stop row) and needs a new block waits a step instead of preempting another request for a
    row that is thrown away: the batches are the synchronous steps' ones."""
    stopping = build_model(CONFIG, seed=0)
    forward = stopping.forward

    def always_im_end(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        text, audio = forward(*args, **kwargs)
        text = text.clone()
        text[:, IM_END_ID] += 1e4  # every text-mode row samples <|im_end|>: a stop row
        return text, audio

    stopping.forward = always_im_end
    rng = random.Random(0)
    a = GenerationRequest("a", prompt(rng, 8, audio_out=False), GREEDY, GREEDY, max_new_tokens=5)  # stops at once
    b = GenerationRequest("b", prompt(rng, 20, audio_out=True), GREEDY, GREEDY, max_new_tokens=5)
    runs = {}
    for async_steps in ASYNC_STEPS:
        core = EngineCore(stopping, Tokenizer.tiny(), engine_config(num_blocks=7, async_scheduling=async_steps))
        seqs, _ = run_core(core, {0: [a, b]})
        runs[async_steps] = (core.stats().num_preemptions, seqs["b"].num_admissions,
                             sum(r.num_rows for r in core.step_log), [seqs[k].finish_reason for k in "ab"])
    assert runs[True] == runs[False] == (0, 1, 32, ["stop", "length"])


def test_kv_pool_sizing_and_config_validation(model: MossSpeechForCausalLM) -> None:
    per_block = kv_bytes_per_block(CONFIG, 4, torch.float32)
    assert num_kv_blocks(EngineConfig(block_size=4, kv_cache_bytes=10 * per_block + per_block - 1), CONFIG) == 10
    # Never more than max_num_running full-length sequences can use: 2 * ceil(18 / 4) = 10.
    capped = EngineConfig(block_size=4, kv_cache_bytes=50 * per_block, max_num_running=2, max_model_len=18)
    assert num_kv_blocks(capped, CONFIG) == 10
    assert EngineCore(model, Tokenizer.tiny(), capped).stats().num_blocks_total == 10
    with pytest.raises(ValueError, match="holds no block"):
        num_kv_blocks(EngineConfig(block_size=4, kv_cache_bytes=per_block - 1), CONFIG)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        EngineConfig(kv_cache_memory_fraction=1.5)
    assert EngineConfig(prefill_buckets=[512, 64, 384, 64]).prefill_buckets == (64, 384, 512)  # a YAML list
    assert EngineConfig().prefill_buckets is None
    for bad in ([], [64, 0], [64, 1.5], [True]):
        with pytest.raises(ValueError, match="prefill_buckets must be positive row counts"):
            EngineConfig(prefill_buckets=bad)
    with pytest.raises(ValueError, match="memory_cap_bytes needs a CUDA device, got device 'cpu'"):
        EngineConfig(memory_cap_bytes=2**30)
    with pytest.raises(ValueError, match="memory_cap_bytes must be >= 1 or None, got 0"):
        EngineConfig(device="cuda", memory_cap_bytes=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        EngineCore(model, Tokenizer.tiny(), engine_config(max_model_len=10_000))


async def _first_event(engine: Engine, request: GenerationRequest) -> Event:
    return await asyncio.wait_for(engine.generate(request).__anext__(), timeout=30)


def test_async_errors_come_from_first_anext(model: MossSpeechForCausalLM) -> None:
    async def main() -> None:
        engine = Engine(model, Tokenizer.tiny(), engine_config(num_blocks=8, max_model_len=64))
        rows = prompt(random.Random(8), 10, audio_out=True)
        with pytest.raises(ContextLengthExceededError):
            await _first_event(engine, GenerationRequest("a", rows, max_new_tokens=60))
        with pytest.raises(ContextLengthExceededError):
            await _first_event(engine, GenerationRequest("b", rows, max_new_tokens=30))
        with pytest.raises(InvalidRequestError):
            await _first_event(engine, GenerationRequest("c", (), max_new_tokens=4))
        assert engine.stats().num_waiting == engine.stats().num_running == 0
        await engine.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("async_steps", ASYNC_STEPS)
def test_async_stream_matches_reference(model: MossSpeechForCausalLM, async_steps: bool) -> None:
    request = GenerationRequest("x", prompt(random.Random(9), 12, audio_out=True), GREEDY, GREEDY,
                                max_new_tokens=8, min_new_tokens=8)

    async def main() -> list[Event]:
        engine = Engine(model, Tokenizer.tiny(), engine_config(async_scheduling=async_steps))
        events = [e async for e in engine.generate(request)]
        await engine.shutdown()
        return events

    events = asyncio.run(asyncio.wait_for(main(), timeout=60))
    _, sampler = reference_rows(model, request)
    assert [c for e in events if isinstance(e, AudioCodes) for c in e.codes] == list(sampler.audio_codes)
    assert len(sampler.audio_codes) == 8  # EOSP is masked for all 8 rows
    assert events[-1] == Finished("length", 12, 8, 8, 0)


def failing_forward(engine: Engine, failures: list[BaseException]) -> None:
    """The engine's forward raises the listed exceptions, one a step, then runs."""
    forward = engine.core.runner.forward

    def fail(inp: object) -> object:
        if failures:
            raise failures.pop(0)
        return forward(inp)  # type: ignore[arg-type]

    engine.core.runner.forward = fail  # type: ignore[method-assign]


def test_a_request_finished_by_a_step_that_then_fails_still_gets_its_end(model: MossSpeechForCausalLM) -> None:
    """Asynchronous steps: the step that reads request a's last row (a finishes: it leaves the scheduler)
    fails afterwards, while launching the next sampling. a's last rows and its own Finished were produced
    before the failure: they are delivered, not lost (a's stream used to hang), and b, still running, ends
    with the step's error. Nothing is left held."""
    rng = random.Random(31)
    short = GenerationRequest("a", prompt(rng, 6, audio_out=True), GREEDY, GREEDY, max_new_tokens=2, min_new_tokens=2)
    long = GenerationRequest("b", prompt(rng, 7, audio_out=True), GREEDY, GREEDY, max_new_tokens=20,
                             min_new_tokens=20)

    async def main() -> tuple[list[Event], list[Event], bool, list[str]]:
        engine = Engine(model, Tokenizer.tiny(), engine_config(async_scheduling=True))
        core = engine.core
        launch_sample = core.runner.launch_sample
        fired: list[bool] = []

        def failing(*args: object, **kwargs: object) -> object:
            if "a" not in core.scheduler.seqs and "b" in core.scheduler.seqs and not fired:
                fired.append(True)
                raise RuntimeError("out of memory while launching the sampling")
            return launch_sample(*args, **kwargs)  # type: ignore[arg-type]

        core.runner.launch_sample = failing  # type: ignore[method-assign]
        streams = [engine.generate(short), engine.generate(long)]
        a, b = await asyncio.gather(*[_collect(s) for s in streams])
        left = list(engine._streams)
        await engine.shutdown()
        return a, b, bool(fired), left

    a, b, fired, left = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert fired
    want_rows, _ = reference_rows(model, short)
    assert [e.codes[0] for e in a if isinstance(e, AudioCodes)] == [code for _, code in want_rows]
    assert a[-1] == Finished("length", 6, 2, 2, 0)
    assert b[-1].reason == "error" and b[-1].error == (
        "engine step failed: RuntimeError('out of memory while launching the sampling')")
    assert left == []


def test_an_expiry_computed_by_a_step_that_then_fails_is_delivered(model: MossSpeechForCausalLM) -> None:
    """Synchronous steps: a step expires the waiting request b (queue timeout), then fails while preparing
    its input. b's Finished (its timeout error) was produced first: b gets it instead of hanging."""
    rows = prompt(random.Random(32), 6, audio_out=True)

    async def main() -> tuple[Event, bool]:
        engine = Engine(model, Tokenizer.tiny(), engine_config(max_num_running=1, queue_timeout_s=0.3,
                                                               async_scheduling=False))
        prepare = engine.core.runner.prepare
        fired: list[bool] = []

        def failing(out: object) -> object:
            if "b" not in engine.core.scheduler.seqs and "b" in engine._streams and not fired:
                fired.append(True)  # b was expired in this very step
                raise RuntimeError("failure while preparing the step")
            return prepare(out)  # type: ignore[arg-type]

        engine.core.runner.prepare = failing  # type: ignore[method-assign]
        a = engine.generate(GenerationRequest("a", rows, GREEDY, GREEDY, max_new_tokens=400, min_new_tokens=400))
        await anext(a)
        b = engine.generate(GenerationRequest("b", rows, GREEDY, GREEDY, max_new_tokens=4))  # waits behind a
        first = await asyncio.wait_for(anext(b), timeout=20)
        await a.aclose()
        await engine.shutdown()
        return first, bool(fired)

    first, fired = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert fired
    assert isinstance(first, Finished) and first.reason == "error"
    assert first.error == "request waited more than 0.3 s in the queue"


def test_an_abort_during_the_forward_counts_only_the_codes_sent(model: MossSpeechForCausalLM) -> None:
    """Synchronous steps run the forward and sampling outside the engine's lock (Engine._run_one_step): an
    abort that lands there must not count the code sampled for a row the request never accepts."""
    rows = prompt(random.Random(33), 6, audio_out=True)
    core = EngineCore(model, Tokenizer.tiny(), engine_config(async_scheduling=False))
    core.add_request(GenerationRequest("a", rows, GREEDY, GREEDY, max_new_tokens=10, min_new_tokens=10))
    events = [e for _ in range(3) for _, e in core.step()]
    begun, out, inp = core.begin_step()
    assert begun == [] and inp is not None
    sampled, step_s = core.run_model(inp)  # the fourth code is sampled here
    events += [e for _, e in core.abort("a")]  # Engine.abort from the caller's loop meanwhile
    assert core.end_step(out, sampled, step_s) == []  # the aborted request accepts no row
    codes = [c for e in events if isinstance(e, AudioCodes) for c in e.codes]
    assert len(codes) == 3 and events[-1] == Finished("abort", 6, 3, 3, 0)


def test_closing_a_finished_requests_stream_leaves_a_newer_request_with_its_id_alone(
        model: MossSpeechForCausalLM) -> None:
    """Request x has finished (its Finished is queued, unread) and its id is in use again: closing the old
    stream aborts nothing; the new request runs to its end."""
    rows = prompt(random.Random(34), 6, audio_out=True)

    async def main() -> list[Event]:
        engine = Engine(model, Tokenizer.tiny(), engine_config())
        old = engine.generate(GenerationRequest("x", rows, GREEDY, GREEDY, max_new_tokens=2, min_new_tokens=2))
        await anext(old)
        while "x" in engine._streams:  # the engine has delivered x's Finished to the old stream
            await asyncio.sleep(0.005)
        new = engine.generate(GenerationRequest("x", rows, GREEDY, GREEDY, max_new_tokens=40, min_new_tokens=40))
        first = await anext(new)
        await old.aclose()  # the old consumer walks away without reading its Finished
        rest = [first] + [e async for e in new]
        await engine.shutdown()
        return rest

    events = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert events[-1].reason == "length" and events[-1].num_generated_tokens == 40


async def _collect(stream: object) -> list[Event]:
    return [event async for event in stream]  # type: ignore[attr-defined]


def test_failed_step_ends_streams_with_error_and_engine_recovers(model: MossSpeechForCausalLM) -> None:
    rows = prompt(random.Random(12), 6, audio_out=True)

    async def main() -> tuple[list[Event], list[Event], int]:
        engine = Engine(model, Tokenizer.tiny(), engine_config())
        failing_forward(engine, [RuntimeError("boom")])
        failed = [e async for e in engine.generate(GenerationRequest("f", rows, GREEDY, GREEDY, max_new_tokens=3))]
        used = engine.stats().num_blocks_used
        assert engine.stats().num_tracked_requests == 0
        again = GenerationRequest("g", rows, GREEDY, GREEDY, max_new_tokens=3, min_new_tokens=3)
        after = [e async for e in engine.generate(again)]
        await engine.shutdown()
        return failed, after, used

    failed, after, used = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert failed == [Finished("error", 6, 0, 0, 0, "engine step failed: RuntimeError('boom')")]
    assert used == 0
    assert after[-1] == Finished("length", 6, 3, 3, 0)


def test_failed_steps_in_a_row_make_the_engine_unhealthy(model: MossSpeechForCausalLM) -> None:
    rows = prompt(random.Random(13), 6, audio_out=True)

    async def main() -> tuple[list[str], list[str], EngineStats]:
        engine = Engine(model, Tokenizer.tiny(), engine_config(max_consecutive_step_failures=2))
        failing_forward(engine, [RuntimeError("boom"), RuntimeError("boom"), RuntimeError("boom"),
                                 RuntimeError("boom")])
        health, ends = [], []
        for name in ("a", "b", "c"):
            try:
                events = [e async for e in engine.generate(GenerationRequest(name, rows, GREEDY, GREEDY,
                                                                             max_new_tokens=3))]
                ends.append(events[-1].reason)
            except EngineUnhealthyError as exc:
                ends.append(f"refused: {exc}")
            try:
                engine.check_health()
                health.append("healthy")
            except EngineUnhealthyError as exc:
                health.append(str(exc))
        stats = engine.stats()
        await engine.shutdown()
        return ends, health, stats

    ends, health, stats = asyncio.run(asyncio.wait_for(main(), timeout=60))
    unhealthy = "2 steps in a row failed (max_consecutive_step_failures 2)"
    assert ends == ["error", "error", f"refused: the engine cannot serve: {unhealthy}"]
    assert health == ["healthy", unhealthy, unhealthy]
    assert stats.num_step_failures == 2 and stats.num_blocks_used == 0


def test_a_step_that_runs_clears_the_failures_in_a_row(model: MossSpeechForCausalLM) -> None:
    rows = prompt(random.Random(14), 6, audio_out=True)

    async def main() -> tuple[list[Event], EngineStats]:
        engine = Engine(model, Tokenizer.tiny(), engine_config(max_consecutive_step_failures=2))
        failing_forward(engine, [RuntimeError("boom")])
        [e async for e in engine.generate(GenerationRequest("a", rows, GREEDY, GREEDY, max_new_tokens=3))]
        after = [e async for e in engine.generate(GenerationRequest("b", rows, GREEDY, GREEDY, max_new_tokens=3,
                                                                    min_new_tokens=3))]
        failing_forward(engine, [RuntimeError("boom")])
        [e async for e in engine.generate(GenerationRequest("c", rows, GREEDY, GREEDY, max_new_tokens=3))]
        engine.check_health()  # one failure since the last step that ran: below the limit of 2
        stats = engine.stats()
        await engine.shutdown()
        return after, stats

    after, stats = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert after[-1] == Finished("length", 6, 3, 3, 0)
    assert stats.num_step_failures == 2


def test_one_device_error_makes_the_engine_unhealthy(model: MossSpeechForCausalLM) -> None:
    rows = prompt(random.Random(15), 6, audio_out=True)
    error = torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    async def main() -> tuple[Event, str]:
        engine = Engine(model, Tokenizer.tiny(), engine_config(max_consecutive_step_failures=5))
        failing_forward(engine, [error])
        events = [e async for e in engine.generate(GenerationRequest("a", rows, GREEDY, GREEDY, max_new_tokens=3))]
        with pytest.raises(EngineUnhealthyError) as raised:
            engine.check_health()
        await engine.shutdown()
        return events[-1], str(raised.value)

    end, reason = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert end.reason == "error"
    assert reason == f"a step failed with a device error: {error!r}"


def test_device_errors_are_told_from_a_steps_bad_luck() -> None:
    assert is_device_error(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
    assert is_device_error(RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"))
    assert not is_device_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_device_error(RuntimeError("boom"))


def test_a_hung_step_makes_the_engine_unhealthy_until_it_ends(model: MossSpeechForCausalLM) -> None:
    rows = prompt(random.Random(16), 6, audio_out=True)
    release = threading.Event()

    async def main() -> tuple[str, str, Event]:
        engine = Engine(model, Tokenizer.tiny(), engine_config(step_timeout_s=0.05))
        forward = engine.core.runner.forward

        def hang_once(inp: object) -> object:
            release.wait(30)
            engine.core.runner.forward = forward  # type: ignore[method-assign]
            return forward(inp)  # type: ignore[arg-type]

        engine.core.runner.forward = hang_once  # type: ignore[method-assign]
        stream = engine.generate(GenerationRequest("a", rows, GREEDY, GREEDY, max_new_tokens=3, min_new_tokens=3))
        first = asyncio.ensure_future(anext(stream))
        reason = ""
        while not reason:  # the step hangs until released: unhealthy once it has run past 0.05 s
            await asyncio.sleep(0.01)
            try:
                engine.check_health()
            except EngineUnhealthyError as exc:
                reason = str(exc)
        with pytest.raises(EngineUnhealthyError) as refused:
            await anext(engine.generate(GenerationRequest("b", rows, GREEDY, GREEDY, max_new_tokens=3)))
        release.set()
        events = [await first] + [e async for e in stream]
        engine.check_health()  # the step ended: healthy again
        await engine.shutdown()
        return reason, str(refused.value), events[-1]

    reason, refused, end = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert reason.startswith("a step has run for ") and reason.endswith(" s (step_timeout_s 0.05)")
    assert refused.startswith("the engine cannot serve: a step has run for ")
    assert end == Finished("length", 6, 3, 3, 0)


def test_a_request_to_a_shut_down_engine_is_refused_as_unhealthy(model: MossSpeechForCausalLM) -> None:
    """EngineUnhealthyError is the edge's retryable 503 (another replica serves); a plain EngineError was a 500."""
    rows = prompt(random.Random(19), 6, audio_out=True)

    async def main() -> str:
        engine = Engine(model, Tokenizer.tiny(), engine_config())
        await engine.shutdown()
        with pytest.raises(EngineUnhealthyError) as refused:
            await anext(engine.generate(GenerationRequest("a", rows, GREEDY, GREEDY, max_new_tokens=3)))
        return str(refused.value)

    assert asyncio.run(main()) == "the engine cannot serve: the engine is shut down"


def test_shutdown_does_not_wait_past_step_timeout_for_a_hung_step(model: MossSpeechForCausalLM) -> None:
    """A replica replaced for a hung step runs `shutdown` (LLMServer.__del__): it used to join the step thread
    without a bound, so the replica held its GPU share until Serve's graceful_shutdown_timeout_s (600 s)."""
    rows = prompt(random.Random(18), 6, audio_out=True)
    release, entered = threading.Event(), threading.Event()

    async def main() -> tuple[bool, list[Event]]:
        engine = Engine(model, Tokenizer.tiny(), engine_config(step_timeout_s=0.05))

        def hang(inp: object) -> object:
            entered.set()
            release.wait(30)
            raise RuntimeError("released")

        engine.core.runner.forward = hang  # type: ignore[method-assign]
        stream = engine.generate(GenerationRequest("a", rows, GREEDY, GREEDY, max_new_tokens=3))
        first = asyncio.ensure_future(anext(stream))
        await asyncio.to_thread(entered.wait, 10)
        await asyncio.wait_for(engine.shutdown(), timeout=10)  # the guard only: without the bound it waits 30 s
        alive = engine._thread.is_alive()
        events = [await first] + [e async for e in stream]
        release.set()
        await asyncio.to_thread(engine._thread.join, 10)
        return alive, events

    alive, events = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert alive  # shutdown returned while the step still hung
    assert events == [Finished("abort", 6, 0, 0, 0)]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread dies
def test_a_stopped_step_thread_ends_every_stream_and_the_engine_is_unhealthy(model: MossSpeechForCausalLM) -> None:
    rows = prompt(random.Random(17), 6, audio_out=True)

    class Stop(BaseException):
        pass

    async def main() -> tuple[Event, str]:
        engine = Engine(model, Tokenizer.tiny(), engine_config())
        failing_forward(engine, [Stop("stop")])
        events = [e async for e in engine.generate(GenerationRequest("a", rows, GREEDY, GREEDY, max_new_tokens=3))]
        await asyncio.to_thread(engine._thread.join, 10)
        with pytest.raises(EngineUnhealthyError) as raised:
            engine.check_health()
        await engine.shutdown()
        return events[-1], str(raised.value)

    end, reason = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert end == Finished("error", 6, 0, 0, 0, "engine step thread stopped: Stop('stop')")
    assert reason == "the engine's step thread has stopped"


@pytest.mark.parametrize(("setting", "message"), [
    # NaN passed every `x < 1` check, and the scheduler then never ran a request
    ({"max_num_batched_tokens": math.nan}, "max_num_batched_tokens must be an integer, got nan"),
    ({"max_num_running": 2.5}, "max_num_running must be an integer, got 2.5"),
    ({"block_size": True}, "block_size must be an integer, got True"),  # was block size 1
    ({"kv_cache_bytes": math.inf}, "kv_cache_bytes must be an integer or None, got inf"),
    ({"step_timeout_s": math.inf}, "step_timeout_s must be a finite number, got inf"),  # shutdown's join overflowed
    ({"pacing_lead_s": math.nan}, "pacing_lead_s must be a finite number or None, got nan"),
    ({"fast_path": 1}, "fast_path must be a bool, got 1"),
    ({"model": 5}, "model must be a str, got 5"),
    ({"device": "mps"}, "device must be 'cpu', 'cuda' or 'cuda:N', got 'mps'"),
    ({"device": "bogus"}, "device must be 'cpu', 'cuda' or 'cuda:N', got 'bogus'"),
])
def test_engine_settings_of_the_wrong_kind_are_refused_by_name(setting: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        EngineConfig(**setting)


def test_health_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_consecutive_step_failures must be >= 1, got 0"):
        EngineConfig(max_consecutive_step_failures=0)
    with pytest.raises(ValueError, match="step_timeout_s must be > 0, got 0"):
        EngineConfig(step_timeout_s=0)


@pytest.mark.parametrize("async_steps", ASYNC_STEPS)
def test_aborting_100_streams_frees_every_block(model: MossSpeechForCausalLM, async_steps: bool) -> None:
    small = dataclasses.replace(CONFIG, num_shared_layers=1)
    engine_model = build_model(small, seed=1)
    rng = random.Random(10)
    requests = [
        GenerationRequest(f"q{i}", prompt(rng, rng.randrange(2, 12), audio_out=True), GREEDY, GREEDY,
                          max_new_tokens=200, min_new_tokens=200)
        for i in range(100)
    ]

    async def main() -> None:
        kv_bytes = 1024 * kv_bytes_per_block(small, 4, torch.float32)
        engine = Engine(engine_model, Tokenizer.tiny(), EngineConfig(block_size=4, kv_cache_bytes=kv_bytes,
                                                                     max_num_running=128, async_scheduling=async_steps))
        streams = [engine.generate(r) for r in requests]
        firsts = await asyncio.gather(*(s.__anext__() for s in streams))
        assert all(isinstance(e, AudioCodes) for e in firsts)
        assert engine.stats().num_blocks_used > 0
        assert engine.stats().num_tracked_requests == 100
        for i, (request, stream) in enumerate(zip(requests, streams)):
            if i % 2 == 0:
                engine.abort(request.request_id)  # explicit abort: the stream ends with Finished("abort")
                rest = [e async for e in stream]
                assert isinstance(rest[-1], Finished) and rest[-1].reason == "abort"
                assert rest[-1].num_generated_tokens < 200
            else:
                await stream.aclose()  # the consumer walks away: the engine aborts it
        stats = engine.stats()
        assert (stats.num_running, stats.num_waiting, stats.num_blocks_used, stats.num_tracked_requests) == (0,) * 4
        assert stats.num_blocks_free == stats.num_blocks_total
        assert all(b.ref_count == 0 for b in engine.core.block_manager.blocks)
        await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), timeout=120))


def test_codes_after_the_eager_ones_are_merged_into_batches(model: MossSpeechForCausalLM) -> None:
    """Steps are released one at a time: the first 3 codes leave one per step; the 4th waits for the batch
    interval (a substituted sleep that returns once the engine is done) and carries codes 4..8 with it."""
    request = GenerationRequest("m", prompt(random.Random(9), 12, audio_out=True), GREEDY, GREEDY,
                                max_new_tokens=8, min_new_tokens=8)

    async def main() -> tuple[list[Event], list[float]]:
        engine = Engine(model, Tokenizer.tiny(), engine_config())
        forward = engine.core.runner.forward
        gate = threading.Semaphore(0)

        def gated(inp: object) -> object:
            gate.acquire()
            return forward(inp)  # type: ignore[arg-type]

        engine.core.runner.forward = gated  # type: ignore[method-assign]
        delays: list[float] = []
        real_sleep = asyncio.sleep

        async def sleep_until_done(delay: float) -> None:
            delays.append(delay)
            while engine.stats().num_running:
                await real_sleep(0.005)
            await real_sleep(0.05)  # the last step's events reach this loop

        engine._sleep = sleep_until_done  # type: ignore[method-assign]
        stream = engine.generate(request, eager_codes=3, codes_batch_s=60.0)
        events: list[Event] = []
        for _ in range(3):
            gate.release()
            events.append(await stream.__anext__())
        for _ in range(5):
            gate.release()
        events += [e async for e in stream]
        await engine.shutdown()
        return events, delays

    events, delays = asyncio.run(asyncio.wait_for(main(), timeout=60))
    _, sampler = reference_rows(model, request)
    codes = list(sampler.audio_codes)
    assert events == [AudioCodes((codes[0],)), AudioCodes((codes[1],)), AudioCodes((codes[2],)),
                      AudioCodes(tuple(codes[3:8])), Finished("length", 12, 8, 8, 0)]
    assert len(delays) == 1 and 59.0 < delays[0] <= 60.0


def test_codes_batching_options_are_validated(model: MossSpeechForCausalLM) -> None:
    async def main() -> None:
        engine = Engine(model, Tokenizer.tiny(), engine_config())
        rows = prompt(random.Random(3), 6, audio_out=True)
        for kwargs in ({"eager_codes": -1}, {"codes_batch_s": -0.1}, {"codes_batch_s": math.nan}):
            with pytest.raises(ValueError, match="eager_codes and codes_batch_s"):
                await engine.generate(GenerationRequest("v", rows, max_new_tokens=2), **kwargs).__anext__()
        assert engine.stats().num_waiting == engine.stats().num_running == 0
        await engine.shutdown()

    asyncio.run(main())


def eosp_prone_model() -> MossSpeechForCausalLM:
    """The tiny model with its EOSP row of the audio head scaled up: greedy audio rows end their audio span
    now and then, so requests flip from audio to text mode (and back on SOSP) mid-generation."""
    rigged = build_model(CONFIG, seed=0)
    with torch.no_grad():
        rigged.audio_lm_head.weight[EOSP_ID] *= 40.0
    return rigged


def test_async_steps_rerun_a_step_launched_without_text_head_when_a_row_switches_to_text() -> None:
    """An asynchronous step is launched audio-only when every row was in audio mode; when the row read
    meanwhile is EOSP, its sequence samples the next row in text mode, so the step runs again with the text
    head. Rows and events equal the synchronous engine's and the reference's."""
    rng = random.Random(31)
    requests = [GenerationRequest(f"e{i}", prompt(rng, 5 + 2 * i, audio_out=True), GREEDY, GREEDY,
                                  max_new_tokens=12, min_new_tokens=2 + i) for i in range(4)]
    results = {}
    for async_steps in (False, True):
        core = EngineCore(eosp_prone_model(), Tokenizer.tiny(), engine_config(fast_path=True,
                                                                                async_scheduling=async_steps))
        results[async_steps] = (*run_core(core, {0: requests}), core)
    (seqs, events, core), (seqs_sync, events_sync, core_sync) = results[True], results[False]
    reference = eosp_prone_model()
    for request in requests:
        rows = generated(seqs[request.request_id])
        assert rows == generated(seqs_sync[request.request_id]) == reference_rows(reference, request)[0]
    assert sum(row[1] == EOSP_ID for seq in seqs.values() for row in generated(seq)) == 10
    assert events == events_sync
    assert (core.num_step_reruns, core_sync.num_step_reruns) == (1, 0)
    # the rerun step counts once more on the runner; the step log has one record per step either way
    assert core.runner.num_steps_by_path == Counter(fast=1, graph=12)
    assert core_sync.runner.num_steps_by_path == Counter(fast=1, graph=11)
    assert len(core.step_log) == len(core_sync.step_log) == 12
    assert (core.runner.num_audio_only_steps, core_sync.runner.num_audio_only_steps) == (7, 6)


@pytest.mark.parametrize("fast_path", [False, True])
def test_async_steps_rerun_with_host_inputs_when_a_redraw_changes_a_fed_row(
    model: MossSpeechForCausalLM, monkeypatch: pytest.MonkeyPatch, fast_path: bool
) -> None:
    """A redraw after the read (ties past the top-k candidates) makes the inputs fed on the device stale:
    the step runs again on the rows read. Forcing that report at every read, every step that was fed runs
    twice, the second time on inputs built on the host, and the rows still equal the reference."""
    rng = random.Random(32)
    requests = [GenerationRequest(f"h{i}", prompt(rng, 4 + 3 * i, audio_out=i != 1), GREEDY, GREEDY,
                                  max_new_tokens=4 + i) for i in range(3)]
    reference = [reference_rows(model, request)[0] for request in requests]  # before the patch
    complete = LaunchedRows.complete

    def stale_complete(self: LaunchedRows) -> tuple[list[Row], bool]:
        return complete(self)[0], True

    monkeypatch.setattr(LaunchedRows, "complete", stale_complete)
    engine_model = build_model(CONFIG, seed=0) if fast_path else model  # fusing rewrites the parameters
    core = EngineCore(engine_model, Tokenizer.tiny(), engine_config(max_num_batched_tokens=9, async_scheduling=True,
                                                                    fast_path=fast_path))
    seqs, _ = run_core(core, {0: requests[:2], 1: requests[2:]})
    assert [generated(seqs[request.request_id]) for request in requests] == reference
    assert (core.runner.num_steps_by_path["graph"] > 0) == fast_path
    # a step with a decode row was fed the row sampled just before it: each of them ran twice
    fed = sum(r.num_decode_seqs > 0 for r in core.step_log)
    assert core.num_step_reruns == fed > 0 and len(core.step_log) > fed


def test_async_steps_abort_between_launch_and_read(model: MossSpeechForCausalLM) -> None:
    """Aborting a request whose row is still being sampled ends it at once with the rows read so far (the
    pending one is dropped) and frees its blocks; the others' rows are the reference's."""
    rng = random.Random(33)
    requests = [GenerationRequest(f"b{i}", prompt(rng, 6 + i, audio_out=True), GREEDY, GREEDY,
                                  max_new_tokens=10, min_new_tokens=10) for i in range(3)]
    core = EngineCore(model, Tokenizer.tiny(), engine_config(async_scheduling=True))
    seqs = [core.add_request(request) for request in requests]
    events: list[tuple[str, Event]] = []
    for _ in range(4):  # the prefill, then three decode steps: the fourth row is in flight
        events += core.step()
    assert seqs[1].rows[-1] is PENDING_ROW and core.has_work_in_flight
    assert core.abort("b1") == [("b1", Finished("abort", 7, 3, 3, 0))]
    assert seqs[1].block_table == [] and PENDING_ROW not in seqs[1].rows
    while core.has_work:
        events += core.step()
    codes = {r.request_id: [c for rid, e in events if rid == r.request_id and isinstance(e, AudioCodes)
                            for c in e.codes] for r in requests}
    reference = [reference_rows(model, request) for request in requests]
    assert codes["b1"] == list(reference[1][1].audio_codes[:3])
    assert generated(seqs[1]) == reference[1][0][:3]
    for i in (0, 2):
        assert generated(seqs[i]) == reference[i][0]
        assert codes[requests[i].request_id] == list(reference[i][1].audio_codes)
    assert core.stats().num_blocks_used == 0


@pytest.mark.parametrize("async_steps", ASYNC_STEPS)
def test_logits_without_a_valid_draw_end_that_request_only(model: MossSpeechForCausalLM, async_steps: bool) -> None:
    """NaN audio logits for one request (as a numerical fault would give) end that request with an error
    at that step, keep the rows it had, free its blocks and leave the others' rows the reference's; no
    out-of-bounds index reaches the device (on a GPU that is an assert that ends the process)."""
    rng = random.Random(34)
    requests = [GenerationRequest(f"n{i}", prompt(rng, 5 + i, audio_out=True), GREEDY if i != 1 else HOT, GREEDY,
                                  max_new_tokens=8, min_new_tokens=8) for i in range(3)]
    reference = [reference_rows(model, request) for request in requests]
    core = EngineCore(model, Tokenizer.tiny(), engine_config(async_scheduling=async_steps))
    forward = core.runner.forward
    poisoned: list[int] = []

    def poison_n1(inp: ModelInput, feed: RowFeed | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        text, audio = forward(inp, feed)
        seq = core.scheduler.seqs.get("n1")
        if not poisoned and "n1" in inp.sample_request_ids and seq is not None and seq.num_generated >= 3:
            poisoned.append(seq.num_generated)
            row = int(inp.sample_indices[inp.sample_request_ids.index("n1")])
            audio = audio.clone()
            audio[row, 7] = math.nan
        return text, audio

    core.runner.forward = poison_n1  # type: ignore[method-assign]
    seqs, events = run_core(core, {0: requests})
    # the forward of n1's fourth row (three rows before it, the third still pending with async steps)
    assert poisoned == [3]
    assert generated(seqs["n1"]) == reference[1][0][:3]
    assert events["n1"][-1] == Finished("error", 6, 3, 3, 0, BROKEN_LOGITS_MESSAGE)
    assert core.num_broken_logits == 1
    for i in (0, 2):
        assert generated(seqs[f"n{i}"]) == reference[i][0]
        check_events(events[f"n{i}"], reference[i][1], seqs[f"n{i}"], "length")
    assert core.stats().num_blocks_used == 0


def test_broken_logits_of_an_aborted_request_spare_a_new_request_with_its_id(model: MossSpeechForCausalLM) -> None:
    """Synchronous steps: request x is aborted while its step's forward runs (outside the engine's lock), and
    the id is taken again at once; the step's logits for the old x have no valid draw. The new x is not
    ended for them: it runs to its end with the reference's rows."""
    rows = prompt(random.Random(35), 6, audio_out=True)
    request = GenerationRequest("x", rows, GREEDY, GREEDY, max_new_tokens=4, min_new_tokens=4)
    core = EngineCore(model, Tokenizer.tiny(), engine_config(async_scheduling=False))
    forward = core.runner.forward

    def poisoned(inp: ModelInput, feed: RowFeed | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        text, audio = forward(inp, feed)
        return text, torch.full_like(audio, math.nan)

    core.add_request(request)
    core.step()  # x's prefill and first row
    core.runner.forward = poisoned  # type: ignore[method-assign]
    _, out, inp = core.begin_step()
    assert inp is not None
    sampled, step_s = core.run_model(inp)
    assert sampled == {"x": None}
    aborted = [e for _, e in core.abort("x")]
    assert aborted[-1].reason == "abort"
    core.runner.forward = forward  # type: ignore[method-assign]
    new = core.add_request(request)
    assert core.end_step(out, sampled, step_s) == []
    assert core.num_broken_logits == 0 and core.scheduler.seqs["x"] is new
    events = [e for _ in range(12) for _, e in core.step()]
    assert events[-1] == Finished("length", 6, 4, 4, 4)  # its first prompt block from the prefix cache
    assert generated(new) == reference_rows(model, request)[0]


@pytest.mark.parametrize("async_steps", ASYNC_STEPS)
def test_first_audio_hold_pauses_decoding_and_changes_no_row(model: MossSpeechForCausalLM, async_steps: bool) -> None:
    # Hold after code 2. Asynchronous steps have the step computing code 3 on the GPU when code 2 is read,
    # so they stop after code 3; synchronous ones after code 2. Then nothing runs until the clock passes the
    # hold, and the rows are the reference's.
    request = GenerationRequest("r", prompt(random.Random(1), 11, audio_out=True), GREEDY, GREEDY, max_new_tokens=9)
    core = EngineCore(model, Tokenizer.tiny(), engine_config(async_scheduling=async_steps, first_audio_hold_codes=2,
                                                             first_audio_hold_s=0.5))
    now = [1000.0]
    core.scheduler.clock = lambda: now[0]
    seq = core.add_request(request)
    codes: list[int] = []
    for _ in range(12):
        codes += [c for _, e in core.step() if isinstance(e, AudioCodes) for c in e.codes]
    assert len(codes) == (3 if async_steps else 2) and seq.hold_until == 1000.5
    assert core.scheduler.next_due_in() == 0.5 and not core.has_work_in_flight
    now[0] += 0.5
    while core.has_work:
        codes += [c for _, e in core.step() if isinstance(e, AudioCodes) for c in e.codes]
    ref, sampler = reference_rows(model, request)
    assert generated(seq) == ref and codes == list(sampler.audio_codes)
