"""Per-request, per-channel sampling of the next (text, audio) row.

Semantics follow the facts sheet and Hugging Face ``generate``:

- both channels are sampled at every step, each with its own :class:`SamplingParams`;
- processing order per channel: masks, repetition penalty, temperature, top-k, top-p, then the draw;
- audio logits above EOSP (16385..) are always masked; EOSP is masked while fewer than ``min_new_tokens``
  rows have been generated;
- repetition penalty (HF semantics) covers each channel's own history: the prompt rows and the generated
  rows of that channel, as appended (so the text history holds MODALITY_PAD for rows sampled in audio
  mode, and the audio history holds AUDIO_PAD for prompt text rows);
- temperature 0 means greedy: argmax after masks and penalty, ties to the lowest index;
- in audio mode the sampled text token is overwritten with MODALITY_PAD (see :mod:`runtime.modality`).

Reproducibility: each :class:`RequestSampler` owns a ``torch.Generator`` seeded from its seed and draws
exactly two uniforms per step (text, then audio) from it, even for greedy channels, so a request's samples
do not depend on which other requests share the batch, on their order, or on the other channel's settings.
The generator lives on the logits' device (created on the first step), so the same seed gives different
streams on CPU and on CUDA.

Vectorisation: the math runs once over the whole batch on the logits' device. The repetition penalty uses a
per-request boolean presence mask per channel (``[V]`` on the device, updated as rows are appended) stacked to
``[S, V]`` and applied with ``torch.where``; this gives the same values as HF's gather/scatter without
rebuilding padded id lists from Python every step.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.config import ENDOFTEXT_ID, EOSP_ID, IM_END_ID, Row
from runtime.modality import Mode, apply_modality, is_output_code, next_mode, replay_mode

_MAX_SEED = 2**64


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
            try:
                is_finite = math.isfinite(value)
            except TypeError:
                raise ValueError(f"{name} must be a number, got {value!r}") from None
            if not is_finite:
                raise ValueError(f"{name} must be finite, got {value!r}")
        try:
            operator.index(self.top_k)
        except TypeError:
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}") from None
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables top-k), got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def is_greedy(self) -> bool:
        """Whether this channel takes the argmax instead of drawing."""
        return self.temperature == 0


class _ChannelHistory:
    """Distinct token ids seen on one channel, as a presence mask on the logits' device."""

    def __init__(self, name: str, prompt_ids: Sequence[int]) -> None:
        self.name = name
        self._pending: list[int] = list(prompt_ids)  # ids not yet written into the mask
        self._mask: torch.Tensor | None = None  # [V] bool, created on the first step

    def mask(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """Return the ``[V]`` presence mask, folding in ids appended since the last call."""
        if self._mask is None:
            self._mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        elif self._mask.shape[0] != vocab_size or self._mask.device != device:
            raise ValueError(
                f"{self.name} logits changed from {self._mask.shape[0]} ids on {self._mask.device} "
                f"to {vocab_size} ids on {device} during one request"
            )
        if self._pending:
            bad = [i for i in self._pending if not 0 <= i < vocab_size]
            if bad:
                raise ValueError(f"{self.name} history holds ids outside [0, {vocab_size}): {bad[:5]}")
            self._mask[torch.tensor(self._pending, dtype=torch.long, device=device)] = True
            self._pending.clear()
        return self._mask

    def append(self, token: int) -> None:
        self._pending.append(token)


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
        self._generator: torch.Generator | None = None

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

    def _draw_uniforms(self, device: torch.device) -> torch.Tensor:
        """Two uniforms in [0, 1) from this request's generator: [text, audio]."""
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        elif self._generator.device != device:
            raise ValueError(f"logits moved from {self._generator.device} to {device} during one request")
        return torch.rand(2, generator=self._generator, device=device, dtype=torch.float32)  # [2]

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
    text_logits: torch.Tensor, audio_logits: torch.Tensor, samplers: list[RequestSampler]
) -> list[Row]:
    """Sample one row per request, append it to that request's sampler, and return the rows.

    ``text_logits`` is ``[S, Vt]`` and ``audio_logits`` is ``[S, Va]`` (float, any device), row ``i`` belonging
    to ``samplers[i]``. The inputs are not modified. Each request's result depends only on its own logits,
    state and seed, never on the rest of the batch.
    """
    num_seqs = len(samplers)
    if text_logits.dim() != 2 or audio_logits.dim() != 2:
        raise ValueError(
            f"logits must be 2-D [S, V], got text {tuple(text_logits.shape)} audio {tuple(audio_logits.shape)}"
        )
    if text_logits.shape[0] != num_seqs or audio_logits.shape[0] != num_seqs:
        raise ValueError(
            f"got {num_seqs} samplers but text logits for {text_logits.shape[0]} rows "
            f"and audio logits for {audio_logits.shape[0]} rows"
        )
    if audio_logits.shape[1] <= EOSP_ID:
        raise ValueError(f"audio logits need more than {EOSP_ID} columns, got {audio_logits.shape[1]}")
    if text_logits.device != audio_logits.device:
        raise ValueError(f"text logits on {text_logits.device} but audio logits on {audio_logits.device}")
    if num_seqs == 0:
        return []
    device = text_logits.device
    uniforms = torch.stack([s._draw_uniforms(device) for s in samplers])  # [S, 2]

    audio = audio_logits.float().clone()  # [S, Va]
    audio[:, EOSP_ID + 1 :] = -math.inf  # ids above EOSP are never generated
    eosp_blocked = torch.tensor([s.num_generated < s.min_new_tokens for s in samplers], device=device)  # [S]
    audio[:, EOSP_ID] = audio[:, EOSP_ID].masked_fill(eosp_blocked, -math.inf)

    text_params = [s.text_params for s in samplers]
    audio_params = [s.audio_params for s in samplers]
    text = _penalise_channel(text_logits.float(), [s._text_history for s in samplers], text_params)
    audio = _penalise_channel(audio, [s._audio_history for s in samplers], audio_params)

    text_tokens = sample_tokens(text, text_params, uniforms[:, 0]).tolist()
    audio_tokens = sample_tokens(audio, audio_params, uniforms[:, 1]).tolist()
    return [s._append(t, a) for s, t, a in zip(samplers, text_tokens, audio_tokens, strict=True)]


