"""The light-load chunk schedule (tiny): a session opened while few sessions are open follows a second
schedule, e.g. a smaller first chunk; its lengths stay exact, its audio stays close to the whole decode, and
a warm-up of both schedules covers every shape that traffic mixing them takes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from streaming_helpers import NUM_CODES, SEED, run_staggered

from vocoder import SAMPLES_PER_CODE, StreamingVocoder, VocoderConfig
from vocoder.config import StreamConfig
from vocoder.session import VocoderSession
from vocoder.streaming import build_for_serving

MAIN = (4, 5, 10, 25)
LIGHT = (2, 3, 5, 10, 25)
OVERLAP = 1920
SAME = 1e-5  # float rounding between different batch shapes
OVERALL_TOL = 6e-2  # test_low_latency.py: streamed against decode_whole, tiny, random weights


# the warm-up tests walk these (a warm-up runs every row count through the whole schedule and every tail,
# ~20 ms a step on the CPU)
SHORT_MAIN = (4, 5)
SHORT_LIGHT = (2, 3)


def light_config(max_sessions: int = 1, main: tuple[int, ...] = MAIN, light: tuple[int, ...] = LIGHT
                 ) -> VocoderConfig:
    cfg = VocoderConfig.preset("tiny")
    stream = dataclasses.replace(cfg.stream, chunk_schedule_codes=main, light_load_schedule_codes=light,
                                 light_load_max_sessions=max_sessions)
    return dataclasses.replace(cfg, stream=stream)


@pytest.fixture(scope="module")
def vocoder() -> StreamingVocoder:
    return StreamingVocoder.from_preset("tiny", config=light_config())


def push_one_by_one(voc: StreamingVocoder, session: VocoderSession, codes: list[int]) -> dict[int, int]:
    """Push codes one at a time, then finish: {pushes so far: samples returned} for non-empty returns
    (the finish counts as push len(codes) + 1)."""
    sizes = {}
    for i, code in enumerate(codes):
        if n := len(voc.push(session, [code])):
            sizes[i + 1] = n
    sizes[len(codes) + 1] = len(voc.finish(session))
    return sizes


def test_sessions_opened_while_few_are_open_follow_the_light_schedule(vocoder: StreamingVocoder) -> None:
    assert vocoder.schedules == [MAIN, LIGHT] and vocoder.num_open_sessions == 0
    a = vocoder.open("default", seed=SEED)  # alone: light
    b = vocoder.open("default", seed=SEED)  # two open: main
    vocoder.close(a)
    c = vocoder.open("default", seed=SEED)  # b and c open: main
    vocoder.close(b)
    vocoder.close(c)
    d = vocoder.open("default", seed=SEED)  # alone again: light
    vocoder.close(d)
    pair = vocoder.open_many([("default", SEED), ("default", SEED + 1)])  # two at once: main
    explicit = vocoder.open("default", seed=SEED, schedule=[2, 3])
    assert [s.schedule for s in (a, b, c, d, *pair, explicit)] == [LIGHT, MAIN, MAIN, LIGHT, MAIN, MAIN, (2, 3)]
    for s in (*pair, explicit):
        vocoder.close(s)
    wider = StreamingVocoder.from_preset("tiny", config=light_config(max_sessions=2))
    both = wider.open_many([("default", SEED), ("default", SEED + 1)])
    third = wider.open("default", seed=SEED)
    assert [s.schedule for s in (*both, third)] == [LIGHT, LIGHT, MAIN]
    # the producer sends the codes of the first two chunks at once: the larger count over the schedules
    assert vocoder.codes_for_two_chunks == 3 + 4 + 5


def test_each_schedule_gives_its_chunks_exact_lengths_and_the_whole_decode(
    vocoder: StreamingVocoder, codes: list[int]
) -> None:
    reference = vocoder.decode_whole("default", codes, seed=SEED)
    light = vocoder.open("default", seed=SEED)
    assert light.schedule == LIGHT
    light_sizes = push_one_by_one(vocoder, light, codes)
    main = vocoder.open("default", seed=SEED, schedule=MAIN)
    main_sizes = push_one_by_one(vocoder, main, codes)
    # A chunk of k codes ending at code e leaves at push e + 3 with k codes of samples (the first one minus
    # the held overlap); the finish returns the rest and the held samples.
    assert light_sizes == {
        5: 2 * SAMPLES_PER_CODE - OVERLAP,  # first audio after 2 + 3 codes
        8: 3 * SAMPLES_PER_CODE,
        13: 5 * SAMPLES_PER_CODE,
        23: 10 * SAMPLES_PER_CODE,
        NUM_CODES + 1: 10 * SAMPLES_PER_CODE + OVERLAP,
    }
    assert main_sizes == {
        7: 4 * SAMPLES_PER_CODE - OVERLAP,  # first audio after 4 + 3 codes
        12: 5 * SAMPLES_PER_CODE,
        22: 10 * SAMPLES_PER_CODE,
        NUM_CODES + 1: 11 * SAMPLES_PER_CODE + OVERLAP,
    }
    for sizes in (light_sizes, main_sizes):
        assert sum(sizes.values()) == NUM_CODES * SAMPLES_PER_CODE
    for session in (light, main):
        assert session.num_samples_emitted == NUM_CODES * SAMPLES_PER_CODE
    assert vocoder.num_open_sessions == 0
    assert len(reference) == NUM_CODES * SAMPLES_PER_CODE


def test_streamed_audio_of_either_schedule_stays_close_to_the_whole_decode(
    vocoder: StreamingVocoder, codes: list[int]
) -> None:
    reference = vocoder.decode_whole("default", codes, seed=SEED)
    for schedule in (LIGHT, MAIN):
        session = vocoder.open("default", seed=SEED, schedule=schedule)
        pcm = np.concatenate([vocoder.push(session, codes[:11]), vocoder.push(session, codes[11:]),
                              vocoder.finish(session)])
        assert len(pcm) == len(reference)
        assert float(np.abs(pcm - reference).max()) < OVERALL_TOL


def test_warm_up_of_both_schedules_covers_traffic_that_mixes_them(codes: list[int]) -> None:
    # Warm-up rows 1, 2, 4 for the main schedule, 1 for the light one (light-load sessions alone fill at
    # most bucket_rows(1) = 1 row). Then a light-load stream runs beside two main ones that start while it
    # is open, and a fourth stream opens light again once all have ended: only captured shapes run.
    voc, warm = build_for_serving("tiny", cuda_graphs=True, bucket_shapes=True, reserved_sessions=16,
                                  warmup_rows=[1, 2, 4], chunk_schedule_codes=SHORT_MAIN,
                                  light_load_schedule_codes=SHORT_LIGHT)
    assert warm["graphs_captured"] == voc.graph_stats["num_graphs"] > 0
    before, generation = voc.graph_stats, voc.pool.generation

    def run(v: StreamingVocoder) -> tuple[list[np.ndarray], list[tuple[int, ...]]]:
        pcms, sessions = run_staggered(v, codes, [0, 3, 9, 45], [NUM_CODES, 17, 21, 12], 60)
        return pcms, [s.schedule for s in sessions]  # type: ignore[attr-defined]

    graphed, picked = run(voc)
    eager, eager_picked = run(StreamingVocoder.from_preset("tiny", config=light_config(main=SHORT_MAIN,
                                                                                          light=SHORT_LIGHT)))
    assert picked == eager_picked == [SHORT_LIGHT, SHORT_MAIN, SHORT_MAIN, SHORT_LIGHT]
    for a, b, n in zip(graphed, eager, [NUM_CODES, 17, 21, 12], strict=True):
        assert len(a) == len(b) == n * SAMPLES_PER_CODE and float(np.abs(a - b).max()) < SAME
    after = voc.graph_stats
    assert after["num_graphs"] == before["num_graphs"] and after["num_eager_calls"] == before["num_eager_calls"]
    assert after["num_replays"] > before["num_replays"] and voc.pool.generation == generation


def test_build_for_serving_warms_the_light_schedule_on_both_lanes_within_their_rows() -> None:
    # Fast lane budget 4 code rows: the main schedule (first chunk 4) warms row 1 there, the light one
    # (first chunk 2) would fit 2 rows but light-load sessions alone fill at most bucket_rows(1) = 1.
    voc, warm = build_for_serving("tiny", cuda_graphs=True, bucket_shapes=True, reserved_sessions=8,
                                  warmup_rows=[1, 2], chunk_schedule_codes=SHORT_MAIN,
                                  light_load_schedule_codes=SHORT_LIGHT, fast_lane_code_budget=4)
    stream = voc.config.stream
    assert stream.light_load_schedule_codes == SHORT_LIGHT and stream.light_load_max_sessions == 1
    assert {sig[0][0][0] for sig in voc._lanes[1].graphed[1]._seen} == {1}  # rows of the fast lane's flow
    main_only, main_warm = build_for_serving("tiny", cuda_graphs=True, bucket_shapes=True, reserved_sessions=8,
                                             warmup_rows=[1, 2], chunk_schedule_codes=SHORT_MAIN,
                                             fast_lane_code_budget=4)
    assert main_only.schedules == [SHORT_MAIN]
    # The main schedule (4, 5) on rows 1 and 2 of lane 0 and row 1 of the fast lane: 4 + 5 + 5 + 3 = 17
    # codes for the whole schedule, then 9 + n for the tails n = 4, 5, 6 (the first n of each distinct
    # (bucketed flow codes, BigVGAN window) pair among n = 3..7: code buckets 4, 5 and powers of two, windows
    # 20 + 4n in buckets 32, 40 and powers of two: (4, 32), (4, 40), (5, 40), (8, 64), (8, 64)).
    assert main_warm["steps"] == 3 * (17 + sum(9 + n for n in (4, 5, 6)))
    # One row of the light schedule (2, 3), on each lane, in the main schedule's buckets: 2 + 3 + 3 + 3 = 11
    # codes, then 5 + n for the tails n = 4, 5 (among n = 3..5: (4, 32), (4, 40), (5, 40)).
    assert warm["steps"] == main_warm["steps"] + 2 * (11 + sum(5 + n for n in (4, 5)))
    # in tiny every light-load shape pads to one the main schedule's warm-up captured already
    assert warm["graphs_captured"] == main_warm["graphs_captured"]


def test_light_load_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="needs latency 'low'"):
        StreamConfig(latency="exact", light_load_schedule_codes=(2, 3)).validate()
    with pytest.raises(ValueError, match="light_load_schedule_codes must be a non-empty sequence of integer sizes >= 1"):
        StreamConfig(light_load_schedule_codes=(2, 0)).validate()
    with pytest.raises(ValueError, match=r"light_load_schedule_codes \(1, 3\): overlap_samples \(1920\) must be"):
        StreamConfig(light_load_schedule_codes=(1, 3)).validate()
    with pytest.raises(ValueError, match="light_load_max_sessions must be >= 1"):
        StreamConfig(light_load_schedule_codes=(2, 3), light_load_max_sessions=0).validate()
    voc = StreamingVocoder.from_preset("tiny")
    assert voc.schedules == [(2, 3, 5, 10, 25)] and voc.schedule_for_open(5) == (2, 3, 5, 10, 25)
    with pytest.raises(ValueError, match="sizes >= 1"):
        voc.open("default", schedule=[2, 0])
    with pytest.raises(ValueError, match=r"schedule \(1, 3\): overlap_samples \(1920\) must be shorter"):
        voc.open("default", schedule=[1, 3])
    assert voc.num_open_sessions == 0  # nothing was allocated for the refused opens
    cfg = VocoderConfig.preset("tiny")
    exact = StreamingVocoder.from_preset("tiny", config=dataclasses.replace(
        cfg, stream=dataclasses.replace(cfg.stream, latency="exact")))
    with pytest.raises(ValueError, match="needs low latency"):
        exact.open("default", schedule=[2, 3])
    exact.use_cuda_graphs()
    with pytest.raises(ValueError, match="warm-up schedule needs low latency"):
        exact.warm_up([1], schedule=[2, 3])


def test_build_for_serving_caps_device_memory_before_building(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap is set before the vocoder is built (a build that would pass it fails in its own process), and a
    cap on a CPU vocoder is refused before anything is built."""
    from vocoder import streaming

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(streaming, "cap_device_memory", lambda device, cap: calls.append(("cap", device, cap)))

    def from_preset(name: str, **kwargs: object) -> None:
        calls.append(("build", name))
        raise RuntimeError("stop here")

    monkeypatch.setattr(streaming.StreamingVocoder, "from_preset", staticmethod(from_preset))
    with pytest.raises(RuntimeError, match="stop here"):
        build_for_serving("full", device="cuda", memory_cap_bytes=3 * 2**30)
    assert calls == [("cap", "cuda", 3 * 2**30), ("build", "full")]
    monkeypatch.undo()
    with pytest.raises(ValueError, match="needs a CUDA device, got 'cpu'"):
        build_for_serving("tiny", device="cpu", memory_cap_bytes=2**30)
