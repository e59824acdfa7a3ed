"""Streaming decoder on the tiny preset: exact lengths, streamed == whole, batching, seams, edge cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vocoder import SAMPLES_PER_CODE, StreamingVocoder

# Streamed PCM equals decode_whole up to float32 rounding (different conv lengths / batch shapes).
TOLERANCE = 1e-5
NUM_CODES = 24
SEED = 7


@pytest.fixture(scope="module")
def vocoder() -> StreamingVocoder:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CI box has 2 cores shared with other suites; OpenMP spinning hurts
    yield StreamingVocoder.from_preset("tiny")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def codes() -> list[int]:
    return np.random.default_rng(0).integers(0, 16384, NUM_CODES).tolist()


@pytest.fixture(scope="module")
def reference(vocoder: StreamingVocoder, codes: list[int]) -> np.ndarray:
    return vocoder.decode_whole("default", codes, seed=SEED)


def stream(vocoder: StreamingVocoder, codes: list[int], schedule: list[int], seed: int = SEED) -> list[np.ndarray]:
    session = vocoder.open("default", seed=seed)
    chunks, i = [], 0
    for n in schedule:
        chunks.append(vocoder.push(session, codes[i : i + n]))
        i += n
    assert i == len(codes)
    chunks.append(vocoder.finish(session))
    return chunks


def test_reference_is_audio(reference: np.ndarray) -> None:
    assert reference.dtype == np.float32
    assert reference.shape == (NUM_CODES * SAMPLES_PER_CODE,)
    assert np.isfinite(reference).all()
    assert 0.01 < float(reference.std()) < 0.5  # not silence, not clipping
    assert float(np.abs(reference).max()) <= 1.0


@pytest.mark.parametrize(
    "schedule",
    [[1] * NUM_CODES, [2] * 12, [5] * 4 + [4], [NUM_CODES], [3, 1, 7, 2, 0, 11]],
    ids=["by1", "by2", "by5", "all", "irregular"],
)
def test_streamed_equals_whole(
    vocoder: StreamingVocoder, codes: list[int], reference: np.ndarray, schedule: list[int]
) -> None:
    chunks = stream(vocoder, codes, schedule)
    pcm = np.concatenate(chunks)
    assert all(c.dtype == np.float32 for c in chunks)
    assert len(pcm) == SAMPLES_PER_CODE * NUM_CODES
    assert float(np.abs(pcm - reference).max()) < TOLERANCE
