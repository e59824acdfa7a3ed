"""Helpers shared by the streaming test modules (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import numpy as np

from vocoder import SAMPLES_PER_CODE, StreamingVocoder

NUM_CODES = 30
SEED = 7


def stream(
    voc: StreamingVocoder, codes: list[int], schedule: list[int], seed: int = SEED
) -> list[np.ndarray]:
    """Push `codes` in pieces of the sizes in `schedule`, then finish: the chunks returned, in order."""
    session = voc.open("default", seed=seed)
    chunks, i = [], 0
    for n in schedule:
        chunks.append(voc.push(session, codes[i : i + n]))
        i += n
    assert i == len(codes)
    chunks.append(voc.finish(session))
    assert session.num_samples_emitted == len(codes) * SAMPLES_PER_CODE
    return chunks


def run_staggered(
    voc: StreamingVocoder, codes: list[int], starts: list[int], lengths: list[int], num_steps: int
) -> tuple[list[np.ndarray], list[object]]:
    """Streams i open at step starts[i] (seed SEED + i) and take one code per step in shared `step` calls
    until lengths[i] codes, then finish (together with any ending at the same step) -> (each stream's PCM,
    its session)."""
    n = len(starts)
    sessions: dict[int, object] = {}
    out: dict[int, list[np.ndarray]] = {i: [] for i in range(n)}
    for t in range(num_steps):
        work = []
        for i in range(n):
            if t == starts[i]:
                sessions[i] = voc.open("default", seed=SEED + i)
            k = t - starts[i]
            if i in sessions and 0 <= k < lengths[i]:
                work.append((i, codes[k : k + 1]))
        if work:
            for (i, _), pcm in zip(work, voc.step([(sessions[i], c) for i, c in work]), strict=True):
                out[i].append(pcm)
        done = [i for i in range(n) if i in sessions and t - starts[i] == lengths[i]]
        for i, tail in zip(done, voc.finish_many([sessions[i] for i in done]), strict=True):
            out[i].append(tail)
    return [np.concatenate(out[i]) for i in range(n)], [sessions[i] for i in range(n)]
