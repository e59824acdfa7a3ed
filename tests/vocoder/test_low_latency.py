"""Low-latency streaming (the default) on the tiny preset: first chunk after 2 + 3 codes, exact lengths,
audio independent of push sizes and batch neighbours, close to decode_whole, no seams, CUDA-graph plumbing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from streaming_helpers import (
    NUM_CODES,
    SEED,
    SHORT_WALK_STEPS,
    run_staggered,
    short_schedule_config,
    stream,
)

from vocoder import SAMPLES_PER_CODE, StreamingVocoder, VocoderConfig
from vocoder.chunking import crossfade_weights

OVERLAP = 1920  # default overlap_samples: held back at each chunk end and crossfaded
# Chunk ends (codes) of the default schedule (2, 3, 5, 10, 25) within 30 codes; the rest goes at finish.
CHUNK_ENDS = [2, 5, 10, 20]
SAME = 1e-5  # float rounding between different batch shapes
# Measured against decode_whole (tiny, random weights, 30 codes, seed 7): outside the crossfade regions
# max |diff| 2.0e-3, overall 3.95e-2, relative energy error 4.7e-3 (reference std 0.033).
OUTSIDE_CROSSFADE_TOL = 5e-3
OVERALL_TOL = 6e-2
ENERGY_TOL = 1e-2


@pytest.fixture(scope="module")
def vocoder() -> StreamingVocoder:
    voc = StreamingVocoder.from_preset("tiny")
    assert voc.is_low_latency and (voc.left_context, voc.right_context) == (16, 0)
    return voc


@pytest.fixture(scope="module")
def by_one(vocoder: StreamingVocoder, codes: list[int]) -> list[np.ndarray]:
    return stream(vocoder, codes, [1] * NUM_CODES)


def test_first_chunk_after_two_plus_lookahead_codes_and_exact_chunk_sizes(by_one: list[np.ndarray]) -> None:
    # Chunk [a, e) leaves at push e + 3 with its samples minus the held 1920, plus the 1920 held before.
    sizes = {i + 1: len(c) for i, c in enumerate(by_one) if len(c)}
    assert sizes == {
        5: 2 * SAMPLES_PER_CODE - OVERLAP,  # first audio after exactly 2 + 3 codes
        8: 3 * SAMPLES_PER_CODE,
        13: 5 * SAMPLES_PER_CODE,
        23: 10 * SAMPLES_PER_CODE,
        NUM_CODES + 1: 10 * SAMPLES_PER_CODE + OVERLAP,  # finish: codes 20..30 and the held samples
    }
    assert all(c.dtype == np.float32 for c in by_one)


@pytest.mark.parametrize(
    "schedule",
    [[2] * 15, [5] * 6, [25, 5], [NUM_CODES], [3, 1, 7, 2, 0, 11, 6]],
    ids=["by2", "by5", "by25", "all", "irregular"],
)
def test_audio_depends_on_codes_not_on_push_sizes(
    vocoder: StreamingVocoder, codes: list[int], by_one: list[np.ndarray], schedule: list[int]
) -> None:
    pcm = np.concatenate(stream(vocoder, codes, schedule))
    assert len(pcm) == NUM_CODES * SAMPLES_PER_CODE
    assert float(np.abs(pcm - np.concatenate(by_one)).max()) < SAME


def test_flow_stops_at_the_last_chunk_end_whatever_the_push_size(vocoder: StreamingVocoder, codes: list[int]) -> None:
    """A push of 9 codes completes chunks [0, 2) and [2, 5) (5 + 3 lookahead <= 9): the flow integrates to
    code 5, not to 9 - 3 = 6, so its shapes follow the chunk schedule; the next chunk then starts there."""
    session = vocoder.open("default", seed=SEED)
    try:
        p = session.num_prompt_codes  # cursors count the voice's prompt codes too
        first = vocoder.push(session, codes[:9])
        assert (len(first), session.flow_cursor - p, session.emitted_frames - 4 * p) == (
            5 * SAMPLES_PER_CODE - OVERLAP, 5, 20)
        assert len(vocoder.push(session, codes[9:12])) == 0 and session.flow_cursor - p == 5  # [5, 10) needs 13
        assert len(vocoder.push(session, codes[12:13])) == 5 * SAMPLES_PER_CODE and session.flow_cursor - p == 10
    finally:
        vocoder.close(session)


def test_one_chunk_per_step_gives_the_same_audio(
    vocoder: StreamingVocoder, codes: list[int], by_one: list[np.ndarray]
) -> None:
    """All 30 codes pushed at once, then steps of `max_chunks=1` without new codes: the schedule's chunks
    leave one per step, `next_chunk_codes` names each before it is computed, and the audio is by_one's."""
    session = vocoder.open("default", seed=SEED)
    try:
        assert vocoder.next_chunk_codes(session) == 0 and vocoder.next_chunk_codes(session, pending=4) == 0
        assert vocoder.next_chunk_codes(session, pending=5) == 2  # chunk [0, 2) once 2 + 3 codes are in
        announced, sizes = [], []
        pcm = [vocoder.step([(session, codes)], max_chunks=1)[0]]
        sizes.append(len(pcm[-1]))
        while (n := vocoder.next_chunk_codes(session)) > 0:
            announced.append(n)
            pcm.append(vocoder.step([(session, [])], max_chunks=1)[0])
            sizes.append(len(pcm[-1]))
        assert announced == [3, 5, 10]  # after the first: the rest of the schedule that fits in 30 - 3
        assert sizes == [2 * SAMPLES_PER_CODE - OVERLAP, 3 * SAMPLES_PER_CODE, 5 * SAMPLES_PER_CODE,
                         10 * SAMPLES_PER_CODE]
        assert vocoder.unvocoded_codes(session) == NUM_CODES - CHUNK_ENDS[-1]
        assert vocoder.unvocoded_codes(session, pending=4) == NUM_CODES - CHUNK_ENDS[-1] + 4
        pcm.append(vocoder.finish(session))
    finally:
        vocoder.close(session)
    assert len(pcm[-1]) == 10 * SAMPLES_PER_CODE + OVERLAP
    assert float(np.abs(np.concatenate(pcm) - np.concatenate(by_one)).max()) < SAME
    with pytest.raises(ValueError, match="max_chunks"):
        vocoder.step([], max_chunks=0)


