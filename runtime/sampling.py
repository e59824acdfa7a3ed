"""Per-request, per-channel sampling of the next (text, audio) row.

Semantics follow the facts sheet and Hugging Face ``generate``:

- both channels are sampled at every step, each with its own :class:`SamplingParams`;
- processing order per channel: masks, repetition penalty, temperature, top-k, top-p, then the draw;
- audio logits above EOSP (16385..) are always masked; EOSP is masked while fewer than ``min_new_tokens``
  rows have been generated;
- repetition penalty (HF semantics) covers each channel's own history: the prompt rows and the generated
  rows of that channel, as appended (so the text history holds MODALITY_PAD for rows sampled in audio
  mode, and the audio history holds AUDIO_PAD for prompt text rows);
- temperature 0 means greedy: argmax after masks and penalty, ties to the lowest index; so does any
  temperature below ``GREEDY_BELOW`` (1e-5): dividing logits by it can overflow float32 (a temperature
  under ~1e-45 even rounds to 0 there, and the draw returned index 0), and a draw at it is the argmax
  unless logits (nearly) tie;
- in audio mode the sampled text token is overwritten with MODALITY_PAD (see :mod:`runtime.modality`).

Reproducibility: each :class:`RequestSampler` draws exactly two uniforms per step (text, then audio) from a
counter-based generator (SplitMix64 over its seed and a draw counter, on the host), even for greedy channels
and for the text channel of audio-mode rows, so a request's samples do not depend on which other requests
share the batch, on their order, on the other channel's settings, or on the device.

Vectorisation: the math runs once over the whole batch on the logits' device, with a fixed handful of kernel
launches and host-to-device copies per step whatever the batch size:

- rows in audio mode skip the text channel entirely (their text token is overwritten with MODALITY_PAD, so
  sampling it could not change the row), which saves the top-k over the ~152k text ids for speech output;
- the repetition penalty builds each step's ``[S, V]`` presence mask from every request's distinct history
  ids (kept on the host) with one copy and one scatter; this gives the same values as HF's gather/scatter;
- top-k runs on ``torch.topk`` of the largest k in the batch plus TOPK_TIE_MARGIN candidates (re-ordered
  stably, lowest id first among equal values, as the full sort orders them); a batch with top-k disabled or
  above 1024, or with ties at the k-th value reaching past the candidates, takes the full sort instead, so
  both give the same ids.
"""
from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from runtime.config import ENDOFTEXT_ID, EOSP_ID, IM_END_ID, MODALITY_PAD_ID, Row
from runtime.modality import TEXT_MODE, Mode, apply_modality, is_output_code, next_mode, replay_mode
from runtime.transfer import to_device

_MAX_SEED = 2**64
_MASK64 = 2**64 - 1
_GOLDEN64 = 0x9E3779B97F4A7C15
TOPK_FAST_MAX = 1024  # largest top_k sampled from `torch.topk` instead of a full sort
# `torch.topk` takes this many candidates beyond the largest top_k, so that ids tied with a row's k-th value
# (HF keeps them all) are nearly always among them: bf16 logits tie often, and a tie reaching past the
# candidates costs a wait for the GPU and a full sort (see `_sample_tokens`). 0: exactly the largest top_k.
TOPK_TIE_MARGIN = 64
num_full_sort_redraws = 0  # channels redrawn over the full sort since import (see `sample_next_rows`)


def splitmix64(x: int) -> int:
    """SplitMix64's output function of the 64-bit state ``x`` (Steele, Lea and Flood 2014)."""
    z = (x + _GOLDEN64) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


# Temperatures below this sample as greedy (see the module docstring).
GREEDY_BELOW = 1e-5
# Largest temperature and the repetition penalty's range: the sampler divides float32 logits by them, and a
# value outside these turns finite logits into inf or NaN (a temperature of 1e39 is inf in float32 and
# made every masked -inf logit NaN, so masked audio ids were drawn; a penalty of 1e-40 overflowed a seen
# id's logit and failed the request as "non-finite logits").
MAX_TEMPERATURE = 100.0
REPETITION_PENALTY_RANGE = (0.01, 100.0)


