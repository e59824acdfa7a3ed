"""Device memory of the engine's largest step off the CUDA graphs, under a Serve config's engine settings.

`EngineConfig.check_largest_step` runs, at start-up, max_num_batched_tokens rows over min(max_num_running,
rows // 2) fresh sequences, all sampling, twice with the first step's logits alive (`ModelRunner.run_largest_step`).
This script builds the engine without that run and times nothing: for each ROWSxSEQS shape it runs the same
step and records the allocator's peak above what the engine holds (torch.cuda.max_memory_allocated after a
reset), and whether it fit under the cap. With --start-up it builds the engine as a replica does (the check
on) and reports what the check left reserved, or its EngineMemoryError.

    python bench/largest_step.py --config config/serve-4090.yaml --preset full --random-weights \\
        --device cuda --shapes 256x8,512x2,512x24,1024x2,1024x24 --out /tmp/largest-step.json
    python bench/largest_step.py --config config/serve-4090.yaml --preset full --random-weights \\
        --device cuda --start-up --out /tmp/largest-step-start-up.json
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import runtime.engine as engine_module
from bench.engine_loop import add_engine_args, build_core
from bench.fast_tools import emit
from runtime.device_memory import memory_stats
from runtime.engine import EngineMemoryError

GIB = 2**30


def measure(core: Any, rows: int, seqs: int) -> dict[str, Any]:
    """One shape's peak allocation above the engine's own tensors, or its out-of-memory error."""
    device = core.runner.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out: dict[str, Any] = {"rows": rows, "seqs": seqs}
    try:
        core.runner.run_largest_step(rows, seqs)
        torch.cuda.synchronize(device)
        out["fits"] = True
    except torch.OutOfMemoryError as exc:
        out.update(fits=False, error=str(exc)[:300])
    out["peak_gib"] = round((torch.cuda.max_memory_allocated(device) - before) / GIB, 4)
    out["after"] = memory_stats(device)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--shapes", default="512x24,1024x24", help="ROWSxSEQS, comma separated")
    p.add_argument("--start-up", action="store_true",
                   help="instead: build the engine as a replica does (the start-up check on) and report it")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.check_largest_step = args.start_up
    result: dict[str, Any] = {
        "benchmark": "largest_step",
        "command": shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(argv)}
    if args.start_up:
        check = engine_module.run_largest_step

        def traced(runner: Any, config: Any) -> Any:  # the allocator's state the check starts from
            result["before_check"] = memory_stats(runner.device)
            return check(runner, config)

        engine_module.run_largest_step = traced
        try:
            core, kwargs = build_core(args)
        except EngineMemoryError as exc:
            result["start_up_check"] = {"ok": False, "error": str(exc)}
        else:
            step = core.largest_step
            result.update(engine=kwargs, start_up_check={
                "ok": True, "rows": step.num_rows, "seqs": step.num_seqs,
                "free_reserved_gib": round(step.free_reserved_bytes / GIB, 4),
                "after": memory_stats(core.runner.device)})
    else:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s.strip()]
        core, kwargs = build_core(args)
        device = core.runner.device
        if device.type != "cuda":
            raise SystemExit("this measures CUDA memory: pass --device cuda")
        result.update(engine=kwargs, device_name=torch.cuda.get_device_name(device),
                      after_build=memory_stats(device),
                      shapes=[measure(core, rows, seqs) for rows, seqs in shapes])
    emit(result, Path(args.out) if args.out else None)
    return result


if __name__ == "__main__":
    main()
