"""bench/fast_tools.py's interleaved timing (the engine run's decode graphs): order, counts, pooling."""
from __future__ import annotations

import torch

from bench import fast_tools
from bench.engine import Timing
from bench.fast_tools import time_interleaved


def test_rounds_reverse_the_order_and_pool_every_timed_call() -> None:
    calls: list[str] = []
    got = time_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, warmup=1, reps=3,
                           rounds=3, device=torch.device("cpu"))
    # each round: warmup + reps calls per function, a before b, then b before a, then a before b again
    assert "".join(calls) == "aaaabbbb" + "bbbbaaaa" + "aaaabbbb"
    assert list(got) == ["a", "b"]
    assert all(len(v["round_medians_ms"]) == 3 for v in got.values())


def test_summary_is_taken_over_the_pooled_samples(monkeypatch) -> None:
    # per round the fake timer returns 3 samples; the pooled median differs from the median of round medians
    rounds = iter([[1.0, 1.0, 9.0], [2.0, 2.0, 2.0], [5.0, 6.0, 7.0]])
    monkeypatch.setattr(fast_tools, "time_fn", lambda fn, dev, warmup, reps: Timing(next(rounds)))
    got = time_interleaved({"x": lambda: None}, warmup=0, reps=3, rounds=3, device=torch.device("cpu"))["x"]
    # pooled: 1 1 2 2 2 5 6 7 9 -> median 2, p10 (nearest rank, 1st of 9) 1, p90 (9th of 9) 9
    assert got == {"median_ms": 2.0, "p10_ms": 1.0, "p90_ms": 9.0, "round_medians_ms": [1.0, 2.0, 6.0]}


def test_percentiles_take_the_nearest_rank() -> None:
    """The ceil(q * n)-th smallest sample: p10 of 1..10 is 1 (an index of n // 10 gave 2), of 1..30 is 3."""
    from bench.engine import nearest_rank

    for n, p10, p90 in ((1, 1.0, 1.0), (10, 1.0, 9.0), (30, 3.0, 27.0), (90, 9.0, 81.0), (91, 10.0, 82.0)):
        timing = Timing([float(x) for x in range(n, 0, -1)])  # unsorted on purpose
        assert (timing.p10_ms, timing.p90_ms) == (p10, p90)
    assert [nearest_rank([1.0, 2.0, 3.0, 4.0], q) for q in (0.25, 0.5, 0.99, 1.0)] == [1.0, 2.0, 4.0, 4.0]