def _is_number(value: object, kind: type) -> bool:
    """`value` is a `kind` (numbers.Real, numbers.Integral; numpy's count) and not a bool, which would pass as 0 or 1
    (top_k=True: greedy)."""
    return isinstance(value, kind) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one channel (text or audio); defaults are upstream's; temperature 0 = greedy.

    ``top_k`` 0 (or >= vocab size) disables top-k; ``top_p`` 1.0 disables top-p; ``repetition_penalty`` 1.0
    disables the penalty.
    """

    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    repetition_penalty: float = 1.1

    def validate(self) -> None:
        """Raise ValueError naming the field when a value is non-finite or out of range."""
        for name in ("temperature", "top_p", "repetition_penalty"):
            value = getattr(self, name)
            if not _is_number(value, numbers.Real):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value!r}")
        if not _is_number(self.top_k, numbers.Integral):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables top-k), got {self.top_k}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition_penalty must be in [{low:g}, {high:g}], got {self.repetition_penalty}")

    @property
    def is_greedy(self) -> bool:
        """Whether this channel takes the argmax instead of drawing (temperature below GREEDY_BELOW)."""
        return self.temperature < GREEDY_BELOW


class _ChannelHistory:
    """Distinct token ids seen on one channel, in order of first appearance, kept on the host."""

    def __init__(self, name: str, prompt_ids: Sequence[int]) -> None:
        self.name = name
        self._seen: set[int] = set()
        self._ids = np.empty(max(16, len(prompt_ids)), dtype=np.int64)
        self._len = 0
        self.max_id = -1
        for token in prompt_ids:
            self.append(token)

    def ids(self) -> np.ndarray:
        """The distinct ids so far ([n] int64, a view: do not mutate)."""
        return self._ids[: self._len]

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError when an id of the history is outside ``[0, vocab_size)``."""
        if self.max_id >= vocab_size:
            bad = [int(i) for i in self.ids() if i >= vocab_size]
            raise ValueError(f"{self.name} history holds ids outside [0, {vocab_size}): {bad[:5]}")

    def append(self, token: int) -> None:
        if token in self._seen:
            return
        self._seen.add(token)
        if self._len == len(self._ids):
            self._ids = np.concatenate([self._ids, np.empty_like(self._ids)])
        self._ids[self._len] = token
        self._len += 1
        self.max_id = max(self.max_id, token)


