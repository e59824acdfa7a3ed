"""bench/vocoder.py's timing summary: every latency row carries p10 and p90 beside its median."""
from __future__ import annotations

from bench.vocoder import spread


def test_spread_gives_median_and_nearest_rank_percentiles() -> None:
    # 5 samples, unsorted: median 3, p10 = 1st smallest (ceil(0.5)), p90 = 5th smallest (ceil(4.5))
    assert spread("push_ms", [5.0, 1.0, 4.0, 2.0, 3.0]) == {"push_ms": 3.0, "push_ms_p10": 1.0, "push_ms_p90": 5.0}
    # 10 samples: median 5.5; p10 the 1st, p90 the 9th smallest; values rounded to the microsecond
    got = spread("ms_per_chunk", [x + 0.01249 for x in range(10, 0, -1)])
    assert got == {"ms_per_chunk": 5.512, "ms_per_chunk_p10": 1.012, "ms_per_chunk_p90": 9.012}
