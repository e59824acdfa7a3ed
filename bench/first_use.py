"""The engine's first eager step of a new shape against the same shape again: Triton's compile stalls.

Eager steps (several sequences with a prompt row among them) have any number of rows, and Triton compiles
each kernel again for each new specialisation of its integer arguments, on first use. With the engine's
start-up warm-up (`EngineConfig.warm_step_shapes`, runtime.engine.step_shapes) those compiles happen before
serving. This builds the engine from a Serve YAML (bench/engine_loop.py's options), then runs each probe
shape (none of them among the warmed ones) once, once more, and `--reps` more times, synchronised, and
prints one JSON line. Run each arm in its own process with its own Triton cache (on the GPU machine):

    export TRITON_CACHE_DIR=$(mktemp -d)
    python bench/first_use.py --config config/serve-4090-fp8.yaml --preset full --random-weights \\
        --no-warm-step-shapes --snapshot-cache /tmp/cache-after-build --out cold.json
    TRITON_CACHE_DIR=/tmp/cache-after-build python bench/first_use.py --config config/serve-4090-fp8.yaml \\
        --preset full --random-weights --warm-step-shapes --out warmed.json

`--snapshot-cache` copies the Triton cache as the build left it (graph kernels compiled, no probe yet), so the
second arm starts where the first one's probes started.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.engine_loop import add_engine_args, build_core
from bench.fast_tools import emit
from runtime import engine as engine_mod

# (query lengths, context lengths): every FP8 product path with rows not a multiple of 16 and one that is,
# beside decode rows with 16 tokens of context; none is among runtime.engine.step_shapes
PROBES = {
    "M4 S2": ((3, 1), (0, 16)),
    "M11 S7": ((1,) * 6 + (5,), (16,) * 6 + (0,)),
    "M20 S3": ((1, 1, 18), (16, 16, 0)),
    "M32 S10": ((1,) * 9 + (23,), (16,) * 9 + (40,)),
    "M42 S6": ((7,) * 6, (60,) * 6),
    "M300 S6": ((1,) * 5 + (295,), (16,) * 5 + (0,)),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--snapshot-cache", type=Path, default=None, help="copy TRITON_CACHE_DIR here after the build")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    warm_s: list[float] = []
    warm = engine_mod.warm_step_shapes

    def timed_warm(runner, config):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return warm(runner, config)
        finally:
            warm_s.append(time.perf_counter() - t0)

    engine_mod.warm_step_shapes = timed_warm
    t0 = time.perf_counter()
    core, kwargs = build_core(args)
    build_s = time.perf_counter() - t0
    if args.snapshot_cache is not None:
        shutil.copytree(os.environ["TRITON_CACHE_DIR"], args.snapshot_cache, dirs_exist_ok=True)
    warmed = {(q, c) for q, c, _ in core.warmed_shapes}
    runner = core.runner
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    probes = {}
    for name, (query_lens, context_lens) in PROBES.items():
        assert (query_lens, context_lens) not in warmed, name
        times, paths = [], set()
        for _ in range(2 + args.reps):
            sync()
            t = time.perf_counter()
            paths.add(runner.run_step_shape(query_lens, context_lens))
            sync()
            times.append(1e3 * (time.perf_counter() - t))
        probes[name] = {"rows": sum(query_lens), "seqs": len(query_lens), "paths": sorted(paths),
                        "first_ms": round(times[0], 2), "second_ms": round(times[1], 2),
                        "median_after_ms": round(statistics.median(times[2:]), 2)}
    emit({
        "command": " ".join(["python", *sys.argv]),
        "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
        "device": torch.cuda.get_device_name() if runner.device.type == "cuda" else "cpu",
        "engine": {k: kwargs[k] for k in ("model", "fp8_scope", "max_num_running", "max_num_batched_tokens")
                   if k in kwargs},
        "build_s": round(build_s, 1),
        "warm_step_shapes": [[sum(q), len(q), path] for q, _, path in core.warmed_shapes],
        "warm_s": round(warm_s[0], 2) if warm_s else None,
        "probes": probes,
    }, args.out)


if __name__ == "__main__":
    main()
