"""Scheduler: token budget order, chunked prefill, preemption to the queue front, typed admission errors,
queue timeout, abort. Rows are fed back by hand (no model), so every chunk is exact."""
from __future__ import annotations

import pytest

from runtime.block_manager import BlockManager
from runtime.errors import ContextLengthExceededError, EngineOverloadedError
from runtime.request import GenerationRequest
from runtime.sampling import RequestSampler, SamplingParams
from runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from runtime.sequence import Sequence, SequenceStatus

GREEDY = SamplingParams(temperature=0.0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_seq(request_id: str, num_prompt: int, max_new_tokens: int = 8, first: int = 0) -> Sequence:
    prompt = tuple((first + i, 512) for i in range(num_prompt))
    request = GenerationRequest(request_id, prompt, GREEDY, GREEDY, max_new_tokens=max_new_tokens)
    sampler = RequestSampler(prompt, GREEDY, GREEDY, min_new_tokens=0, seed=0)
    return Sequence(request, sampler, 0, 0.0)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, clock: FakeClock | None = None, **limits: int) -> Scheduler:
    config = SchedulerConfig(**limits)
    return Scheduler(config, BlockManager(num_blocks, block_size), clock or FakeClock())


def layout(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(c.seq.request_id, c.start, c.num_tokens, c.needs_sample) for c in out.chunks]


