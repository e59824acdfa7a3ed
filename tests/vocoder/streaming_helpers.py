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