class RequestSampler:
    """Sampling state of one request: its generator, both channel histories and its modality mode.

    Exposes ``mode`` (the mode the next row will be sampled in), ``num_generated``, ``generated_rows``
    (rows appended by :func:`sample_next_rows`, after the modality overwrite), ``audio_codes`` (the output
    codes: audio tokens sampled in audio mode, EOSP excluded) and ``last_output_code`` (the output code
    carried by the most recent row, or None).
    """

    def __init__(
        self,
        prompt_rows: Sequence[Row],
        text_params: SamplingParams,
        audio_params: SamplingParams,
        *,
        min_new_tokens: int,
        seed: int,
    ) -> None:
        text_params.validate()
        audio_params.validate()
        if isinstance(min_new_tokens, bool) or not isinstance(min_new_tokens, int) or min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be an integer >= 0, got {min_new_tokens!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _MAX_SEED:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
        rows = [_check_row(row) for row in prompt_rows]
        self.text_params = text_params
        self.audio_params = audio_params
        self.min_new_tokens = min_new_tokens
        self.seed = seed
        self.prompt_rows: tuple[Row, ...] = tuple(rows)
        self._mode: Mode = replay_mode(rows)
        self._generated: list[Row] = []
        self._audio_codes: list[int] = []
        self._last_output_code: int | None = None
        self._text_history = _ChannelHistory("text", [r[0] for r in rows])
        self._audio_history = _ChannelHistory("audio", [r[1] for r in rows])
        self._key = splitmix64(seed)
        self._num_draws = 0

    @property
    def mode(self) -> Mode:
        """The modality the next row is sampled in ("text" or "audio")."""
        return self._mode

    @property
    def num_generated(self) -> int:
        """How many rows have been sampled for this request."""
        return len(self._generated)

    @property
    def generated_rows(self) -> Sequence[Row]:
        """The rows sampled so far, as appended (read-only view; do not mutate)."""
        return self._generated

    @property
    def audio_codes(self) -> Sequence[int]:
        """The output audio codes so far, 0..16383 (read-only view; do not mutate)."""
        return self._audio_codes

    @property
    def last_output_code(self) -> int | None:
        """The output code carried by the most recent row, or None if it carries none (or no row yet)."""
        return self._last_output_code

    def _draw_uniforms(self) -> tuple[float, float]:
        """The step's two uniforms in [0, 1), (text, audio): 24-bit floats, exact in float32."""
        n = self._num_draws
        self._num_draws = n + 2
        key = self._key
        return (splitmix64(key ^ (n * _GOLDEN64 & _MASK64)) >> 40) / 2**24, (
            splitmix64(key ^ ((n + 1) * _GOLDEN64 & _MASK64)) >> 40) / 2**24

    def _append(self, text_token: int, audio_token: int) -> Row:
        row = apply_modality(self._mode, text_token, audio_token)
        self._last_output_code = row[1] if is_output_code(self._mode, row) else None
        if self._last_output_code is not None:
            self._audio_codes.append(self._last_output_code)
        self._generated.append(row)
        self._text_history.append(row[0])
        self._audio_history.append(row[1])
        self._mode = next_mode(self._mode, row)
        return row


def is_stop_row(row: Row) -> bool:
    """Whether the row ends generation: its text token is IM_END or ENDOFTEXT (the row itself is output)."""
    return row[0] == IM_END_ID or row[0] == ENDOFTEXT_ID


def sample_next_rows(
    text_logits: torch.Tensor | None, audio_logits: torch.Tensor, samplers: list[RequestSampler]
) -> list[Row]:
    """Sample one row per request, append it to that request's sampler, and return the rows.

    ``text_logits`` is ``[S, Vt]`` and ``audio_logits`` is ``[S, Va]`` (float32, or bfloat16 / float16 widened to
    float32 here; any device), row ``i`` belonging
    to ``samplers[i]``. ``text_logits`` may be None when no request samples in text mode (an audio-only step
    that skipped the text head): audio-mode rows never read them. The inputs are not modified. Each request's
    result depends only on its own logits, state and seed, never on the rest of the batch. Raises
    `NonFiniteLogitsError` when some row's logits have no valid draw (NaN or infinite largest value).
    """
    rows = launch_next_rows(text_logits, audio_logits, samplers).complete()[0]
    broken = [i for i, row in enumerate(rows) if row is None]
    if broken:
        raise NonFiniteLogitsError(f"the logits of row(s) {broken} have a NaN or infinite largest value: "
                                   f"nothing was sampled for them (the other rows were appended)")
    return rows  # type: ignore[return-value]


class NonFiniteLogitsError(ValueError):
    """A row's logits had no valid draw (their largest value was NaN or infinite)."""


@dataclass
class LaunchedRows:
    """Rows sampled on the device and not read yet (`launch_next_rows`); `complete` reads them.

    ``next_tokens`` / ``next_is_audio`` ([S] on the device, None unless asked for) are what each new row
    embeds as the next step's input (``model.split_rows`` of the row after the modality overwrite), so a
    next step can be launched on them before the host has read the ids."""

    samplers: list[RequestSampler]
    text_rows: list[int]
    results: list[tuple[torch.Tensor, torch.Tensor | None]]  # per channel: ids, ties_past_k
    draws: list[tuple[torch.Tensor, list[SamplingParams], torch.Tensor]]  # per channel: logits, params, uniforms
    read: torch.Tensor  # ids then flags; host (pinned, filled by a non-blocking copy) or the device tensor
    ready: torch.cuda.Event | None  # marks that copy
    next_tokens: torch.Tensor | None = None
    next_is_audio: torch.Tensor | None = None

    def wait(self) -> None:
        """Block until the sampled ids have reached the host (no-op off CUDA)."""
        if self.ready is not None:
            self.ready.synchronize()

    def complete(self) -> tuple[list[Row | None], bool]:
        """Read the ids (the step's one wait for the GPU), redraw channels whose ties reach past the top-k
        candidates, append each row to its sampler -> (rows, whether a redraw changed an id, which makes
        ``next_tokens`` stale). A request whose logits had no valid draw (NaN or infinite largest logit in
        a channel it samples) gets None and its sampler is left as it was."""
        global num_full_sort_redraws
        self.wait()
        read = self.read.tolist()
        n = len(read) // 3
        picked, ties_read, broken_read = read[:n], read[n : 2 * n], read[2 * n :]
        num_seqs = len(self.samplers)
        broken = {i for i in range(num_seqs) if broken_read[i]}
        broken |= {i for i, flag in zip(self.text_rows, broken_read[num_seqs:], strict=True) if flag}
        changed = False
        start = 0
        for (ids, _), draw in zip(self.results, self.draws, strict=True):
            end = start + ids.shape[0]
            if any(ties_read[start:end]):  # rare (many equal logits): redraw the channel over its full sort
                redrawn = _sample_tokens(*draw, full_sort=True)[0].tolist()
                changed = changed or redrawn != picked[start:end]
                picked[start:end] = redrawn
                num_full_sort_redraws += 1
            start = end
        text_tokens = [MODALITY_PAD_ID] * num_seqs
        for i, token in zip(self.text_rows, picked[num_seqs:], strict=True):
            text_tokens[i] = token
        rows = [None if i in broken else s._append(t, a)
                for i, (s, t, a) in enumerate(zip(self.samplers, text_tokens, picked[:num_seqs], strict=True))]
        return rows, changed


def launch_next_rows(
    text_logits: torch.Tensor | None, audio_logits: torch.Tensor, samplers: list[RequestSampler], *,
    next_inputs: bool = False,
) -> LaunchedRows:
    """`sample_next_rows` up to the read: launch the sampling kernels (and, with ``next_inputs``, compute
    the rows' next-step inputs on the device) without waiting for the GPU. Each sampler's draw counter
    advances now; nothing else of its state changes before `LaunchedRows.complete`, and no sampler may be
    launched again before that. The logits may be overwritten once this returns (what a redraw needs is
    copied)."""
    num_seqs = len(samplers)
    text_rows = [i for i, s in enumerate(samplers) if s.mode == TEXT_MODE]
    if text_logits is None and text_rows:
        raise ValueError(f"{len(text_rows)} request(s) sample in text mode but no text logits were computed")
    text_shape = None if text_logits is None else tuple(text_logits.shape)
    if audio_logits.dim() != 2 or (text_shape is not None and len(text_shape) != 2):
        raise ValueError(f"logits must be 2-D [S, V], got text {text_shape} audio {tuple(audio_logits.shape)}")
    if audio_logits.shape[0] != num_seqs or (text_shape is not None and text_shape[0] != num_seqs):
        raise ValueError(
            f"got {num_seqs} samplers but text logits for {None if text_shape is None else text_shape[0]} rows "
            f"and audio logits for {audio_logits.shape[0]} rows"
        )
    if audio_logits.shape[1] <= EOSP_ID:
        raise ValueError(f"audio logits need more than {EOSP_ID} columns, got {audio_logits.shape[1]}")
    if text_logits is not None and text_logits.device != audio_logits.device:
        raise ValueError(f"text logits on {text_logits.device} but audio logits on {audio_logits.device}")
    device = audio_logits.device
    if num_seqs == 0:
        return LaunchedRows([], [], [], [], torch.zeros(0, dtype=torch.long), None)
    uniforms = to_device(torch.tensor([s._draw_uniforms() for s in samplers], dtype=torch.float32), device)  # [S, 2]

    audio = _float32_copy(audio_logits)  # [S, Va]
    audio[:, EOSP_ID + 1 :] = -math.inf  # ids above EOSP are never generated
    blocked = [i for i, s in enumerate(samplers) if s.num_generated < s.min_new_tokens]
    if blocked:
        rows = to_device(torch.tensor(blocked), device) if len(blocked) < num_seqs else slice(None)
        audio[rows, EOSP_ID] = -math.inf
    audio_params = [s.audio_params for s in samplers]
    audio = _penalise_channel(audio, [s._audio_history for s in samplers], audio_params)
    draws = [(audio, audio_params, uniforms[:, 1])]  # per channel: (logits, params, uniforms)

    # Audio-mode rows get MODALITY_PAD as their text token whatever is sampled: skip their text channel.
    text_index = None
    if text_rows:
        assert text_logits is not None  # checked above
        text_uniforms = uniforms[:, 0]
        if len(text_rows) < num_seqs:
            text_index = to_device(torch.tensor(text_rows, dtype=torch.long), device)
            text = text_logits.index_select(0, text_index).float()  # a copy already
            text_uniforms = text_uniforms.index_select(0, text_index)
        else:
            text = _float32_copy(text_logits)
        text_params = [samplers[i].text_params for i in text_rows]
        text = _penalise_channel(text, [samplers[i]._text_history for i in text_rows], text_params)
        draws.append((text, text_params, text_uniforms))
    results = [_sample_tokens(*draw) for draw in draws]  # ids [S] (audio), then [T] (text)
    flags = [torch.zeros_like(ids, dtype=torch.bool) if ties is None else ties for ids, ties in results]
    # a row whose largest logit is NaN or +-inf (amax propagates NaN) has no valid draw: flagged, not sampled
    broken = [~torch.isfinite(logits.amax(dim=-1)) for logits, _, _ in draws]
    read = torch.cat([ids for ids, _ in results] + flags + broken)  # ids, ties_past_k flags, broken flags
    ready = None
    if device.type == "cuda":
        host = torch.empty(read.shape, dtype=read.dtype, pin_memory=True)
        host.copy_(read, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        read = host
    launched = LaunchedRows(samplers, text_rows, results, draws, read, ready)
    if next_inputs:
        launched.next_tokens, launched.next_is_audio = _next_inputs(
            results[0][0], results[1][0] if text_rows else None, text_index)
    return launched


def _float32_copy(logits: torch.Tensor) -> torch.Tensor:
    """A float32 copy of `logits` (widened, or cloned when already float32): the caller may overwrite its
    logits once sampling is launched, and a redraw reads the copy later."""
    return logits.clone() if logits.dtype == torch.float32 else logits.float()


def _next_inputs(
    audio_ids: torch.Tensor, text_ids: torch.Tensor | None, text_index: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token each sampled row embeds next and whether it is the audio one, on the device. A row sampled
    in audio mode is (MODALITY_PAD, audio id), one sampled in text mode (text id, audio id), and a row whose
    text is the modality pad embeds its audio token (`model.split_rows`). `text_ids` holds the text-mode rows
    (None: there are none), at `text_index` among all rows (None: every row)."""
    if text_ids is None:
        return audio_ids, torch.ones_like(audio_ids, dtype=torch.bool)
    if text_index is not None:
        text_ids = torch.full_like(audio_ids, MODALITY_PAD_ID).index_copy_(0, text_index, text_ids)
    is_audio = text_ids == MODALITY_PAD_ID
    return torch.where(is_audio, audio_ids, text_ids), is_audio


def _penalise_channel(
    logits: torch.Tensor, histories: list[_ChannelHistory], params: list[SamplingParams]
) -> torch.Tensor:
    """Apply each request's repetition penalty over its own channel history (skipped when all are 1.0)."""
    if all(p.repetition_penalty == 1.0 for p in params):
        return logits
    num_seqs, vocab_size = logits.shape
    for history in histories:
        history.check_vocab(vocab_size)
    ids = [h.ids() for h in histories]
    rows = np.repeat(np.arange(num_seqs, dtype=np.int64), [len(i) for i in ids])
    where = to_device(torch.from_numpy(rows * vocab_size + np.concatenate(ids)), logits.device)  # [total] flat
    # (index_fill_ takes the value as a kernel argument; `seen[rows, ids] = True` copies it from pageable
    # memory, which waits for everything queued before it, the forward pass included)
    seen = torch.zeros(num_seqs * vocab_size, dtype=torch.bool, device=logits.device).index_fill_(0, where, True)
    seen = seen.view(num_seqs, vocab_size)  # [S, V]
    penalties = to_device(torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype), logits.device)
    return apply_repetition_penalty(logits, seen, penalties)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalties: torch.Tensor) -> torch.Tensor:
    """HF repetition penalty, batched: where ``seen``, positive logits / penalty, the others * penalty.

    ``logits`` [S, V] float, ``seen`` [S, V] bool (ids in each row's history), ``penalties`` [S].
    Returns a new tensor; the input is not modified.
    """
    penalty = penalties.to(logits.dtype).unsqueeze(1)  # [S, 1]
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)  # [S, V]
    return torch.where(seen, penalised, logits)


