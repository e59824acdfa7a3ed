"""Streaming decoder on the tiny preset: exact lengths, streamed == whole, batching, seams, edge cases."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from streaming_helpers import NUM_CODES, SEED, stream

from vocoder import SAMPLES_PER_CODE, StreamingVocoder, VocoderConfig

# Streamed PCM equals decode_whole up to float32 rounding (different conv lengths / batch shapes).
TOLERANCE = 1e-5


def exact_config() -> VocoderConfig:
    """tiny in the exact streaming mode (the default is low latency: tests/vocoder/test_low_latency.py)."""
    cfg = VocoderConfig.preset("tiny")
    return dataclasses.replace(cfg, stream=dataclasses.replace(cfg.stream, latency="exact"))


@pytest.fixture(scope="module")
def vocoder() -> StreamingVocoder:
    return StreamingVocoder.from_preset("tiny", config=exact_config())




def test_reference_is_audio(reference: np.ndarray) -> None:
    assert reference.dtype == np.float32
    assert reference.shape == (NUM_CODES * SAMPLES_PER_CODE,)
    assert np.isfinite(reference).all()
    assert 0.01 < float(reference.std()) < 0.5  # not silence, not clipping
    assert float(np.abs(reference).max()) <= 1.0


@pytest.mark.parametrize(
    "schedule",
    [[1] * NUM_CODES, [2] * 15, [5] * 6, [25, 5], [NUM_CODES], [3, 1, 7, 2, 0, 11, 6]],
    ids=["by1", "by2", "by5", "by25", "all", "irregular"],
)
def test_streamed_equals_whole(
    vocoder: StreamingVocoder, codes: list[int], reference: np.ndarray, schedule: list[int]
) -> None:
    chunks = stream(vocoder, codes, schedule)
    pcm = np.concatenate(chunks)
    assert all(c.dtype == np.float32 for c in chunks)
    assert len(pcm) == SAMPLES_PER_CODE * NUM_CODES
    assert float(np.abs(pcm - reference).max()) < TOLERANCE


def test_chunk_sizes_follow_the_schedule(vocoder: StreamingVocoder, codes: list[int]) -> None:
    # tiny: 12 prompt codes (frames 0..47), BigVGAN right context 16 frames, first chunk >= 2 codes
    # (8 frames), later chunks >= 8 codes (32 frames). After k codes pushed one by one, final mel ends at
    # 4 * (12 + k - 3) and PCM is final up to frame 4 * (9 + k) - 16 = 4k + 20. First chunk at k = 9
    # (frames 48..56), then k = 17 (56..88) and k = 25 (88..120); finish flushes frames 120..168.
    assert (vocoder.left_context, vocoder.right_context) == (16, 16)
    chunks = stream(vocoder, codes, [1] * NUM_CODES)
    sizes = {i + 1: len(c) for i, c in enumerate(chunks) if len(c)}
    assert sizes == {9: 8 * 480, 17: 32 * 480, 25: 32 * 480, NUM_CODES + 1: 48 * 480}


def test_step_batches_sessions_without_changing_their_audio(
    vocoder: StreamingVocoder, codes: list[int], reference: np.ndarray
) -> None:
    other_codes = np.random.default_rng(1).integers(0, 16384, 17).tolist()
    other_ref = vocoder.decode_whole("default", other_codes, seed=99)
    alone = stream(vocoder, codes, [5] * 6)

    batch_sizes: list[int] = []
    hook = vocoder.generator.register_forward_hook(lambda m, i, o: batch_sizes.append(o.shape[0]))
    # `idle` is in every step but never gets codes.
    a, b, idle = vocoder.open_many([("default", SEED), ("default", 99), ("default", 3)])
    out_a, out_b = [], []
    schedule_b = [1, 7, 0, 2, 3, 4]
    for i, n_b in enumerate(schedule_b):
        work = [(idle, []), (b, other_codes[sum(schedule_b[:i]) : sum(schedule_b[: i + 1])])]
        work.insert(1, (a, codes[5 * i : 5 * i + 5]))
        pcm = vocoder.step(work)
        assert len(pcm) == len(work) and len(pcm[0]) == 0
        out_a.append(pcm[1])
        out_b.append(pcm[-1])
    tails = vocoder.finish_many([a, b, idle])
    out_a.append(tails[0])
    out_b.append(tails[1])
    assert len(tails[2]) == 0
    hook.remove()
    assert max(batch_sizes) >= 2  # a and b really shared BigVGAN forwards

    # Same chunking as alone -> same chunk lengths; batch neighbours change nothing beyond rounding.
    assert [len(c) for c in out_a] == [len(c) for c in alone]
    for mine, solo in zip(out_a, alone):
        assert float(np.abs(mine - solo).max(initial=0.0)) < TOLERANCE
    assert float(np.abs(np.concatenate(out_a) - reference).max()) < TOLERANCE
    pcm_b = np.concatenate(out_b)
    assert len(pcm_b) == 17 * SAMPLES_PER_CODE
    assert float(np.abs(pcm_b - other_ref).max()) < TOLERANCE


def test_no_seams_at_chunk_boundaries(
    vocoder: StreamingVocoder, codes: list[int], reference: np.ndarray
) -> None:
    chunks = stream(vocoder, codes, [2] * 15)
    pcm = np.concatenate(chunks)
    bounds = np.cumsum([len(c) for c in chunks if len(c)])[:-1]
    assert len(bounds) >= 2
    jumps = np.abs(np.diff(pcm))
    inside = np.delete(jumps, bounds - 1)
    assert float(jumps[bounds - 1].max()) <= float(inside.max())
    assert np.allclose(jumps[bounds - 1], np.abs(np.diff(reference))[bounds - 1], atol=2 * TOLERANCE)


def test_seed_and_voice_change_the_audio(
    vocoder: StreamingVocoder, codes: list[int], reference: np.ndarray
) -> None:
    from vocoder.make_default_voice import make_voice

    other_seed = vocoder.decode_whole("default", codes, seed=SEED + 1)
    assert float(np.abs(other_seed - reference).max()) > 100 * TOLERANCE
    if "short" not in vocoder.voices.names():
        vocoder.voices.add(make_voice("short", seed=5, num_prompt_codes=2))  # prompt shorter than lookahead
    short_ref = vocoder.decode_whole("short", codes, seed=SEED)
    assert float(np.abs(short_ref - reference).max()) > 100 * TOLERANCE
    session = vocoder.open("short", seed=SEED)
    pcm = np.concatenate(
        [vocoder.push(session, codes[:10]), vocoder.push(session, codes[10:]), vocoder.finish(session)]
    )
    assert float(np.abs(pcm - short_ref).max()) < TOLERANCE


def test_empty_pushes_and_zero_code_streams(vocoder: StreamingVocoder, codes: list[int]) -> None:
    session = vocoder.open("default", seed=SEED)
    assert len(vocoder.push(session, [])) == 0
    tail = vocoder.finish(session)
    assert tail.dtype == np.float32 and tail.shape == (0,)
    assert session.is_closed
    with pytest.raises(ValueError, match="closed"):
        vocoder.push(session, [1])
    with pytest.raises(ValueError, match="closed"):
        vocoder.finish(session)
    assert len(vocoder.decode_whole("default", [], seed=SEED)) == 0

    one = vocoder.open("default", seed=SEED)
    assert len(vocoder.push(one, [codes[0]])) == 0
    assert len(vocoder.finish(one)) == SAMPLES_PER_CODE


@pytest.mark.parametrize("bad", [[16384], [-1], [1.5], ["7"], [3, 20000]])
def test_bad_codes_raise_and_leave_sessions_untouched(
    vocoder: StreamingVocoder, codes: list[int], reference: np.ndarray, bad: list[object]
) -> None:
    session = vocoder.open("default", seed=SEED)
    other = vocoder.open("default", seed=SEED)
    first = vocoder.push(session, codes[:10])
    with pytest.raises(ValueError, match="codes"):
        vocoder.push(session, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="codes"):
        vocoder.step([(other, codes[:3]), (session, bad)])  # type: ignore[list-item]
    assert other.num_codes_pushed == 0 and session.num_codes_pushed == 10
    pcm = np.concatenate([first, vocoder.push(session, codes[10:]), vocoder.finish(session)])
    assert float(np.abs(pcm - reference).max()) < TOLERANCE
    vocoder.close(other)
    with pytest.raises(ValueError, match="out of range|not an integer"):
        vocoder.decode_whole("default", bad)  # type: ignore[arg-type]


def test_unknown_voice_and_bad_seed(vocoder: StreamingVocoder) -> None:
    with pytest.raises(ValueError, match=r"unknown voice 'nobody'.*default"):
        vocoder.open("nobody")
    with pytest.raises(ValueError, match="unknown voice"):
        vocoder.decode_whole("nobody", [1, 2, 3])
    with pytest.raises(ValueError, match="seed"):
        vocoder.open("default", seed=-1)
    session = vocoder.open("default")
    with pytest.raises(ValueError, match="twice"):
        vocoder.step([(session, [1]), (session, [2])])
    # a session of another vocoder: its slot is a row of that vocoder's pool, another session's here
    other = StreamingVocoder.from_preset("tiny", config=exact_config())
    foreign = other.open("default")
    for call in (lambda: vocoder.push(foreign, [1, 2]), lambda: vocoder.step([(foreign, [1])]),
                 lambda: vocoder.close(foreign)):
        with pytest.raises(ValueError, match="opened by another vocoder"):
            call()
    assert not foreign.is_closed and other.num_open_sessions == 1
    other.close(foreign)
    vocoder.close(session)


def test_session_state_stays_bounded(vocoder: StreamingVocoder) -> None:
    long_codes = np.random.default_rng(2).integers(0, 16384, 120).tolist()
    before = vocoder.num_open_sessions
    session = vocoder.open("default", seed=1)
    total = 0
    for i in range(0, 120, 6):
        total += len(vocoder.push(session, long_codes[i : i + 6]))
        # code history: encoder receptive field + lookahead + one push; mel: left + right context + one chunk
        assert len(session.codes) <= vocoder.history_codes + 3 + 6
        assert session.mel.shape[1] <= vocoder.left_context + vocoder.right_context + 4 * (8 + 6)
    total += len(vocoder.finish(session))
    assert total == 120 * SAMPLES_PER_CODE
    assert vocoder.num_open_sessions == before


def test_measured_context_keeps_streaming_exact(codes: list[int]) -> None:
    from vocoder.mel_vocoder import effective_context_frames

    base = StreamingVocoder.from_preset("tiny", config=exact_config())
    left, right = effective_context_frames(base.generator, tolerance=1e-6)
    assert 0 < left < base.left_context and 0 < right < base.right_context  # field's far taps are negligible
    cfg = exact_config()
    stream_cfg = dataclasses.replace(
        cfg.stream, vocoder_left_context_frames=left + 1, vocoder_right_context_frames=right + 1
    )
    fast = StreamingVocoder.from_preset("tiny", config=dataclasses.replace(cfg, stream=stream_cfg))
    chunks = stream(fast, codes, [2] * 15)
    sizes = {i + 1: len(c) for i, c in enumerate(chunks) if len(c)}
    assert (left, right) == (7, 7)
    assert min(sizes) == 4  # first audio after 4 pushes of 2 codes (5 with the exact field of 16)
    pcm = np.concatenate(chunks)
    assert float(np.abs(pcm - fast.decode_whole("default", codes, seed=SEED)).max()) < TOLERANCE


def test_primed_state_is_reused_for_the_same_voice_and_seed(
    codes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from vocoder import streaming
    from vocoder.make_default_voice import make_voice

    def run(v: StreamingVocoder, voice: str = "default", seed: int = SEED) -> np.ndarray:
        session = v.open(voice, seed=seed)
        return np.concatenate([v.push(session, codes[:7]), v.push(session, codes[7:]), v.finish(session)])

    cold = run(StreamingVocoder.from_preset("tiny"))  # a fresh instance primes
    vocoder = StreamingVocoder.from_preset("tiny")
    first, again = run(vocoder), run(vocoder)
    assert vocoder.num_primed_hits == 1
    assert np.array_equal(first, cold) and np.array_equal(again, cold)
    assert not np.array_equal(run(vocoder, seed=SEED + 1), cold)  # another seed primes anew
    assert vocoder.num_primed_hits == 1
    vocoder.voices.add(make_voice("other", seed=5))
    before = run(vocoder, "other")
    vocoder.voices.add(make_voice("other", seed=6))  # replaced under the same name: no stale priming
    after = run(vocoder, "other")
    assert vocoder.num_primed_hits == 1 and not np.array_equal(before, after)
    fresh = StreamingVocoder.from_preset("tiny")
    fresh.voices.add(make_voice("other", seed=6))
    assert np.array_equal(after, run(fresh, "other"))
    monkeypatch.setattr(streaming, "PRIMED_CACHE_SIZE", 2)
    for seed in range(3):
        run(vocoder, seed=seed)
    assert list(vocoder._primed) == [("default", 1), ("default", 2)]  # least recently used goes first