def test_a_stream_can_finish_in_the_step_of_another_streams_chunk(
    vocoder: StreamingVocoder, codes: list[int], by_one: list[np.ndarray]
) -> None:
    """`step(finish=[b])`: b's codes go in and the rest of its stream comes out, batched with a's chunk;
    both streams' audio equals what separate calls give, and b is closed."""
    other = np.random.default_rng(3).integers(0, 16384, 12).tolist()
    ref = vocoder.open("default", seed=99)
    ref_pcm = [vocoder.push(ref, other[:9]), vocoder.push(ref, other[9:]), vocoder.finish(ref)]
    assert len(ref_pcm[1]) == 0  # 12 codes: the chunk [5, 10) waits for 13

    a, b = vocoder.open_many([("default", SEED), ("default", 99)])
    a_pcm = [vocoder.step([(a, codes[:8])], max_chunks=1)[0]]  # chunk [0, 2)
    b_pcm = [vocoder.push(b, other[:9])]
    with pytest.raises(ValueError, match="not in work"):
        vocoder.step([(a, [])], finish=[b])
    both = vocoder.step([(a, []), (b, other[9:])], max_chunks=1, finish=[b])  # a: chunk [2, 5); b: its end
    a_pcm.append(both[0])
    b_pcm.append(both[1])
    assert b.is_closed and not a.is_closed
    assert [len(x) for x in both] == [3 * SAMPLES_PER_CODE, 7 * SAMPLES_PER_CODE + OVERLAP]
    assert float(np.abs(np.concatenate(b_pcm) - np.concatenate(ref_pcm)).max()) < SAME
    a_pcm.append(vocoder.push(a, codes[8:]))
    a_pcm.append(vocoder.finish(a))
    assert float(np.abs(np.concatenate(a_pcm) - np.concatenate(by_one)).max()) < SAME