def feed(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    """Pretend the model ran: every sequence that needs a sample gets the row (token, token)."""
    sched.update(out, {c.seq.request_id: (token, token) for c in out.chunks if c.needs_sample})


def test_decodes_first_then_chunked_prefill_within_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    a, b, c = make_seq("a", 7), make_seq("b", 6), make_seq("c", 3)
    for seq in (a, b, c):
        sched.add(seq)
    out = sched.schedule()
    assert layout(out) == [("a", 0, 7, True), ("b", 0, 3, False)]
    assert a.block_table == [0, 1] and b.block_table == [2]
    feed(sched, out)
    out = sched.schedule()
    # a decodes (1 row), b finishes its prompt (3 rows), c is admitted with the rest of the budget.
    assert layout(out) == [("a", 7, 1, True), ("b", 3, 3, True), ("c", 0, 3, True)]
    assert out.num_batched_tokens == 7
    assert b.block_table == [2, 3] and c.block_table == [4]
    feed(sched, out)
    assert [s.num_rows for s in (a, b, c)] == [9, 7, 4]
    out = sched.schedule()
    assert layout(out) == [("a", 8, 1, True), ("b", 6, 1, True), ("c", 3, 1, True)]
    assert all(ch.is_decode for ch in out.chunks)


def test_max_num_running_keeps_the_rest_waiting() -> None:
    sched = make_scheduler(max_num_running=2)
    for name in "abc":
        sched.add(make_seq(name, 3))
    out = sched.schedule()
    assert [c.seq.request_id for c in out.chunks] == ["a", "b"]
    assert [s.request_id for s in sched.waiting] == ["c"]


def test_finish_by_length_and_stop_frees_blocks() -> None:
    sched = make_scheduler()
    a, b = make_seq("a", 3, max_new_tokens=2), make_seq("b", 3, max_new_tokens=5)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    new_rows = sched.update(out, {"a": (1, 1), "b": (151645, 3)})  # b samples <|im_end|>
    assert [(s.request_id, r) for s, r in new_rows] == [("a", (1, 1)), ("b", (151645, 3))]
    assert b.is_finished and b.finish_reason == "stop" and b.block_table == []
    out = sched.schedule()
    assert layout(out) == [("a", 3, 1, True)]
    sched.update(out, {"a": (2, 2)})
    assert a.finish_reason == "length" and a.num_generated == 2
    assert sched.block_manager.num_used_blocks == 0 and not sched.has_work


def test_preemption_evicts_most_recent_to_queue_front_and_recomputes() -> None:
    sched = make_scheduler(num_blocks=4, block_size=2)
    sched.block_manager.enable_prefix_caching = False  # recompute every row after the preemption
    a, b, c = make_seq("a", 3), make_seq("b", 3, first=50), make_seq("c", 1, first=90)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert layout(out) == [("a", 0, 3, True), ("b", 0, 3, True)]
    sched.add(c)  # queued behind; no room to admit it
    feed(sched, out)
    out = sched.schedule()  # both decode their 4th row into the second block they already hold
    assert layout(out) == [("a", 3, 1, True), ("b", 3, 1, True)]
    assert [s.request_id for s in sched.waiting] == ["c"]
    feed(sched, out)
    # Row 5 of a needs a third block: the pool is empty, so b (admitted last) is preempted.
    out = sched.schedule()
    assert out.preempted == ["b"]
    assert layout(out) == [("a", 4, 1, True)]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert [s.request_id for s in sched.waiting] == ["b", "c"]
    assert sched.num_preemptions == 1
    feed(sched, out)
    sched.abort("a")
    # b comes back first and recomputes prompt + generated rows in one chunk, then samples.
    out = sched.schedule()
    assert layout(out)[0] == ("b", 0, 5, True)
    assert b.num_admissions == 2


def test_sequence_that_is_the_most_recent_preempts_itself() -> None:
    sched = make_scheduler(num_blocks=3, block_size=2)
    sched.block_manager.enable_prefix_caching = False
    a, b = make_seq("a", 3), make_seq("b", 2, first=40)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert layout(out) == [("a", 0, 3, True), ("b", 0, 2, True)]
    assert (a.block_table, b.block_table) == ([0, 1], [2])
    feed(sched, out)
    # a's 4th row fits its block 1; b's 3rd row needs a block, and b itself is the latest admitted.
    out = sched.schedule()
    assert out.preempted == ["b"]
    assert layout(out) == [("a", 3, 1, True)]
    assert b.block_table == [] and [s.request_id for s in sched.waiting] == ["b"]
    assert sched.block_manager.free_block_order() == [2]


def test_admission_errors() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=20, max_num_waiting=2)
    too_long = make_seq("x", 15, max_new_tokens=6).request
    with pytest.raises(ContextLengthExceededError, match="exceeds max_model_len"):
        sched.check_admissible(too_long)
    too_big = make_seq("y", 10, max_new_tokens=8).request  # 18 rows, K/V for 17 -> 5 blocks > 4
    with pytest.raises(ContextLengthExceededError, match=r"= 18 rows \(K/V for 17\) need 5 KV blocks but the "
                                                         "whole cache holds 4 blocks"):
        sched.check_admissible(too_big)
    sched.check_admissible(make_seq("v", 10, max_new_tokens=7).request)  # K/V for 16 rows: exactly the pool
    fits = make_seq("z", 10, max_new_tokens=6)
    sched.check_admissible(fits.request)
    sched.add(fits)
    sched.add(make_seq("w", 2))
    with pytest.raises(EngineOverloadedError) as info:
        sched.check_admissible(make_seq("v", 2).request)
    assert info.value.retry_after_s == sched.config.retry_after_s


def test_queue_timeout_ends_waiting_requests_only() -> None:
    clock = FakeClock()
    sched = make_scheduler(clock=clock, max_num_running=1, queue_timeout_s=5.0)
    a, b = make_seq("a", 2), make_seq("b", 2)
    sched.add(a)
    sched.add(b)
    feed(sched, sched.schedule())
    clock.now += 5.0
    assert sched.expire_waiting() == []
    clock.now += 0.5
    assert sched.expire_waiting() == [b]
    assert b.finish_reason == "error" and "waited more than 5 s" in (b.error or "")
    assert a.status is SequenceStatus.RUNNING and list(sched.waiting) == []


def test_abort_frees_at_once() -> None:
    sched = make_scheduler(max_num_running=1)
    a, b = make_seq("a", 9), make_seq("b", 2)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert sched.block_manager.num_used_blocks == 3
    assert sched.abort("a") is a and sched.abort("b") is b
    assert sched.abort("a") is None
    assert sched.block_manager.num_used_blocks == 0 and not sched.has_work
    sched.update(out, {"a": (1, 1)})  # a step that ran during the abort is ignored
    assert a.num_rows == 9 and a.finish_reason == "abort"


