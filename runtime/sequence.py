"""A request's state inside the engine: its rows, KV blocks, progress, sampler and text output.

`Sequence.rows` holds the prompt rows followed by every generated row. `num_computed_tokens`
counts the leading rows whose K/V are in the cache; the rows after it are what the scheduler
still has to run (the whole prompt at first, one row per decode step, everything again after a
preemption). The block manager reads and writes `block_table`, `block_hashes` and
`num_published_blocks`.
"""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from runtime.config import MODALITY_PAD_ID, Row
from runtime.request import FinishReason, GenerationRequest

if TYPE_CHECKING:
    from runtime.sampling import RequestSampler
    from runtime.tokenizer import Tokenizer


# The last row of a sequence whose next row is sampled on the device but not read yet (EngineCore's
# asynchronous steps): the scheduler treats it as a known row, and the next step's input for it comes from
# the device; it is replaced with the sampled row once read. Compared by identity.
PENDING_ROW: Row = (-1, -1)


class SequenceStatus(enum.Enum):
    """Where a sequence is: in the waiting queue, in the running batch, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Mutable engine-side state of one `GenerationRequest`."""

    def __init__(
        self, request: GenerationRequest, sampler: RequestSampler, arrival_index: int, arrival_time: float
    ) -> None:
        self.request = request
        self.request_id = request.request_id
        self.sampler = sampler
        self.rows: list[Row] = list(request.prompt_rows)
        self.num_prompt_rows = len(self.rows)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_published_blocks = 0
        self.num_cached_tokens = 0  # prompt rows served by the prefix cache at first admission
        self.num_admissions = 0
        self.status = SequenceStatus.WAITING
        self.arrival_index = arrival_index  # global admission order tie-breaker
        self.enqueue_time = arrival_time  # when it last entered the waiting queue
        self.first_code_time: float | None = None  # scheduler clock at its first audio code (pacing)
        self.hold_until: float | None = None  # scheduler clock until which its decoding waits (first-audio hold)
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        # Wall time of the steps this sequence took part in (the engine's own step timings).
        self.prefill_s = 0.0
        self.decode_s = 0.0
        self.num_decode_steps = 0
        # Wall-clock times of its first moments (runtime.request.Timeline).
        self.arrived_at = time.time()
        self.first_scheduled_at: float | None = None
        self.code_times: list[float] = []
        # audio codes handed out as events (a code sampled for a row the request never accepts, as when it is
        # aborted while its step runs, is not one): Finished.num_audio_codes
        self.num_codes_sent = 0

    @property
    def num_rows(self) -> int:
        """Prompt plus generated rows."""
        return len(self.rows)

    @property
    def num_generated(self) -> int:
        """Rows generated so far."""
        return len(self.rows) - self.num_prompt_rows

    @property
    def num_uncomputed(self) -> int:
        """Rows whose K/V are not in the cache yet."""
        return len(self.rows) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        """Whether the sequence has ended (any reason)."""
        return self.status is SequenceStatus.FINISHED

    def max_rows(self) -> int:
        """The most rows this sequence can ever hold: prompt + max_new_tokens."""
        return self.num_prompt_rows + self.request.max_new_tokens

    def append_row(self, row: Row) -> None:
        """Add a sampled row; its K/V get computed on the next step."""
        assert self.num_computed_tokens == len(self.rows), "sampled before all rows were computed"
        self.rows.append(row)

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        """Mark the sequence done (the caller frees its blocks)."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.error = error


class IncrementalDetokenizer:
    """Turns a stream of text-mode token ids into text deltas that never split a character.

    Decodes a small window (vLLM/HF style prefix/read offsets) and holds text back while the
    decoded tail ends in U+FFFD, i.e. while a multi-byte character is still incomplete.
    Special tokens (SOSP, IM_END, ...) and MODALITY_PAD produce no text.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became complete (may be empty)."""
        if token_id == MODALITY_PAD_ID:
            return ""
        self._ids.append(token_id)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back (a truly broken tail shows U+FFFD)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=True)
