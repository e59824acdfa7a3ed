"""bench/soak.py against the running test app: every request kind passes its exact checks, alone and mixed,
and the app is idle afterwards."""
from __future__ import annotations

import asyncio
import random

import httpx

from bench.soak import MIX, Soak, soak


def test_each_kind_alone_passes_its_checks(serve_base_url: str) -> None:
    async def main() -> list:
        async with httpx.AsyncClient(timeout=120.0, trust_env=False) as client:
            runner = Soak(client, serve_base_url, random.Random(5), timeout_s=120.0)
            return [await runner.run(kind) for kind in MIX]

    outcomes = asyncio.run(main())
    assert [(o.kind, o.result, o.detail) for o in outcomes] == [(kind, "ok", "") for kind in MIX]


def test_a_short_mixed_soak_over_the_queue_limits_fails_nothing_and_leaves_the_app_idle(serve_base_url: str) -> None:
    # 8 workers against 4 running + 2 waiting: some requests are turned away with a 503, which is allowed
    summary = asyncio.run(soak(serve_base_url, duration_s=10.0, concurrency=8, seed=11, timeout_s=120.0,
                               settle_s=60.0, warmup=1, rss_app=None))
    assert summary["failures"] == [] and summary["num_failures"] == 0
    assert summary["settled"] is True
    assert summary["num_requests"] == sum(sum(kind.values()) for kind in summary["outcomes"].values())
    assert summary["num_requests"] >= 8  # each worker finished at least its first request
    llm = summary["final_stats"]["llm"]
    assert (llm["num_blocks_used"], llm["num_tracked_requests"]) == (0, 0)
