"""Resident memory of the tiny Engine in process, without Ray, over 12000 speech requests (every third
closed after its third event). Prints: requests done, seconds, VmRSS in MiB. Run from the repo root:

    python bench/results/soak-cpu/engine_rss.py > engine_rss.txt
"""
import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import runtime.prompts as P
from bench.soak import resident_bytes
from runtime.engine import Engine, EngineConfig
from runtime.request import GenerationRequest
from runtime.sampling import SamplingParams


async def main() -> None:
    engine = Engine.from_config(EngineConfig(model="tiny", device="cpu", kv_cache_bytes=128 * 2**20,
                                             max_num_running=16))
    rng = random.Random(0)

    async def one(i: int) -> None:
        rows = P.read_aloud_rows(engine.tokenizer, f"Soak request {rng.randrange(10**9)}: the weather is fine today.")
        n = rng.randint(4, 24)
        stream = engine.generate(GenerationRequest(f"r{i}", rows, SamplingParams(), SamplingParams(),
                                                   max_new_tokens=n, min_new_tokens=n))
        events = 0
        async for _ in stream:
            events += 1
            if i % 3 == 0 and events == 3:
                await stream.aclose()  # the consumer walks away: the engine aborts the request
                break

    started = time.time()
    for batch in range(60):
        await asyncio.gather(*(one(batch * 200 + i) for i in range(200)))
        if batch % 5 == 4:
            print(batch * 200 + 200, round(time.time() - started), round(resident_bytes() / 2**20, 1), flush=True)
    await engine.shutdown()


asyncio.run(main())
