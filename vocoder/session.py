"""Per-stream state of the streaming decoder and input checks."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vocoder.config import MEL_FRAMES_PER_CODE, NUM_AUDIO_CODES
from vocoder.voices import Voice


@dataclass(eq=False)
class VocoderSession:
    """One stream. Holds only what later output depends on (see docs/vocoder.md, "State per session").

    Frame and code indices are absolute over prompt + generated (the prompt occupies codes [0, P) and
    frames [0, 4P)); PCM is produced only for generated frames.
    """

    voice: Voice
    seed: int
    slot: int  # row of the flow state pool: per Euler step, the estimator's causal-conv caches
    speaker: torch.Tensor  # [80] projected speaker embedding
    codes: list[int]  # bounded code history: absolute positions [codes_start, num_codes)
    codes_start: int
    num_codes: int  # prompt + pushed codes
    flow_cursor: int  # codes whose mel is final (flow integrated); their frames are [0, 4 * flow_cursor)
    mel: torch.Tensor  # [80, F] vocoder input history: absolute frames [mel_start, mel_start + F)
    mel_start: int
    emitted_frames: int  # absolute frame up to which PCM has been computed (starts at 4P)
    num_samples_emitted: int = 0
    num_chunks: int = 0  # chunks computed so far (low latency: index into the chunk schedule)
    # low latency: the last samples computed before `emitted_frames`, not yet returned (crossfaded later)
    held: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    is_closed: bool = False
    lane: int = 0  # the StreamingVocoder lane of its last call (its tensors were made on that lane's stream)
    schedule: tuple[int, ...] = ()  # low latency: the chunk sizes (codes) it follows, fixed at open
    owner: int = 0  # id() of the StreamingVocoder that opened it: its slot means something only there

    @property
    def num_prompt_codes(self) -> int:
        """P."""
        return self.voice.num_prompt_codes

    @property
    def num_codes_pushed(self) -> int:
        """Generated codes pushed so far."""
        return self.num_codes - self.num_prompt_codes

    @property
    def mel_end(self) -> int:
        """One past the last absolute frame in the vocoder mel history."""
        return self.mel_start + self.mel.shape[1]

    @property
    def is_first_chunk_pending(self) -> bool:
        """True until the first PCM has been returned."""
        return self.emitted_frames == MEL_FRAMES_PER_CODE * self.num_prompt_codes


def check_codes(codes: Sequence[int]) -> list[int]:
    """Codes as a list of ints in 0..NUM_AUDIO_CODES-1; ValueError otherwise (EOSP 16384 included)."""
    if (
        isinstance(codes, str | bytes)
        or not isinstance(codes, Sequence | torch.Tensor)
        and not hasattr(codes, "__array__")
    ):
        raise ValueError(f"codes must be a sequence of ints, got {type(codes).__name__}")
    if getattr(codes, "ndim", 1) != 1:
        raise ValueError(f"codes must be one-dimensional, got shape {tuple(codes.shape)}")
    out = []
    for i, code in enumerate(codes):
        raw = code.item() if hasattr(code, "item") else code
        if isinstance(raw, bool):  # an int to operator.index, never a code
            raise ValueError(f"codes[{i}] = {code!r} is a boolean, not a code")  # noqa: TRY004 - every bad code is one
        try:
            value = operator.index(raw)
        except TypeError:
            raise ValueError(f"codes[{i}] = {code!r} is not an integer") from None
        if not 0 <= value < NUM_AUDIO_CODES:
            raise ValueError(f"codes[{i}] = {value} is out of range 0..{NUM_AUDIO_CODES - 1}")
        out.append(value)
    return out