def test_a_finish_computes_the_scheduled_chunks_its_codes_complete_first(
    vocoder: StreamingVocoder, codes: list[int], by_one: list[np.ndarray]
) -> None:
    """A finish that arrives while chunks of the schedule are still uncomputed (its own codes complete them,
    or an earlier step stopped at `max_chunks`) computes those chunks, crossfades included, then the tail:
    the audio equals the stream's pushed one code at a time. (It used to merge them into one tail, which
    differed by ~4e-2: the audio of decoding the whole utterance at once.)"""
    want = np.concatenate(by_one)
    s = vocoder.open("default", seed=SEED)
    same_call = vocoder.step([(s, codes)], finish=[s])[0]
    assert s.is_closed and same_call.shape == want.shape
    assert float(np.abs(same_call - want).max()) < SAME
    s = vocoder.open("default", seed=SEED)
    first = vocoder.step([(s, codes)], max_chunks=1)[0]
    stopped = np.concatenate([first, vocoder.finish(s)])
    assert len(first) > 0 and float(np.abs(stopped - want).max()) < SAME


def test_close_to_whole_and_exact_outside_crossfades(by_one: list[np.ndarray], reference: np.ndarray) -> None:
    pcm = np.concatenate(by_one)
    assert pcm.shape == reference.shape and np.isfinite(pcm).all()
    diff = np.abs(pcm - reference)
    outside = np.ones(len(pcm), dtype=bool)
    for end in CHUNK_ENDS:
        outside[end * SAMPLES_PER_CODE - OVERLAP : end * SAMPLES_PER_CODE] = False
    assert float(diff[outside].max()) < OUTSIDE_CROSSFADE_TOL
    assert float(diff.max()) < OVERALL_TOL
    energy_error = float(((pcm - reference) ** 2).sum() / (reference**2).sum())
    assert energy_error < ENERGY_TOL
    # After the last scheduled chunk the tail is vocoded to the true end: equal to the whole pass.
    tail = slice(CHUNK_ENDS[-1] * SAMPLES_PER_CODE, None)
    assert float(diff[tail].max()) < SAME


def test_no_seams_at_chunk_boundaries(by_one: list[np.ndarray], reference: np.ndarray) -> None:
    """At every boundary the step from one sample to the next is the whole pass's step there (measured:
    within 1.0e-3; a hard cut instead of the crossfade gave 2.4e-2, a flat 0.5/0.5 fade 1.2e-2)."""
    pcm = np.concatenate(by_one)
    returned = np.cumsum([len(c) for c in by_one if len(c)])[:-1]  # where one returned array meets the next
    crossfade_ends = np.array(CHUNK_ENDS) * SAMPLES_PER_CODE
    bounds = np.concatenate([returned, crossfade_ends])
    jumps = np.abs(np.diff(pcm))
    inside = np.delete(jumps, bounds - 1)
    assert float(jumps[bounds - 1].max()) <= float(inside.max())
    assert float(np.abs(jumps[bounds - 1] - np.abs(np.diff(reference))[bounds - 1]).max()) < 3e-3


def test_crossfade_weights_rise_from_zero_to_one_and_sum_to_one() -> None:
    fade_in, fade_out = crossfade_weights(1920)
    assert fade_in.dtype == fade_out.dtype == np.float32 and fade_in.shape == (1920,)
    assert np.all(np.diff(fade_in) > 0) and fade_in[0] < 1e-6 and fade_in[-1] > 1 - 1e-6
    assert np.abs(fade_in + fade_out - 1).max() < 1e-7
    # raised cosine, sampled at the middle of each sample: sin^2(pi/2 * (i + 0.5) / n)
    assert np.allclose(fade_in[[0, 959, 960, 1919]], np.sin(0.5 * np.pi * np.array([0.5, 959.5, 960.5, 1919.5]) / 1920) ** 2)


