"""One token-budget scheduling loop (vLLM v1 style) over running and waiting sequences.

Each step spends at most `max_num_batched_tokens` rows: first one row for every running
sequence that is decoding, then chunks of prompts (or of rows to recompute after a preemption)
for running sequences still prefilling, then new admissions from the head of the waiting queue.
When a running sequence needs a block and the pool is empty, the most recently admitted running
sequence is preempted: its blocks are freed, its progress reset to zero, and it goes back to the
FRONT of the waiting queue to recompute its prompt and generated rows later. `SchedulerOutput`
is the only thing handed to the model runner.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from runtime.block_manager import BlockManager
from runtime.config import CODES_PER_SECOND, Row, check_field_types
from runtime.errors import ContextLengthExceededError, EngineOverloadedError
from runtime.request import FinishReason, GenerationRequest
from runtime.sampling import is_stop_row
from runtime.sequence import PENDING_ROW, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of the scheduler; see EngineConfig for their meaning."""

    max_num_running: int = 64
    max_num_waiting: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    queue_timeout_s: float = 300.0
    retry_after_s: float = 1.0
    # Real-time pacing (None: off). A decoding sequence's lead is its audio codes minus
    # `pacing_codes_per_s` x (seconds since its first code): how far it runs ahead of a listener who
    # started with the first code. Decode steps run only while some sequence's lead is under
    # `pacing_lead_codes` (or other work is there), and take the sequences whose lead is under 1.5 x
    # that; so every lead stays at or above `pacing_lead_codes` (less what one step adds), a paced
    # batch refills in bursts, and the GPU is left to the vocoder (and prefills) in between.
    pacing_lead_codes: int | None = None
    pacing_codes_per_s: float = CODES_PER_SECOND
    # First-audio hold (None: off). When a sequence's audio code number `first_audio_hold_codes` is
    # accepted while at most `first_audio_hold_max_running` sequences run, its decode rows wait
    # `first_audio_hold_s`, so the vocoder makes that stream's first chunk on a GPU the LLM leaves idle (a
    # lone stream is far ahead of real time then). Other sequences, prefills included, are not held.
    first_audio_hold_codes: int | None = None
    first_audio_hold_s: float = 0.025
    first_audio_hold_max_running: int = 1

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("max_num_running", "max_num_waiting", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.queue_timeout_s > 0:
            raise ValueError(f"queue_timeout_s must be > 0, got {self.queue_timeout_s}")
        if self.pacing_lead_codes is not None and self.pacing_lead_codes < 1:
            raise ValueError(f"pacing_lead_codes must be >= 1 or None, got {self.pacing_lead_codes}")
        if not self.pacing_codes_per_s > 0:
            raise ValueError(f"pacing_codes_per_s must be > 0, got {self.pacing_codes_per_s}")
        if self.first_audio_hold_codes is not None and self.first_audio_hold_codes < 1:
            raise ValueError(f"first_audio_hold_codes must be >= 1 or None, got {self.first_audio_hold_codes}")
        if not 0 < self.first_audio_hold_s <= 1:
            raise ValueError(f"first_audio_hold_s must be in (0, 1], got {self.first_audio_hold_s}")
        if self.first_audio_hold_max_running < 1:
            raise ValueError(f"first_audio_hold_max_running must be >= 1, got {self.first_audio_hold_max_running}")


@dataclass(frozen=True)
class ScheduledChunk:
    """Rows `start .. start + num_tokens - 1` of `seq` run this step."""

    seq: Sequence
    start: int
    num_tokens: int
    needs_sample: bool  # the chunk reaches the last known row: sample the next one
    is_decode: bool  # the prompt was computed before this step (one generated row)


@dataclass
class SchedulerOutput:
    """What one step runs; chunks are in flat-batch order."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # request ids preempted while scheduling

    @property
    def num_batched_tokens(self) -> int:
        """Rows in the flat batch."""
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        """Nothing to run."""
        return not self.chunks


class Scheduler:
    """Owns the waiting queue and the running batch; mutates sequences and the block manager."""

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.seqs: dict[str, Sequence] = {}  # every unfinished sequence by request id
        self.num_preemptions = 0

    # ----- queries -----
    def check_admissible(self, request: GenerationRequest) -> None:
        """Raise the typed error that would keep `request` from ever running, or from queueing now."""
        num_prompt = len(request.prompt_rows)
        total = num_prompt + request.max_new_tokens
        if total > self.config.max_model_len:
            raise ContextLengthExceededError(
                f"prompt ({num_prompt} rows) + max_new_tokens ({request.max_new_tokens}) = {total} "
                f"exceeds max_model_len ({self.config.max_model_len})"
            )
        bm = self.block_manager
        needed = -(-(total - 1) // bm.block_size)  # the last generated row is never fed back: no K/V of its own
        if needed > bm.num_blocks:
            raise ContextLengthExceededError(
                f"prompt + max_new_tokens = {total} rows (K/V for {total - 1}) need {needed} KV blocks but the "
                f"whole cache holds {bm.num_blocks} blocks ({bm.num_blocks * bm.block_size} rows); "
                "lower max_new_tokens"
            )
        if len(self.waiting) >= self.config.max_num_waiting:
            raise EngineOverloadedError(
                f"waiting queue is full ({len(self.waiting)} requests)", retry_after_s=self.config.retry_after_s
            )

    @property
    def has_work(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self.waiting or self.running)

    # ----- mutations -----
    def add(self, seq: Sequence) -> None:
        """Queue an admissible sequence (call `check_admissible` first)."""
        assert seq.request_id not in self.seqs, seq.request_id
        seq.enqueue_time = self.clock()
        self.seqs[seq.request_id] = seq
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's rows within the token budget, allocating (or preempting for) their blocks."""
        out = SchedulerOutput()
        now = self.clock()
        scheduled: dict[str, ScheduledChunk] = {}
        budget = self.config.max_num_batched_tokens
        lead = self.config.pacing_lead_codes
        wake = lead is None or bool(self.waiting) or any(
            seq.num_uncomputed != 1 or self._lead(seq, now) < lead for seq in self.running)
        for decoding in (True, False):
            for seq in list(self.running):
                if seq.status is not SequenceStatus.RUNNING or (seq.num_uncomputed == 1) != decoding:
                    continue  # preempted earlier in this loop, or not this pass
                if decoding and lead is not None and (not wake or self._lead(seq, now) >= 1.5 * lead):
                    continue  # paced: far enough ahead of real time
                if decoding and self._is_held(seq, now):
                    continue  # first-audio hold
                if decoding and seq.num_generated >= seq.request.max_new_tokens:
                    continue  # its last row is still being sampled (asynchronous steps): it ends then
                num_tokens = min(seq.num_uncomputed, budget)
                if num_tokens == 0:
                    break
                allocated = self.block_manager.allocate_slots(seq, num_tokens) is not None
                while not allocated:
                    if seq.rows[-1] is PENDING_ROW:
                        # its newest row is still being sampled (asynchronous steps) and may stop it: nobody
                        # is preempted for a row that may be thrown away; it waits a step for the row
                        break
                    victim = self.running[-1]
                    self._preempt(victim)
                    out.preempted.append(victim.request_id)
                    dropped = scheduled.pop(victim.request_id, None)
                    if dropped is not None:
                        budget += dropped.num_tokens
                    if victim is seq:
                        break
                    allocated = self.block_manager.allocate_slots(seq, num_tokens) is not None
                if allocated:
                    scheduled[seq.request_id] = self._chunk(seq, num_tokens)
                    budget -= num_tokens
        if not out.preempted:
            budget = self._admit_waiting(scheduled, budget)
        out.chunks = list(scheduled.values())
        return out

    def update(self, out: SchedulerOutput, sampled: dict[str, Row]) -> list[tuple[Sequence, Row]]:
        """Record a finished step: advance progress, publish full blocks, append sampled rows.

        Returns the new rows in batch order; sequences that stop or hit their length limit are
        finished and their blocks freed. Sequences aborted during the step are skipped.
        """
        new_rows: list[tuple[Sequence, Row]] = []
        for seq in self.advance(out):
            row = sampled[seq.request_id]
            seq.append_row(row)
            self.accept_row(seq, row)
            new_rows.append((seq, row))
        return new_rows

    def advance(self, out: SchedulerOutput) -> list[Sequence]:
        """The progress half of `update`: count the step's rows as computed and publish full blocks ->
        the sequences that sampled a row in it (not finished meanwhile), in batch order."""
        sampling: list[Sequence] = []
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.is_finished:
                continue
            assert seq.num_computed_tokens == chunk.start
            seq.num_computed_tokens += chunk.num_tokens
            self.block_manager.cache_full_blocks(seq)
            if chunk.needs_sample:
                sampling.append(seq)
        return sampling

    def accept_row(self, seq: Sequence, row: Row) -> None:
        """The row half of `update` for a row now in `seq.rows` (appended, or put in place of
        PENDING_ROW): note the first audio code, finish a sequence that stops or reaches its length."""
        if seq.first_code_time is None and seq.sampler.audio_codes:
            seq.first_code_time = self.clock()
        hold = self.config.first_audio_hold_codes
        if (hold is not None and seq.hold_until is None and len(seq.sampler.audio_codes) == hold
                and len(self.running) <= self.config.first_audio_hold_max_running):  # (at that code only)
            seq.hold_until = self.clock() + self.config.first_audio_hold_s
        if is_stop_row(row):
            self._finish(seq, "stop")
        elif seq.num_generated >= seq.request.max_new_tokens:
            self._finish(seq, "length")

    def next_due_in(self) -> float | None:
        """Seconds until pacing or a first-audio hold lets a decode step run again (None: neither holds
        anything back)."""
        lead = self.config.pacing_lead_codes
        now, rate = self.clock(), self.config.pacing_codes_per_s
        held = [seq for seq in self.running if self._is_held(seq, now)]
        if not self.running or (lead is None and not held):
            return None
        if self.waiting or any(s.num_uncomputed != 1 for s in self.running):
            return 0.0
        dues = [seq.hold_until - now for seq in held]  # (a held sequence's hold_until is set)
        for seq in self.running:
            if not self._is_held(seq, now):
                if lead is None:
                    return 0.0  # a free sequence decodes now
                dues.append(max(0.0, (self._lead(seq, now) - lead) / rate))  # the lead falls by `rate` per s
        return min(dues)

    @staticmethod
    def _is_held(seq: Sequence, now: float) -> bool:
        """Whether `seq`'s first-audio hold lasts at `now`."""
        return seq.hold_until is not None and now < seq.hold_until

    def _lead(self, seq: Sequence, now: float) -> float:
        """Codes `seq` is ahead of real time since its first code (-inf before it has one)."""
        if seq.first_code_time is None:
            return float("-inf")
        return len(seq.sampler.audio_codes) - self.config.pacing_codes_per_s * (now - seq.first_code_time)

    def abort(self, request_id: str, reason: FinishReason = "abort", error: str | None = None) -> Sequence | None:
        """End `request_id` now and free its blocks; None when it is unknown or already finished."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        self._finish(seq, reason, error)
        return seq

    def expire_waiting(self) -> list[Sequence]:
        """Finish (reason "error") every waiting sequence queued longer than `queue_timeout_s` that has never
        run: a preempted one has streamed output already and waits at the head of the queue to go on."""
        now = self.clock()
        expired = [s for s in self.waiting
                   if s.num_admissions == 0 and now - s.enqueue_time > self.config.queue_timeout_s]
        for seq in expired:
            self._finish(seq, "error", f"request waited more than {self.config.queue_timeout_s:g} s in the queue")
        return expired

    def _admit_waiting(self, scheduled: dict[str, ScheduledChunk], budget: int) -> int:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_running:
            seq = self.waiting[0]
            cached = bm.find_cached_prefix(seq)
            num_cached = len(cached) * bm.block_size
            num_tokens = min(seq.num_rows - num_cached, budget)
            if bm.allocate_slots(seq, num_tokens, cached) is None:
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            seq.num_computed_tokens = num_cached
            if seq.num_admissions == 0:  # the prefix cache's counts are of prompts, not of preemptions' recomputes
                bm.record_prefix_lookup(seq.num_rows, num_cached)
                seq.num_cached_tokens = num_cached
            seq.num_admissions += 1
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled[seq.request_id] = self._chunk(seq, num_tokens)
            budget -= num_tokens
        return budget

    def _chunk(self, seq: Sequence, num_tokens: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return ScheduledChunk(
            seq=seq,
            start=start,
            num_tokens=num_tokens,
            needs_sample=start + num_tokens == seq.num_rows,
            is_decode=start >= seq.num_prompt_rows,
        )

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.enqueue_time = self.clock()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        if seq.rows[-1] is PENDING_ROW:  # ended before its row was read (abort, error): the row is dropped
            seq.rows.pop()
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.finish(reason, error)
        del self.seqs[seq.request_id]
