"""Vocoder warm-up on its own: what `StreamingVocoder.warm_up` costs at start, and what it saves under traffic.

    python bench/vocoder_warmup.py --preset full --device cuda --dtype bfloat16 \
        --rows 1,2,4,8,16,32,48,64 --streams 48 --out bench/results/vocoder-warmup-h200.json
    python bench/vocoder_warmup.py --preset tiny --device cpu --rows 1,2 --streams 3 --codes 20,40

1. Warm-up: `build_for_serving(cuda_graphs, bucket_shapes, warmup_rows=rows)` as the deployment does;
   seconds and graphs captured, and per row count the seconds of `warm_up([r])` alone (a second vocoder).
2. Traffic, the same on three vocoders: graphs captured on second sighting (the previous default),
   bucketed shapes without warm-up, bucketed shapes after the warm-up of 1. `--streams` streams of a
   random length in `--codes` start at random steps over the first `--spread` steps; each step pushes one
   code to every live stream; streams finish when their codes are in. Reported: step wall time p50 / p99 /
   max (a step that captures or runs eagerly shows here), eager calls, graphs captured during traffic,
   and the first chunk's wall time of every stream (the step in which its first PCM appears).
Outputs are checked first: every stream yields exactly 1920 samples per code, all finite.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from vocoder import SAMPLES_PER_CODE
from vocoder.streaming import StreamingVocoder, build_for_serving


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def traffic(voc: StreamingVocoder, args: argparse.Namespace) -> dict[str, Any]:
    """Staggered streams, one code per step each -> step-time and first-chunk figures (ms)."""
    rng = random.Random(args.seed)
    lo, hi = args.code_range
    plan = sorted((rng.randrange(args.spread), rng.randint(lo, hi)) for _ in range(args.streams))
    codes = [rng.randrange(16384) for _ in range(hi)]
    live: dict[int, Any] = {}
    pushed = {i: 0 for i in range(len(plan))}
    samples = {i: 0 for i in range(len(plan))}
    first_chunk_ms: list[float] = []
    step_ms: list[float] = []
    before = dict(voc.graph_stats)
    t = 0
    while t < args.spread or live:
        for i, (start, _) in enumerate(plan):
            if start == t:
                live[i] = voc.open("default", seed=i)
        work = [(i, codes[pushed[i] : pushed[i] + 1]) for i in live if pushed[i] < plan[i][1]]
        done = [i for i in live if pushed[i] == plan[i][1]]
        t0 = time.perf_counter()
        outs = voc.step([(live[i], c) for i, c in work]) if work else []
        tails = voc.finish_many([live[i] for i in done]) if done else []
        sync(args.device)
        ms = 1000 * (time.perf_counter() - t0)
        if work or done:
            step_ms.append(ms)
        for (i, _), pcm in zip(work, outs, strict=True):
            assert np.isfinite(pcm).all()
            if len(pcm) and samples[i] == 0:
                first_chunk_ms.append(ms)
            samples[i] += len(pcm)
            pushed[i] += 1
        for i, tail in zip(done, tails, strict=True):
            assert np.isfinite(tail).all()
            samples[i] += len(tail)
            del live[i]
        t += 1
    for i, (_, n) in enumerate(plan):
        assert samples[i] == n * SAMPLES_PER_CODE, (i, samples[i], n)
    after = voc.graph_stats
    return {
        "steps": len(step_ms),
        "step_ms": {"p50": pct(step_ms, 0.5), "p99": pct(step_ms, 0.99), "max": max(step_ms),
                    "total": sum(step_ms)},
        "first_chunk_step_ms": {"p50": pct(first_chunk_ms, 0.5), "p99": pct(first_chunk_ms, 0.99),
                                "max": max(first_chunk_ms)},
        "eager_calls": after["num_eager_calls"] - before["num_eager_calls"],
        "graphs_captured_during_traffic": after["num_graphs"] - before["num_graphs"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=("tiny", "full"), default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--rows", default="1,2,4,8,16,32,48,64", help="row counts to warm up")
    p.add_argument("--streams", type=int, default=48)
    p.add_argument("--codes", default="60,120", help="min,max codes per stream")
    p.add_argument("--spread", type=int, default=40, help="streams start within this many steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-row", action="store_true", help="also time warm_up([r]) alone per row count")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.code_range = tuple(int(x) for x in args.codes.split(","))
    rows = [int(r) for r in args.rows.split(",")]
    common = {"device": args.device, "dtype": args.dtype}
    result: dict[str, Any] = {"command": "python " + " ".join(sys.argv), "preset": args.preset,
                              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                              "rows": rows, "streams": args.streams, "codes": args.code_range}

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result), flush=True)

    t0 = time.perf_counter()
    warmed, warm = build_for_serving(args.preset, cuda_graphs=True, bucket_shapes=True, reserved_sessions=256,
                                     warmup_rows=rows, **common)
    result["warm_up"] = {**warm, "build_and_warm_s": time.perf_counter() - t0,
                         "graphs_per_function": [g.num_graphs for g in warmed._graphed]}
    if args.device.startswith("cuda"):
        result["warm_up"]["gpu_memory_allocated_gib"] = torch.cuda.memory_allocated() / 2**30
    save()
    if args.per_row:
        single, _ = build_for_serving(args.preset, cuda_graphs=True, bucket_shapes=True, **common)
        result["warm_up_per_row"] = [{"rows": r, **single.warm_up([r])} for r in rows]
        del single
        save()
    result["traffic"] = {}
    for name, voc in (("second_sighting", None), ("bucketed_cold", None), ("bucketed_warm", warmed)):
        if voc is None:
            voc, _ = build_for_serving(args.preset, cuda_graphs=True, bucket_shapes=name == "bucketed_cold",
                                       reserved_sessions=256, **common)
        result["traffic"][name] = traffic(voc, args)
        save()


if __name__ == "__main__":
    main()