def test_step_batches_sessions_in_different_phases_without_changing_their_audio(
    vocoder: StreamingVocoder, codes: list[int], by_one: list[np.ndarray]
) -> None:
    other_codes = np.random.default_rng(1).integers(0, 16384, 17).tolist()
    other_alone = np.concatenate(stream(vocoder, other_codes, [17], seed=99))
    rows: list[int] = []
    hook = vocoder.generator.register_forward_hook(lambda m, i, o: rows.append(o.shape[0]))
    a, b, idle = vocoder.open_many([("default", SEED), ("default", 99), ("default", 3)])
    out_a, out_b = [], []
    schedule_b = [1, 7, 0, 2, 3, 4]  # b runs ahead of a early, then a catches up: different chunks per step
    for i, n_b in enumerate(schedule_b):
        start_b = sum(schedule_b[:i])
        pcm = vocoder.step(
            [(idle, []), (a, codes[5 * i : 5 * i + 5]), (b, other_codes[start_b : start_b + n_b])]
        )
        assert len(pcm[0]) == 0
        out_a.append(pcm[1])
        out_b.append(pcm[2])
    tails = vocoder.finish_many([a, b, idle])
    hook.remove()
    assert max(rows) >= 2  # chunks of a and b shared BigVGAN forwards
    assert len(tails[2]) == 0
    pcm_a = np.concatenate([*out_a, tails[0]])
    pcm_b = np.concatenate([*out_b, tails[1]])
    assert len(pcm_a) == NUM_CODES * SAMPLES_PER_CODE and len(pcm_b) == 17 * SAMPLES_PER_CODE
    assert float(np.abs(pcm_a - np.concatenate(by_one)).max()) < SAME
    assert float(np.abs(pcm_b - other_alone).max()) < SAME


def test_short_streams_and_right_context_setting(codes: list[int]) -> None:
    cfg = VocoderConfig.preset("tiny")
    with_right = dataclasses.replace(
        cfg, stream=dataclasses.replace(cfg.stream, vocoder_right_context_frames=4, overlap_samples=960)
    )
    voc = StreamingVocoder.from_preset("tiny", config=with_right)
    chunks = stream(voc, codes[:12], [1] * 12)
    sizes = {i + 1: len(c) for i, c in enumerate(chunks) if len(c)}
    # 4 frames of right context = one more code before the first chunk: 2 + 3 + 1 pushes.
    assert sizes == {6: 2 * SAMPLES_PER_CODE - 960, 9: 3 * SAMPLES_PER_CODE, 13: 7 * SAMPLES_PER_CODE + 960}
    for n in range(5):  # shorter than the first chunk + lookahead: all audio comes at finish
        assert [len(c) for c in stream(voc, codes[:n], [n])] == [0, n * SAMPLES_PER_CODE]


def test_low_latency_config_validation() -> None:
    from vocoder.config import StreamConfig

    with pytest.raises(ValueError, match="latency"):
        StreamConfig(latency="fast").validate()
    with pytest.raises(ValueError, match="chunk_schedule_codes"):
        StreamConfig(chunk_schedule_codes=()).validate()
    with pytest.raises(ValueError, match=r"chunk_schedule_codes \(1, 5\): overlap_samples \(1920\) must be"):
        StreamConfig(chunk_schedule_codes=(1, 5), overlap_samples=1920).validate()
    with pytest.raises(ValueError, match="overlap_samples must be >= 0, got -1"):
        StreamConfig(overlap_samples=-1).validate()
    StreamConfig(chunk_schedule_codes=(1, 5), overlap_samples=0).validate()


