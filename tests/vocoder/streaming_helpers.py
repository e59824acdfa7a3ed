"""Helpers shared by the streaming test modules (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import dataclasses

import numpy as np

from vocoder import SAMPLES_PER_CODE, StreamingVocoder, VocoderConfig

NUM_CODES = 30
SEED = 7
# The short chunk schedule the warm-up tests walk (a warm-up runs every row count through the whole schedule
# and every tail, ~20 ms a step on the CPU). One row count of it, one code per step: 2 + 3 + 3 + 3 = 11 codes
# for the whole schedule and a repeat of its last chunk (tail 3), then 5 + n for the tails n = 4 and 5. The
# three tails take distinct (bucketed flow codes, BigVGAN window 20 + 4n) pairs both in this schedule's own
# buckets ((3, 32), (4, 64), (8, 64): code buckets 1, 2, 3, 4, 8; windows 24, 32 and powers of two) and in the
# default schedule's ((3, 32), (4, 40), (5, 40)).
SHORT = (2, 3)
SHORT_WALK_STEPS = 11 + 9 + 10


def short_schedule_config(schedule: tuple[int, ...] = SHORT) -> VocoderConfig:
    """tiny with another low-latency chunk schedule (the warm-up tests walk a short one)."""
    cfg = VocoderConfig.preset("tiny")
    return dataclasses.replace(cfg, stream=dataclasses.replace(cfg.stream, chunk_schedule_codes=schedule))


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
