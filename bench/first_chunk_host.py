"""Where a graphed first chunk's host time goes (full, bf16, one stream, as bench/vocoder.py's graphfused).

    python bench/first_chunk_host.py

Prints the first chunk's wall times (5 codes pushed to a freshly opened session, 10 rounds after 6 warm-up
rounds that capture the graphs), then a cProfile of one open + push + close (its costliest Python functions,
own and cumulative ms; GPU work counts where the host waits for it), then the GPU timeline of another under
torch.profiler (kernel count, gaps over 20 us). A diagnostic: no JSON, nothing compared.
"""
from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from vocoder import StreamingVocoder

CODES = np.random.default_rng(1).integers(0, 16384, 5).tolist()


def first_chunk(voc: StreamingVocoder, seed: int) -> float:
    """Open a session with a new seed, push 5 codes (the first chunk), close; -> the push's wall ms."""
    session = voc.open("default", seed=seed)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pcm = voc.push(session, CODES)
    torch.cuda.synchronize()
    ms = 1e3 * (time.perf_counter() - t0)
    voc.close(session)
    assert len(pcm) > 0 and np.isfinite(pcm).all()
    return ms


def host_profile(voc: StreamingVocoder) -> None:
    prof = cProfile.Profile()
    prof.enable()
    first_chunk(voc, 99)
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = [(round(1e3 * own, 3), round(1e3 * cumulative, 3), calls, f"{Path(path).name}:{line}:{func}")
            for (path, line, func), (_, calls, own, cumulative, _) in stats.stats.items()]  # type: ignore[attr-defined]
    print("top own ms (own, cumulative, calls, function):")
    for row in sorted(rows, reverse=True)[:25]:
        print("  ", row)
    print("top cumulative ms:")
    for row in sorted(rows, key=lambda r: -r[1])[:30]:
        print("  ", row)


def gpu_timeline(voc: StreamingVocoder) -> None:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        first_chunk(voc, 123)
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    start = last = kernels[0].time_range.start
    gaps = []
    for e in kernels:
        if e.time_range.start - last > 20:
            gaps.append((round((last - start) / 1e3, 3), round((e.time_range.start - last) / 1e3, 3), e.name[:60]))
        last = max(last, e.time_range.end)
    busy = sum(e.time_range.end - e.time_range.start for e in kernels)
    print("gpu span ms", round((last - start) / 1e3, 3), "kernels", len(kernels), "sum of kernel time ms",
          round(busy / 1e3, 3))
    print("gaps > 20 us (at ms, gap ms, next kernel):")
    for gap in gaps[:40]:
        print("  ", gap)


def main() -> None:
    voc = StreamingVocoder.from_preset("full", device="cuda", dtype="bfloat16", seed=0, triton_kernels=True)
    voc.use_cuda_graphs()
    for seed in range(6):
        first_chunk(voc, seed)
    print("first chunk ms", sorted(first_chunk(voc, 10 + r) for r in range(10)))
    host_profile(voc)
    gpu_timeline(voc)


if __name__ == "__main__":
    main()
