"""Low-latency chunking: where chunks end (a fixed schedule over code positions) and how their ends are joined."""

from __future__ import annotations

import numpy as np

from vocoder.config import MEL_FRAMES_PER_CODE


def scheduled_chunk_ends(
    emitted_frames: int,
    num_chunks: int,
    final_frames: int,
    schedule: tuple[int, ...],
    right_context: int,
) -> list[int]:
    """Ends (absolute frames) of the scheduled chunks that can be computed now, in order.

    Chunk k spans `schedule[min(k, -1)]` codes after the previous one; it can be computed once the final
    mel reaches its end plus `right_context` frames. Boundaries depend only on the code count, never on
    how codes were pushed, so the audio of a stream is a function of its codes.
    """
    ends = []
    end, k = emitted_frames, num_chunks
    while True:
        size = MEL_FRAMES_PER_CODE * schedule[min(k, len(schedule) - 1)]
        if end + size + right_context > final_frames:
            return ends
        end += size
        k += 1
        ends.append(end)


def crossfade_weights(num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(fade_in, fade_out), float32 [num_samples]: raised cosine, fade_in + fade_out == 1 exactly."""
    phase = (np.arange(num_samples, dtype=np.float64) + 0.5) / max(num_samples, 1)
    fade_in = np.sin(0.5 * np.pi * phase) ** 2
    return fade_in.astype(np.float32), (1.0 - fade_in).astype(np.float32)


def join_chunk(
    held: np.ndarray,
    new: np.ndarray,
    fade_in: np.ndarray,
    fade_out: np.ndarray,
    hold: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(samples to return, samples to hold back) for a chunk whose PCM `new` starts where `held` starts.

    The first len(held) samples of `new` recompute the held ones with more right context: they are
    crossfaded (old fading out), then the last `hold` samples are kept for the next chunk.
    """
    out = new.copy()
    n = len(held)
    if n:
        assert n == len(fade_in) and len(out) >= n, (n, len(fade_in), len(out))
        out[:n] = fade_out * held + fade_in * out[:n]
    assert len(out) >= hold, (len(out), hold)
    cut = len(out) - hold
    return out[:cut], out[cut:].copy()
