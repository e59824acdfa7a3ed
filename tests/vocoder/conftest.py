"""Vocoder tests run torch on one thread: the CI box has 2 shared cores and OpenMP spinning hurts.

Also the pieces the streaming test modules share: a fixed code sequence, its whole-sequence decode by the
module's own `vocoder` fixture (exact or low latency) (`streaming_helpers.stream` pushes it on a schedule)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from streaming_helpers import NUM_CODES, SEED

from vocoder import StreamingVocoder


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def codes() -> list[int]:
    return np.random.default_rng(0).integers(0, 16384, NUM_CODES).tolist()


@pytest.fixture(scope="module")
def reference(vocoder: StreamingVocoder, codes: list[int]) -> np.ndarray:
    return vocoder.decode_whole("default", codes, seed=SEED)