def sample_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: torch.Tensor) -> torch.Tensor:
    """Pick one id per row of ``logits`` [S, V] (masks and penalty already applied) -> LongTensor [S].

    Greedy rows (temperature 0) take the argmax, lowest index on ties; ``uniforms`` [S] in [0, 1) drive
    the other rows, which draw by inverse CDF so the result is a pure function of logits and uniforms.

    Sampled rows: temperature, then top-k (ties with the k-th value kept, as HF), then top-p over the
    renormalised top-k set (keep the smallest prefix of the descending order whose mass reaches top_p, always
    at least one), then the first sorted id whose cumulative probability exceeds ``u * total``.
    """
    tokens, ties_past_k = _sample_tokens(logits, params, uniforms)
    if ties_past_k is not None and bool(ties_past_k.any()):
        return _sample_tokens(logits, params, uniforms, full_sort=True)[0]
    return tokens


def _sample_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: torch.Tensor, *, full_sort: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`sample_tokens` without waiting for the GPU -> (ids [S], ties_past_k [S] bool or None).

    For top-k up to TOPK_FAST_MAX the draw runs over `torch.topk`'s k_max + TOPK_TIE_MARGIN candidates instead
    of a sort of the whole vocabulary. That is exact unless some row has more ids at or above its k-th value
    than there are candidates (HF keeps every id tied with the k-th): `ties_past_k` flags such rows, and the
    caller, once it reads the ids anyway, redraws the whole batch with `full_sort=True` (the result the full
    sort gives; rare: it needs more than TOPK_TIE_MARGIN ids tied with a k-th value).
    None: the full sort ran (or every row is greedy), nothing to check."""
    if logits.dim() != 2 or len(params) != logits.shape[0] or tuple(uniforms.shape) != (logits.shape[0],):
        raise ValueError(
            f"need logits [S, V] with one SamplingParams and one uniform per row, got logits "
            f"{tuple(logits.shape)}, {len(params)} params, uniforms {tuple(uniforms.shape)}"
        )
    greedy = logits.argmax(dim=-1)  # [S]; first maximal index on ties
    if all(p.is_greedy for p in params):
        return greedy, None
    device = logits.device
    vocab_size = logits.shape[1]
    ks = [1 if p.is_greedy else p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    settings = to_device(torch.tensor(
        [[1.0 if p.is_greedy else p.temperature, k, p.top_p if p.top_p < 1.0 else math.inf, p.is_greedy]
         for p, k in zip(params, ks, strict=True)], dtype=torch.float32,
    ), device)  # [S, 4]: temperature, top-k, top-p, greedy
    temps, top_ks, top_ps = settings[:, 0], settings[:, 1].long(), settings[:, 2]
    is_greedy = settings[:, 3].bool()

    scaled = logits / temps.unsqueeze(1)  # [S, V]
    ties_past_k = None
    k_max = max(ks)
    if k_max <= TOPK_FAST_MAX and not full_sort:
        num_candidates = min(vocab_size, k_max + TOPK_TIE_MARGIN)
        values, ids = scaled.topk(num_candidates, dim=-1)  # [S, C], descending
        kth = values.gather(1, (top_ks - 1).unsqueeze(1))  # [S, 1]
        # HF keeps every id tied with the k-th value: the candidates hold them all unless more ids than
        # candidates reach the k-th value; such rows need the full sort (see the docstring; checked by the
        # caller, with no wait here)
        ties_past_k = ((scaled >= kth).sum(dim=-1) > num_candidates) & ~is_greedy  # [S]
        by_id, order = ids.sort(dim=-1)  # equal values in id order, as the full stable sort has them
        sorted_logits, order = values.gather(1, order).sort(dim=-1, descending=True, stable=True)
        sorted_ids = by_id.gather(1, order)  # [S, C]
    else:
        sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)  # [S, V] each
    kth = sorted_logits.gather(1, (top_ks - 1).unsqueeze(1))  # [S, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -math.inf)
    probs = sorted_logits.softmax(dim=-1)  # [S, K]
    mass_before = probs.cumsum(dim=-1) - probs  # [S, K] probability of strictly higher-ranked ids
    outside_top_p = mass_before >= top_ps.unsqueeze(1)  # [S, K]
    outside_top_p[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(outside_top_p, -math.inf)

    probs = sorted_logits.softmax(dim=-1)  # [S, K]; kept ids form a prefix of the sorted order
    cdf = probs.cumsum(dim=-1)  # [S, K]
    targets = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)  # [S, 1]
    picked = torch.searchsorted(cdf, targets, right=True).squeeze(1)  # [S]
    num_positive = (probs > 0).sum(dim=-1)  # [S]
    picked = torch.minimum(picked, num_positive - 1)  # guard against float rounding at the top
    # A row without a finite logit has no positive probability (num_positive 0): keep its gather in bounds
    # (an out-of-bounds index is a device-side assert that ends the process); `launch_next_rows` flags it.
    picked = picked.clamp(min=0)
    sampled = sorted_ids.gather(1, picked.unsqueeze(1)).squeeze(1)  # [S]
    return torch.where(is_greedy, greedy, sampled), ties_past_k


def _check_row(row: Row) -> Row:
    """Validate one prompt row: a pair of non-negative ints."""
    if not isinstance(row, (tuple, list)) or len(row) != 2:
        raise ValueError(f"a prompt row must be a (text, audio) pair, got {row!r}")
    try:
        text, audio = (operator.index(v) for v in row)
    except TypeError:
        raise ValueError(f"row tokens must be integers, got {row!r}") from None
    if text < 0 or audio < 0 or isinstance(row[0], bool) or isinstance(row[1], bool):
        raise ValueError(f"row tokens must be non-negative integers, got {row!r}")
    return (text, audio)