def test_prefix_hit_starts_after_cached_blocks() -> None:
    sched = make_scheduler(block_size=4)
    a = make_seq("a", 10)
    sched.add(a)
    feed(sched, sched.schedule())
    b = make_seq("b", 9)  # same first 9 rows -> the first 2 full blocks are cached
    sched.add(b)
    out = sched.schedule()
    assert layout(out) == [("a", 10, 1, True), ("b", 8, 1, True)]
    assert b.block_table[:2] == a.block_table[:2] and b.num_cached_tokens == 8
    bm = sched.block_manager
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (19, 8)


def feed_codes(sched: Scheduler, out: SchedulerOutput, code: int = 5) -> None:
    """`feed`, with every sampled row an audio code (what sample_next_rows records in audio mode)."""
    for c in out.chunks:
        if c.needs_sample:
            c.seq.sampler._audio_codes.append(code)
    sched.update(out, {c.seq.request_id: (151667, code) for c in out.chunks if c.needs_sample})


def test_pacing_runs_decode_steps_in_bursts_that_keep_streams_near_real_time() -> None:
    # lead 4 codes at 12.5 codes/s: steps run while some stream's lead (codes - 12.5 x seconds since
    # its first code) is under 4, and take every stream whose lead is under 6.
    clock = FakeClock()
    sched = make_scheduler(clock=clock, pacing_lead_codes=4)
    a, b = make_seq("a", 3, max_new_tokens=50), make_seq("b", 3, max_new_tokens=50)
    sched.add(a)
    sched.add(b)
    feed_codes(sched, sched.schedule())  # both prompts: first code of each at t = 100.0
    assert a.first_code_time == b.first_code_time == 100.0
    for k in range(3):  # leads 1, 2, 3: under 4
        out = sched.schedule()
        assert layout(out) == [("a", 3 + k, 1, True), ("b", 3 + k, 1, True)]
        feed_codes(sched, out)
    assert sched.schedule().is_empty and sched.next_due_in() == 0.0  # leads 4: not under 4, due now
    clock.now += 0.04  # leads 4 - 0.5 = 3.5
    out = sched.schedule()
    assert len(out.chunks) == 2
    feed_codes(sched, out)  # leads 4.5: next due when they fall to 4, in 0.5 / 12.5 s
    assert sched.schedule().is_empty and sched.next_due_in() == pytest.approx(0.04)
    # A new request wakes the steps: a and b ride along with c's prefill chunks while their leads are
    # under 6 (4.5 -> 6.5), then c alone decodes until its own lead reaches 4.
    c = make_seq("c", 8, max_new_tokens=50)
    sched.add(c)
    sched.config = SchedulerConfig(pacing_lead_codes=4, max_num_batched_tokens=4)
    steps = []
    for _ in range(7):
        out = sched.schedule()
        steps.append(layout(out))
        feed_codes(sched, out)
    assert steps == [
        [("a", 7, 1, True), ("b", 7, 1, True), ("c", 0, 2, False)],
        [("a", 8, 1, True), ("b", 8, 1, True), ("c", 2, 2, False)],
        [("c", 4, 4, True)],  # a, b: lead 6.5, not under 6; c's first code
        [("c", 8, 1, True)],  # c: lead 1 ...
        [("c", 9, 1, True)],  # ... 2
        [("c", 10, 1, True)],  # ... 3
        [],  # c: lead 4
    ]
    assert (a.num_generated, b.num_generated, c.num_generated) == (7, 7, 4)
    assert sched.next_due_in() == 0.0
    clock.now += 0.08  # a, b: 7 - 12.5 x 0.12 = 5.5; c: 4 - 1 = 3
    assert [ch.seq.request_id for ch in sched.schedule().chunks] == ["a", "b", "c"]