@pytest.mark.parametrize("sizes", [(1.5, 3), ("2", "3"), (True, 3), (2, 0), (), 5, None])
def test_schedule_sizes_must_be_integers_of_at_least_one(sizes: object) -> None:
    from vocoder.config import check_schedule

    with pytest.raises(ValueError, match=r"^chunks must be a non-empty sequence of integer sizes >= 1, got "):
        check_schedule(sizes, 0, "chunks")


def test_schedule_sizes_of_integer_types_are_taken_as_ints() -> None:
    from vocoder.config import check_schedule

    got = check_schedule([np.int64(2), 3], 0, "chunks")
    assert got == (2, 3) and all(type(size) is int for size in got)


def test_graph_replay_path_matches_eager(codes: list[int], by_one: list[np.ndarray]) -> None:
    # On CPU `use_cuda_graphs` runs the static-buffer path with the functions re-executed instead of graphs.
    voc = StreamingVocoder.from_preset("tiny")
    voc.use_cuda_graphs(max_graphs=8)
    for _ in range(2):
        pcm = np.concatenate(stream(voc, codes, [1] * NUM_CODES))
        assert float(np.abs(pcm - np.concatenate(by_one)).max()) < SAME
    stats = voc.graph_stats
    assert stats["num_graphs"] > 0 and stats["num_replays"] > 0
    assert stats["num_graphs"] <= 3 * 8