def _penalise_channel(
    logits: torch.Tensor, histories: list[_ChannelHistory], params: list[SamplingParams]
) -> torch.Tensor:
    """Apply each request's repetition penalty over its own channel history (skipped when all are 1.0)."""
    if all(p.repetition_penalty == 1.0 for p in params):
        return logits
    vocab_size = logits.shape[1]
    seen = torch.stack([h.mask(vocab_size, logits.device) for h in histories])  # [S, V] bool
    penalties = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype, device=logits.device)
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
    if logits.dim() != 2 or len(params) != logits.shape[0] or tuple(uniforms.shape) != (logits.shape[0],):
        raise ValueError(
            f"need logits [S, V] with one SamplingParams and one uniform per row, got logits "
            f"{tuple(logits.shape)}, {len(params)} params, uniforms {tuple(uniforms.shape)}"
        )
    greedy = logits.argmax(dim=-1)  # [S]; first maximal index on ties
    if all(p.is_greedy for p in params):
        return greedy
    device = logits.device
    vocab_size = logits.shape[1]
    temps = torch.tensor([p.temperature if not p.is_greedy else 1.0 for p in params], device=device)  # [S]
    top_ks = torch.tensor(
        [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], device=device
    )  # [S]
    top_ps = torch.tensor([p.top_p if p.top_p < 1.0 else math.inf for p in params], device=device)  # [S]

    scaled = logits / temps.unsqueeze(1)  # [S, V]
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)  # [S, V] each
    kth = sorted_logits.gather(1, (top_ks - 1).unsqueeze(1))  # [S, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -math.inf)
    probs = sorted_logits.softmax(dim=-1)  # [S, V]
    mass_before = probs.cumsum(dim=-1) - probs  # [S, V] probability of strictly higher-ranked ids
    outside_top_p = mass_before >= top_ps.unsqueeze(1)  # [S, V]
    outside_top_p[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(outside_top_p, -math.inf)

    probs = sorted_logits.softmax(dim=-1)  # [S, V]; kept ids form a prefix of the sorted order
    cdf = probs.cumsum(dim=-1)  # [S, V]
    targets = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)  # [S, 1]
    picked = torch.searchsorted(cdf, targets, right=True).squeeze(1)  # [S]
    num_positive = (probs > 0).sum(dim=-1)  # [S]
    picked = torch.minimum(picked, num_positive - 1)  # guard against float rounding at the top
    sampled = sorted_ids.gather(1, picked.unsqueeze(1)).squeeze(1)  # [S]
    is_greedy = torch.tensor([p.is_greedy for p in params], device=device)  # [S]
    return torch.where(is_greedy, greedy, sampled)


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