def test_pacing_config_is_validated_and_derived_from_seconds() -> None:
    from runtime.engine import EngineConfig

    with pytest.raises(ValueError, match="pacing_lead_codes must be >= 1"):
        SchedulerConfig(pacing_lead_codes=0)
    with pytest.raises(ValueError, match="pacing_lead_s must be > 0"):
        EngineConfig(pacing_lead_s=0.0)
    assert EngineConfig(pacing_lead_s=0.5).scheduler_config().pacing_lead_codes == 7  # ceil(6.25)
    assert EngineConfig().scheduler_config().pacing_lead_codes is None
    assert make_scheduler(pacing_lead_codes=4).next_due_in() is None  # nothing running


def test_first_audio_hold_pauses_a_lone_stream_after_its_nth_code() -> None:
    # hold after code 3 for 0.02 s while at most one sequence runs
    clock = FakeClock()
    sched = make_scheduler(clock=clock, first_audio_hold_codes=3, first_audio_hold_s=0.02)
    a = make_seq("a", 3, max_new_tokens=50)
    sched.add(a)
    feed_codes(sched, sched.schedule())  # prompt: code 1
    for k in range(2):  # codes 2, 3
        out = sched.schedule()
        assert layout(out) == [("a", 3 + k, 1, True)]
        feed_codes(sched, out)
    assert len(a.sampler.audio_codes) == 3 and a.hold_until == pytest.approx(100.02)
    assert sched.schedule().is_empty and sched.next_due_in() == pytest.approx(0.02)
    clock.now += 0.015
    assert sched.schedule().is_empty and sched.next_due_in() == pytest.approx(0.005)
    # a prefill arriving meanwhile runs; the held stream does not ride along
    b = make_seq("b", 4, max_new_tokens=50, first=40)
    sched.add(b)
    assert sched.next_due_in() == 0.0
    out = sched.schedule()
    assert layout(out) == [("b", 0, 4, True)]
    feed_codes(sched, out)  # b's code 1 with two sequences running
    assert layout(sched.schedule()) == [("b", 4, 1, True)]
    clock.now += 0.005  # the hold is over
    out = sched.schedule()
    assert layout(out) == [("a", 5, 1, True), ("b", 4, 1, True)]  # (b's last row was not fed back above)


def test_first_audio_hold_skips_streams_that_are_not_alone_and_holds_once() -> None:
    clock = FakeClock()
    sched = make_scheduler(clock=clock, first_audio_hold_codes=2, first_audio_hold_s=0.02)
    a, b = make_seq("a", 3, max_new_tokens=50), make_seq("b", 3, max_new_tokens=50, first=30)
    sched.add(a)
    sched.add(b)
    for _ in range(4):  # both decode together: two running, so neither is held
        feed_codes(sched, sched.schedule())
    assert a.hold_until is None and b.hold_until is None and len(a.sampler.audio_codes) == 4
    assert sched.next_due_in() is None
    sched.abort("b")
    for _ in range(3):  # a alone now, but past its second code: no hold
        out = sched.schedule()
        assert [c.seq.request_id for c in out.chunks] == ["a"]
        feed_codes(sched, out)
    assert a.hold_until is None


def test_first_audio_hold_config_is_validated_and_passed_on() -> None:
    from runtime.engine import EngineConfig

    with pytest.raises(ValueError, match="first_audio_hold_codes must be >= 1"):
        SchedulerConfig(first_audio_hold_codes=0)
    with pytest.raises(ValueError, match=r"first_audio_hold_s must be in \(0, 1\]"):
        EngineConfig(first_audio_hold_codes=4, first_audio_hold_s=0.0)
    with pytest.raises(ValueError, match="first_audio_hold_max_running must be >= 1"):
        EngineConfig(first_audio_hold_max_running=0)
    config = EngineConfig(first_audio_hold_codes=4, first_audio_hold_s=0.03, first_audio_hold_max_running=2)
    scheduler = config.scheduler_config()
    assert (scheduler.first_audio_hold_codes, scheduler.first_audio_hold_s, scheduler.first_audio_hold_max_running) == (4, 0.03, 2)
    assert EngineConfig().scheduler_config().first_audio_hold_codes is None