def test_graphed_function_captures_on_second_use_and_caps_graphs() -> None:
    import torch

    from vocoder.graphs import GraphedFunction

    calls: list[tuple[int, ...]] = []

    def double(x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        calls.append(tuple(x.shape))
        return 2 * x, [x + 1]

    fn = GraphedFunction(double, max_graphs=1)
    a, b = torch.arange(3.0), torch.arange(4.0)
    first = fn(a)  # seen once: eager
    assert (fn.num_graphs, fn.num_eager_calls, fn.num_replays) == (0, 1, 0)
    second = fn(a + 1)  # captured, then replayed with these inputs
    assert fn.num_graphs == 1 and fn.num_replays == 1
    assert torch.equal(first[0], 2 * a) and torch.equal(second[0], 2 * (a + 1))
    assert torch.equal(second[1][0], a + 2)
    second[0].zero_()  # outputs are clones: the static buffers are not exposed
    assert torch.equal(fn(a)[0], 2 * a)
    fn(b)
    fn(b)  # a second signature is over max_graphs: stays eager
    assert (fn.num_graphs, fn.num_eager_calls) == (1, 3)
    fn.reset()
    assert fn.num_graphs == 0


def test_frozen_graphed_function_captures_only_what_it_had() -> None:
    import torch

    from vocoder.graphs import GraphedFunction

    fn = GraphedFunction(lambda x: x * 3, capture_after_calls=1)
    a, b = torch.arange(3.0), torch.arange(4.0)
    fn(a)  # captured on first use
    fn.freeze()
    assert fn.frozen and fn.num_graphs == 1
    for _ in range(3):
        assert torch.equal(fn(b), 3 * b)  # never captured: eager every time
    assert (fn.num_graphs, fn.num_eager_calls, fn.num_replays) == (1, 3, 1)
    fn.reset()  # e.g. the state pool grew: the frozen signature may be captured again, b still not
    assert torch.equal(fn(a + 1), 3 * (a + 1)) and torch.equal(fn(b), 3 * b)
    assert (fn.num_graphs, fn.num_eager_calls, fn.num_replays) == (1, 4, 2) and fn.frozen


def test_graphed_function_counts_sightings_of_few_signatures() -> None:
    """Signatures that can no longer be captured are not counted, and at most SEEN_PER_GRAPH x max_graphs
    are (the oldest forgotten): shapes that keep changing do not grow the function's memory."""
    import torch

    from vocoder.graphs import SEEN_PER_GRAPH, GraphedFunction

    def sig(n: int) -> tuple:
        return (((n,), torch.float32, "cpu"),)

    fn = GraphedFunction(lambda x: x + 1, max_graphs=2)
    bound = SEEN_PER_GRAPH * 2
    for n in range(1, bound + 6):
        fn(torch.zeros(n))
    assert list(fn._seen) == [sig(n) for n in range(6, bound + 6)]
    assert fn.num_graphs == 0 and fn.num_eager_calls == bound + 5
    fn(torch.zeros(1))  # forgotten in the loop: seen once again, still eager
    assert fn.num_graphs == 0 and fn._seen[sig(1)] == 1 and sig(6) not in fn._seen
    fn(torch.zeros(1))
    fn(torch.zeros(2))
    fn(torch.zeros(2))
    assert fn.num_graphs == 2
    fn(torch.zeros(50))
    fn(torch.zeros(50))  # no room: eager, and not counted
    assert fn.num_graphs == 2 and sig(50) not in fn._seen
    fn.freeze()
    fn.reset()
    fn(torch.zeros(7))
    fn(torch.zeros(7))  # frozen without (7,): never captured, not counted
    assert fn.num_graphs == 0 and fn._seen == {} and fn.num_eager_calls == bound + 11


def test_graph_path_pads_steps_to_few_shapes(codes: list[int]) -> None:
    # With graphs a step runs a bucketed number of rows (padding rows on a scratch slot) and of frames;
    # the audio of the real rows is the eager, unpadded audio.
    def run(voc: StreamingVocoder) -> list[np.ndarray]:
        sessions = [voc.open("default", seed=SEED + i) for i in range(3)]
        out = voc.step([(sessions[0], codes[:7]), (sessions[1], codes[:3]), (sessions[2], codes[:11])])
        out2 = voc.step([(s, codes[11:17]) for s in sessions])
        tails = voc.finish_many(sessions)
        return [np.concatenate(parts) for parts in zip(out, out2, tails, strict=True)]

    eager = run(StreamingVocoder.from_preset("tiny"))
    graphed_voc = StreamingVocoder.from_preset("tiny")
    graphed_voc.use_cuda_graphs(bucket_shapes=True)
    graphed = run(graphed_voc)
    for a, b in zip(graphed, eager, strict=True):
        assert len(a) == len(b) and float(np.abs(a - b).max()) < SAME
    flow_rows = {sig[0][0][0] for sig in graphed_voc._graphed[1]._seen}  # mu's batch size per signature
    assert flow_rows <= {1, 2, 4} and 4 in flow_rows
    assert graphed_voc.num_open_sessions == 0


def test_warm_up_captures_every_shape_of_later_staggered_streams(codes: list[int]) -> None:
    # After warm_up over the row buckets 1, 2, 4 (bucket_shapes), three streams of different lengths
    # that start at different steps and finish apart run on captured shapes only: no eager call, no new
    # capture, no growth of the state pool; their audio is the eager vocoder's. A short schedule (2, 3, 5)
    # keeps the walk small (the default schedule's walk: test_build_for_serving_wires_graphs_...).
    config = short_schedule_config((2, 3, 5))
    voc = StreamingVocoder.from_preset("tiny", config=config)
    voc.use_cuda_graphs(bucket_shapes=True)
    voc.reserve_sessions(16)
    voc.close(voc.open("default", seed=0))  # a priming before the warm-up runs eagerly (first sighting)
    stats = voc.warm_up([1, 2, 4])
    assert stats["graphs_captured"] == voc.graph_stats["num_graphs"] > 0
    assert list(voc._primed) == [("default", 0)]  # warm-up's own cold priming (seed 1) is not kept
    # Per row count, one code per step: the whole schedule plus a repeat of its last chunk (2+3+5+5+3 = 18
    # codes, tail 3), and streams of 10 + n codes for the tails n = 4, 5, 6: the first n of each distinct
    # (bucketed flow codes, BigVGAN window) pair among n = 3..7. Code buckets: the schedule's sizes and
    # powers of two; windows 20 + 4n (tiny: 16 frames of left context + the 4-frame overlap) in buckets
    # 24, 32, 40 (the scheduled chunks' windows) and powers of two: (3, 32), (4, 40), (5, 40), (8, 64),
    # then n = 7 again (8, 64).
    assert stats["steps"] == 3 * (18 + sum(10 + n for n in (4, 5, 6)))
    assert voc.num_open_sessions == 0 and voc.pool.capacity == 16 + 1  # + the padding rows' scratch slot
    before, generation = voc.graph_stats, voc.pool.generation

    def run(v: StreamingVocoder) -> list[np.ndarray]:
        return run_staggered(v, codes, [0, 3, 9], [NUM_CODES, 17, 21], 40)[0]

    graphed = run(voc)
    eager = run(StreamingVocoder.from_preset("tiny", config=config))
    for a, b, n in zip(graphed, eager, [NUM_CODES, 17, 21], strict=True):
        assert len(a) == len(b) == n * SAMPLES_PER_CODE and float(np.abs(a - b).max()) < SAME
    after = voc.graph_stats
    assert after["num_graphs"] == before["num_graphs"] and after["num_eager_calls"] == before["num_eager_calls"]
    assert after["num_replays"] > before["num_replays"] and voc.pool.generation == generation


def test_frozen_graphs_run_unwarmed_shapes_eagerly_with_the_same_audio(codes: list[int]) -> None:
    # Warmed for 1 row only and frozen: the 2- and 3-stream steps below (2 and 4 padded rows) are never
    # captured, however often they repeat, and every stream's audio is the eager vocoder's.
    from vocoder.streaming import build_for_serving

    config = short_schedule_config()
    voc, warm = build_for_serving("tiny", cuda_graphs=True, bucket_shapes=True, reserved_sessions=16,
                                  warmup_rows=[1], graphs_after_warmup=False, config=config)
    before = voc.graph_stats
    assert warm["graphs_captured"] == before["num_graphs"] > 0
    graphed = run_staggered(voc, codes, [0, 3, 9], [NUM_CODES, 17, 21], 40)[0]
    eager = run_staggered(StreamingVocoder.from_preset("tiny", config=config), codes, [0, 3, 9],
                          [NUM_CODES, 17, 21], 40)[0]
    for a, b, n in zip(graphed, eager, [NUM_CODES, 17, 21], strict=True):
        assert len(a) == len(b) == n * SAMPLES_PER_CODE and float(np.abs(a - b).max()) < SAME
    after = voc.graph_stats
    assert after["num_graphs"] == before["num_graphs"]
    assert after["num_eager_calls"] > before["num_eager_calls"] and after["num_replays"] > before["num_replays"]


def test_an_eager_warm_up_after_the_freeze_runs_its_steps_and_captures_nothing() -> None:
    from vocoder.streaming import build_for_serving

    short = {"config": short_schedule_config()}  # streaming_helpers.SHORT: SHORT_WALK_STEPS per row count
    frozen, warm = build_for_serving("tiny", cuda_graphs=True, bucket_shapes=True, reserved_sessions=16,
                                     warmup_rows=[1], graphs_after_warmup=False, **short)
    voc, both = build_for_serving("tiny", cuda_graphs=True, bucket_shapes=True, reserved_sessions=16,
                                  warmup_rows=[1], graphs_after_warmup=False, eager_warmup_rows=[2], **short)
    stats = voc.graph_stats
    assert stats["num_graphs"] == frozen.graph_stats["num_graphs"] == warm["graphs_captured"] > 0
    assert warm["steps"] == SHORT_WALK_STEPS
    assert (both["graphs_captured"], both["steps"]) == (warm["graphs_captured"], warm["steps"])
    # the same schedule walk for 2 rows as for 1 row, every step of it eager
    assert (both["eager_graphs_captured"], both["eager_steps"]) == (0, warm["steps"])
    assert stats["num_eager_calls"] > frozen.graph_stats["num_eager_calls"]
    assert voc.num_open_sessions == 0
    with pytest.raises(ValueError, match="eager_warmup_rows needs graphs_after_warmup=False"):
        build_for_serving("tiny", cuda_graphs=True, warmup_rows=[1], eager_warmup_rows=[2])


def test_warm_up_needs_graphs_and_valid_rows() -> None:
    voc = StreamingVocoder.from_preset("tiny")
    with pytest.raises(RuntimeError, match="use_cuda_graphs"):
        voc.warm_up([1])
    voc.use_cuda_graphs()
    with pytest.raises(ValueError, match="rows"):
        voc.warm_up([0, 2])
    assert voc.graph_stats["num_graphs"] == 0


def test_build_for_serving_wires_graphs_reserve_priming_and_warm_up() -> None:
    from vocoder.streaming import build_for_serving

    voc, warm = build_for_serving("tiny", cuda_graphs=True, bucket_shapes=True, reserved_sessions=8,
                                  warmup_rows=[1])
    assert voc.pool.capacity == 8 + 1 and voc.num_open_sessions == 0
    assert warm["graphs_captured"] == voc.graph_stats["num_graphs"] > 0 and warm["steps"] == 523
    assert list(voc._primed) == [("default", 0)]  # the default voice's priming is kept
    plain, nothing = build_for_serving("tiny")
    assert nothing == {} and plain.graph_stats["num_graphs"] == 0 and plain.pool.capacity == 8
    with pytest.raises(ValueError, match="need cuda_graphs"):
        build_for_serving("tiny", warmup_rows=[1])
    with pytest.raises(ValueError, match="needs warmup_rows"):
        build_for_serving("tiny", cuda_graphs=True, graphs_after_warmup=False)
    with pytest.raises(RuntimeError, match="needs use_cuda_graphs"):
        plain.freeze_graphs()
    bigger_first, _ = build_for_serving("tiny", chunk_schedule_codes=[3, 5])
    assert bigger_first.config.stream.chunk_schedule_codes == (3, 5)
    session = bigger_first.open("default", seed=SEED)
    sizes = [len(bigger_first.push(session, [c])) for c in range(1, 12)]
    # first audio after 3 + 3 codes: 3 codes minus the held overlap; the next after 3 + 5 + 3
    assert sizes == [0] * 5 + [3 * SAMPLES_PER_CODE - OVERLAP] + [0] * 4 + [5 * SAMPLES_PER_CODE]


def test_build_for_serving_adds_and_warms_a_fast_lane_within_its_budget() -> None:
    # budget 4 code rows, first chunk 2 codes: of the warm-up rows 1, 2, 4 the fast lane warms 1 and 2
    from vocoder.streaming import build_for_serving

    voc, warm = build_for_serving("tiny", cuda_graphs=True, bucket_shapes=True, reserved_sessions=8,
                                  warmup_rows=[1, 2, 4], fast_lane_code_budget=4, config=short_schedule_config())
    assert voc.num_lanes == 2 and voc.pool.capacity == 8 + 2  # + a scratch slot per lane
    # 3 row counts on lane 0 and 2 on the fast lane, each the short schedule's walk (streaming_helpers.SHORT)
    assert warm["steps"] == (3 + 2) * SHORT_WALK_STEPS
    lane0 = sum(g.num_graphs for g in voc._lanes[0].graphed)
    lane1 = sum(g.num_graphs for g in voc._lanes[1].graphed)
    assert lane0 > lane1 > 0 and warm["graphs_captured"] == lane0 + lane1
    flow_rows = {sig[0][0][0] for sig in voc._lanes[1].graphed[1]._seen}  # rows of the fast lane's flow steps
    assert flow_rows == {1, 2}
    assert voc.num_open_sessions == 0
