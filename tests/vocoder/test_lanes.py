"""Lanes (`StreamingVocoder.add_lane`): steps of different sessions on different lanes, from different threads
at once, give the audio of one lane; each lane has its own graphs and padding slot; a session may move
between lanes from one step to the next; a pool growth waits for the lanes' calls in progress."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from streaming_helpers import NUM_CODES, SEED, SHORT, SHORT_WALK_STEPS

from vocoder import SAMPLES_PER_CODE, StreamingVocoder

SAME = 1e-5  # float rounding between different batch shapes


def run_streams(voc: StreamingVocoder, codes: list[int], lanes: list[list[int]]) -> list[np.ndarray]:
    """Three streams pushed one code per step; lanes[i][t] is the lane stream i's step t runs on (steps
    of one stream in order, streams on their own threads); then finished on lane 0."""
    sessions = [voc.open("default", seed=SEED + i) for i in range(3)]
    out: list[list[np.ndarray]] = [[] for _ in sessions]
    errors: list[BaseException] = []

    def drive(i: int) -> None:
        try:
            for t, lane in enumerate(lanes[i]):
                out[i].append(voc.step([(sessions[i], codes[t : t + 1])], max_chunks=1, lane=lane))
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    tails = voc.finish_many(sessions)
    return [np.concatenate([p[0] for p in parts] + [tail]) for parts, tail in zip(out, tails, strict=True)]


@pytest.fixture(scope="module")
def single(codes: list[int]) -> list[np.ndarray]:
    voc = StreamingVocoder.from_preset("tiny")
    return run_streams(voc, codes, [[0] * NUM_CODES] * 3)


def test_concurrent_lanes_give_the_single_lane_audio(codes: list[int], single: list[np.ndarray]) -> None:
    voc = StreamingVocoder.from_preset("tiny")
    assert voc.add_lane() == 1 and voc.num_lanes == 2
    # stream 0 on lane 0, stream 1 on lane 1, stream 2 alternating: all three threads run at once
    lanes = [[0] * NUM_CODES, [1] * NUM_CODES, [t % 2 for t in range(NUM_CODES)]]
    got = run_streams(voc, codes, lanes)
    for a, b in zip(got, single, strict=True):
        assert len(a) == len(b) == NUM_CODES * SAMPLES_PER_CODE
        assert float(np.abs(a - b).max()) < SAME
    assert voc.num_open_sessions == 0


def test_each_lane_has_its_own_graphs_and_scratch_slot(codes: list[int], single: list[np.ndarray]) -> None:
    voc = StreamingVocoder.from_preset("tiny")
    voc.use_cuda_graphs(bucket_shapes=True)
    lane = voc.add_lane()
    voc.reserve_sessions(8)
    stats = voc.warm_up([1, 2], lane=lane, schedule=SHORT)  # the short walk (streaming_helpers.SHORT)
    assert stats["graphs_captured"] > 0 and stats["steps"] == 2 * SHORT_WALK_STEPS
    assert voc._graphed and all(g.num_graphs == 0 for g in voc._graphed)  # lane 0 captured nothing
    assert sum(g.num_graphs for g in voc._lanes[lane].graphed) == stats["graphs_captured"]
    scratch = {ln.scratch_slot for ln in voc._lanes}
    assert None not in scratch and len(scratch) == 2
    assert voc.num_open_sessions == 0 and voc.pool.capacity == 8 + 2
    lanes = [[lane] * NUM_CODES, [0] * NUM_CODES, [lane if t < 5 else 0 for t in range(NUM_CODES)]]
    for a, b in zip(run_streams(voc, codes, lanes), single, strict=True):
        assert len(a) == len(b) and float(np.abs(a - b).max()) < SAME
    assert voc._lanes[lane].graphed[1].num_replays > 0


def test_bad_lane_is_refused_and_changes_nothing(codes: list[int]) -> None:
    voc = StreamingVocoder.from_preset("tiny")
    session = voc.open("default", seed=SEED)
    with pytest.raises(ValueError, match="lane must be in"):
        voc.step([(session, codes[:6])], lane=1)
    with pytest.raises(ValueError, match="lane must be in"):
        voc.finish_many([session], lane=-1)
    voc.use_cuda_graphs()
    with pytest.raises(ValueError, match="lane must be in"):
        voc.warm_up([1], lane=2)
    # the refused step lost nothing: the codes go in with the next one
    assert len(voc.step([(session, codes[:6])])[0]) == 2 * SAMPLES_PER_CODE - 1920


def test_pool_growth_waits_for_a_lane_call_in_progress() -> None:
    voc = StreamingVocoder.from_preset("tiny")
    voc.add_lane()
    entered, release = threading.Event(), threading.Event()
    grown = threading.Event()

    def hold_lane() -> None:
        with voc._in_lane(1):
            entered.set()
            release.wait(timeout=30)

    def grow() -> None:
        voc.reserve_sessions(voc.pool.capacity + 4)
        grown.set()

    holder = threading.Thread(target=hold_lane)
    holder.start()
    assert entered.wait(timeout=30)
    capacity = voc.pool.capacity
    grower = threading.Thread(target=grow)
    grower.start()
    assert not grown.wait(timeout=0.5)  # blocked while the lane call runs
    assert voc.pool.capacity == capacity
    release.set()
    assert grown.wait(timeout=30)
    holder.join(timeout=30)
    grower.join(timeout=30)
    assert voc.pool.capacity == capacity + 4


def test_a_large_open_grows_the_pool_before_its_lane_call() -> None:
    """With two lanes, opening more sessions than twice the pool's capacity grows the pool beforehand, enough
    for all of them, never inside the lane call (where another lane's step may read the pool)."""
    voc = StreamingVocoder.from_preset("tiny")
    voc.add_lane()
    grow = voc.pool._grow
    busy_at_growth: list[int] = []

    def spy(new: int) -> None:
        busy_at_growth.append(voc._busy)
        grow(new)

    voc.pool._grow = spy  # type: ignore[method-assign]
    capacity = voc.pool.capacity
    sessions = voc.open_many([("default", i) for i in range(2 * capacity + 4)])
    assert busy_at_growth == [0]
    assert voc.num_open_sessions == len(sessions) and voc.pool.capacity >= len(sessions)
    for s in sessions:
        voc.close(s)
    with pytest.raises(TypeError, match="expected a VocoderSession, got str"):
        voc.close("x")  # type: ignore[arg-type]


def test_open_on_a_lane_while_another_lane_steps(codes: list[int], single: list[np.ndarray]) -> None:
    # A newcomer's open must not wait for a long step on lane 0: opens run on a lane too, and the
    # priming cache is shared (a second open of the same (voice, seed) restores it on either lane).
    voc = StreamingVocoder.from_preset("tiny")
    lane = voc.add_lane()
    first = voc.open("default", seed=SEED + 1, lane=lane)
    assert first.lane == lane and voc.num_primed_hits == 0
    busy = voc.open("default", seed=SEED, lane=0)
    with voc._in_lane(0):  # lane 0 is taken (by this thread) while another thread opens on the lane
        box: list = []
        opener = threading.Thread(target=lambda: box.append(voc.open("default", seed=SEED + 1, lane=lane)))
        opener.start()
        opener.join(timeout=30)
        assert not opener.is_alive() and box and voc.num_primed_hits == 1
    pcm = [voc.step([(box[0], codes)], lane=0)[0], voc.finish_many([box[0]], lane=lane)[0]]
    assert float(np.abs(np.concatenate(pcm) - single[1]).max()) < SAME
    with pytest.raises(ValueError, match="lane must be in"):
        voc.open("default", seed=SEED, lane=2)
    for s in (first, busy):
        voc.close(s)
    assert voc.num_open_sessions == 0


def test_two_opens_on_two_lanes_never_grow_the_pool_inside_a_lane_call() -> None:
    """Two opens on different lanes that both need the pool's last free slot: the one that does not get it
    grows the pool before its lane call (when no lane call runs), never inside it."""
    voc = StreamingVocoder.from_preset("tiny")
    lane = voc.add_lane()
    capacity = voc.pool.capacity
    held = voc.open_many([("default", i) for i in range(capacity - 1)])  # one slot left
    grow, in_lane = voc.pool._grow, voc._in_lane
    busy_at_growth: list[int] = []
    at_lane = threading.Event()

    def spy_grow(new: int) -> None:
        busy_at_growth.append(voc._busy)
        grow(new)

    def spy_in_lane(index: int, *args, **kwargs):
        if index == lane:
            at_lane.set()
        return in_lane(index, *args, **kwargs)

    voc.pool._grow = spy_grow  # type: ignore[method-assign]
    voc._in_lane = spy_in_lane  # type: ignore[method-assign]
    opened: dict[int, object] = {}
    voc._lanes[lane].lock.acquire()  # the opener on `lane` stops at its lane call, past its slot check
    first = threading.Thread(target=lambda: opened.setdefault(lane, voc.open("default", seed=90, lane=lane)))
    first.start()
    assert at_lane.wait(timeout=30)
    second = threading.Thread(target=lambda: opened.setdefault(0, voc.open("default", seed=91, lane=0)))
    second.start()
    second.join(timeout=60)
    voc._lanes[lane].lock.release()
    first.join(timeout=60)
    assert not first.is_alive() and not second.is_alive() and sorted(opened) == [0, lane]
    assert busy_at_growth == [0]
    slots = [s.slot for s in held] + [opened[0].slot, opened[lane].slot]  # type: ignore[attr-defined]
    assert len(set(slots)) == capacity + 1 and voc.num_open_sessions == capacity + 1


def test_an_open_that_fails_gives_its_slots_back(monkeypatch: pytest.MonkeyPatch) -> None:
    voc = StreamingVocoder.from_preset("tiny")
    kept = voc.open("default", seed=SEED)

    def broken(*args, **kwargs) -> None:
        raise RuntimeError("priming failed")

    monkeypatch.setattr(voc, "_advance_flow", broken)
    with pytest.raises(RuntimeError, match="priming failed"):
        voc.open_many([("default", 5), ("default", 6)])
    assert voc.num_open_sessions == 1 and voc.pool.num_used == 1
    monkeypatch.undo()
    again = voc.open_many([("default", 5), ("default", 6)])
    assert voc.num_open_sessions == 3 and len({kept.slot, *(s.slot for s in again)}) == 3
