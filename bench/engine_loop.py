"""The engine's serving loop alone: `EngineCore.step()` under a closed loop of speech requests.

    python bench/engine_loop.py --preset tiny --device cpu --concurrency 1,8 --max-new-tokens 24
    python bench/engine_loop.py --config config/serve-h200.yaml --preset full --random-weights \
        --device cuda --concurrency 1,8,64,256 --prompt-tokens 512 --max-new-tokens 100

No vocoder, no asyncio, no Ray: `concurrency` requests are kept in flight (a finished one is replaced at
once) and the core is stepped on this thread, as the engine's step thread does. Per level it reports
the time from a request's arrival to its first audio code, the interval between its codes, and where
each step's wall time went (`runtime.engine.StepRecord`: schedule, prepare, forward launch, sample
including the wait for the GPU, record), grouped by the model runner's path. In the same run, for every
decode batch size seen, the bare forward (the bucket's graph replayed back to back) is timed as the
floor the loop is measured against. `--sync` waits for the GPU after each forward launch, so
`forward_s` holds the GPU time and `sample_s` only sampling (slower; for attribution).
Prints ONE JSON line.
"""
from __future__ import annotations

import argparse
import itertools
import json
import shlex
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import runtime.model_runner
import runtime.sampling
from bench.engine import time_fn
from bench.measure import percentiles, requests_per_level, speech_prompt_text
from bench.pipeline import settings_from_config, speech_request
from runtime.device_memory import memory_stats
from runtime.engine import EngineConfig, EngineCore, StepRecord
from runtime.request import AudioCodes, Finished

PHASES = ("schedule_s", "prepare_s", "forward_s", "sample_s", "record_s")


def build_core(args: argparse.Namespace) -> tuple[EngineCore, dict[str, Any]]:
    """The engine core from --config plus command-line overrides -> (core, engine kwargs)."""
    kwargs, _ = settings_from_config(args.config)
    kwargs["model"] = args.preset
    overrides = {"device": args.device, "dtype": args.dtype, "max_num_running": args.max_num_running,
                 "kv_cache_bytes": args.kv_cache_bytes, "max_num_batched_tokens": args.max_num_batched_tokens}
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    if args.fast_path is not None:
        kwargs["fast_path"] = args.fast_path
    for check in ("check_matmuls", "check_largest_step", "warm_step_shapes"):
        if getattr(args, check) is not None:
            kwargs[check] = getattr(args, check)
    if kwargs["model"] == "full" and not args.random_weights:
        raise SystemExit("the 'full' preset has random weights: pass --random-weights to say you mean it")
    return EngineCore.from_config(EngineConfig(**kwargs)), kwargs


def sync_forward(core: EngineCore) -> None:
    """Make the runner wait for the GPU after launching each forward (attribution mode)."""
    launch = core.runner.forward
    device = core.runner.device

    def forward(inp: Any, feed: Any = None) -> Any:
        logits = launch(inp, feed)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return logits

    core.runner.forward = forward  # type: ignore[method-assign]


def timeline(prof: Any, num_steps: int, wall_s: float, top: int = 30) -> dict[str, Any]:
    """What the GPU did during `num_steps` profiled loop steps: the union of its kernel and copy intervals
    (busy), the rest of the wall time (idle: the GPU waited for the host), and the kernels by name."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, reach = 0.0, float("-inf")
    for start, end, _ in spans:  # union of intervals, in us
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    by_name: dict[str, list[float]] = defaultdict(list)
    for start, end, name in spans:
        by_name[name[:90]].append(end - start)
    names = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    return {
        "steps": num_steps, "wall_ms_per_step": wall_s * 1e3 / num_steps,
        "gpu_busy_ms_per_step": busy / 1e3 / num_steps,
        "gpu_idle_ms_per_step": wall_s * 1e3 / num_steps - busy / 1e3 / num_steps,
        "kernels": [{"name": n, "us_per_step": round(sum(d) / num_steps, 1), "calls_per_step": len(d) / num_steps}
                    for n, d in names[:top]],
        "host_ops": [{"name": e.key[:90], "self_us_per_step": round(e.self_cpu_time_total / num_steps, 1),
                      "calls_per_step": e.count / num_steps}
                     for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]],
        "host_waits": host_waits(prof, num_steps),
    }


WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
         "cudaHostAlloc", "cudaMalloc", "cudaFreeHost", "cudaFree")


def host_waits(prof: Any, num_steps: int) -> list[dict[str, Any]]:
    """Host calls that can wait for the GPU, grouped by the project's innermost frames that made them
    (the profile needs `with_stack`): calls and microseconds per step."""
    groups: dict[tuple[str, ...], list[float]] = defaultdict(list)
    for e in prof.events():
        if e.name not in WAITS:
            continue
        op, names = e, []  # runtime calls carry no Python stack: take the nearest enclosing op's
        while op is not None and not op.stack:
            op = op.cpu_parent
            if op is not None:
                names.append(op.name)
        stack = op.stack if op is not None else []
        ours = [f for f in stack if ("runtime/" in f or "bench/" in f or "deployments/" in f)]
        groups[(e.name, " < ".join(names[:3]), *ours[:3])].append(e.cpu_time_total)
    return [{"call": k[0], "ops": k[1], "from": list(k[2:]), "calls_per_step": len(v) / num_steps,
             "us_per_step": round(sum(v) / num_steps, 1)}
            for k, v in sorted(groups.items(), key=lambda kv: -sum(kv[1]))]


def run_level(core: EngineCore, make_request: Any, concurrency: int, num_requests: int,
              profile_steps: int = 0) -> dict[str, Any]:
    """Closed loop at `concurrency` until `num_requests` requests finished -> one level's summary.
    `profile_steps` > 0: the GPU timeline of that many consecutive steps at full concurrency
    (torch.profiler; from the first step after one where every request decoded), under "timeline"."""
    arrivals: dict[str, float] = {}
    code_times: dict[str, list[float]] = defaultdict(list)
    finished: dict[str, Finished] = {}
    remaining = num_requests
    core.step_log.clear()

    def admit() -> None:
        nonlocal remaining
        while remaining and len(arrivals) - len(finished) < concurrency:
            request = make_request()
            core.add_request(request)
            arrivals[request.request_id] = time.perf_counter()
            remaining -= 1

    started = time.perf_counter()
    admit()
    prof, profiled, profile_start, profile_report = None, 0, 0.0, None
    while core.has_work:
        if (profile_steps and prof is None and profile_report is None and core.step_log
                and core.step_log[-1].num_decode_seqs == core.step_log[-1].num_seqs == concurrency):
            from torch.profiler import ProfilerActivity, profile

            cuda = core.runner.device.type == "cuda"
            if cuda:
                torch.cuda.synchronize()
            prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                           with_stack=True)
            prof.__enter__()
            profile_start = time.perf_counter()
        events = core.step()
        if prof is not None:
            profiled += 1
            if profiled == profile_steps:
                if core.runner.device.type == "cuda":
                    torch.cuda.synchronize()
                wall = time.perf_counter() - profile_start
                prof.__exit__(None, None, None)
                profile_report = timeline(prof, profiled, wall)
                profile_report["paths"] = sorted({r.path for r in list(core.step_log)[-profiled:]})
                prof = None
        now = time.perf_counter()
        for rid, event in events:
            if isinstance(event, AudioCodes):
                code_times[rid].extend([now] * len(event.codes))
            elif isinstance(event, Finished):
                finished[rid] = event
        admit()
    wall_s = time.perf_counter() - started
    steps = list(core.step_log)
    bad = {rid: f.reason for rid, f in finished.items() if f.reason not in ("stop", "length")}
    if bad or len(finished) != num_requests:
        raise RuntimeError(f"requests did not finish cleanly: {bad or len(finished)}")
    first = [code_times[rid][0] - arrivals[rid] for rid in arrivals if code_times[rid]]
    intervals = [(t[-1] - t[0]) / (len(t) - 1) for t in code_times.values() if len(t) > 1]
    num_codes = sum(len(t) for t in code_times.values())
    return {
        "concurrency": concurrency, "num_requests": num_requests, "wall_s": wall_s,
        "codes_per_s": num_codes / wall_s, "audio_s_per_wall_s": num_codes * 0.08 / wall_s,
        "num_codes_per_request": sorted({len(t) for t in code_times.values()}),
        "num_prompt_tokens_seen": sorted({f.num_prompt_tokens for f in finished.values()}),
        "first_code_s": percentiles(first),
        "code_interval_s": percentiles(intervals),
        "steps": summarize_steps(steps),
        "decode_batch_sizes": sorted({r.num_seqs for r in steps if r.path == "graph"}),
        **({"timeline": profile_report} if profile_steps else {}),
    }


def indexed_penalty_mask(logits: torch.Tensor, histories: list[Any], params: list[Any]) -> torch.Tensor:
    """`runtime.sampling._penalise_channel` as of commit cafc81d: the presence mask set by an indexed
    assignment of True, which copies the value from pageable memory and so waits for the forward pass
    before the sampler's kernels are launched ("legacy" in --async-steps)."""
    import numpy as np

    if all(p.repetition_penalty == 1.0 for p in params):
        return logits
    num_seqs, vocab_size = logits.shape
    ids = [h.ids() for h in histories]
    rows = np.repeat(np.arange(num_seqs, dtype=np.int64), [len(i) for i in ids])
    where = runtime.sampling.to_device(torch.from_numpy(np.stack([rows, np.concatenate(ids)])), logits.device)
    seen = torch.zeros(num_seqs, vocab_size, dtype=torch.bool, device=logits.device)
    seen[where[0], where[1]] = True
    penalties = runtime.sampling.to_device(
        torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype), logits.device)
    return runtime.sampling.apply_repetition_penalty(logits, seen, penalties)


def check_async_rows(core: EngineCore, make_request: Any, num_requests: int) -> dict[str, Any]:
    """The rows of `num_requests` seeded requests run together three times: synchronous steps twice, then
    asynchronous ones. The second and third runs see the same prefix-cache hits (the first fills the cache),
    so their batches are the same step for step and the rows must be equal; the first two show the runs'
    own repeatability."""
    runs = []
    for async_steps in (False, False, True):
        core.async_scheduling = async_steps
        seqs = [core.add_request(make_request(seed)) for seed in range(num_requests)]
        while core.has_work:
            core.step()
        if any(seq.finish_reason not in ("stop", "length") for seq in seqs):
            raise RuntimeError(f"check requests ended {[seq.finish_reason for seq in seqs]}")
        runs.append([seq.rows[seq.num_prompt_rows:] for seq in seqs])
    mismatch = [i for i, (a, b) in enumerate(zip(runs[1], runs[2], strict=True)) if a != b]
    return {"requests": num_requests, "rows_per_request": sorted({len(r) for r in runs[2]}),
            "sync_runs_equal": runs[0] == runs[1], "async_equals_sync": not mismatch,
            "mismatched_requests": mismatch, "step_reruns": core.num_step_reruns}


def summarize_steps(steps: list[StepRecord]) -> dict[str, Any]:
    """Per runner path: step count, rows, and each phase's mean / p50 / max wall time in ms."""
    out: dict[str, Any] = {}
    for path in sorted({r.path for r in steps}):
        group = [r for r in steps if r.path == path]
        totals = percentiles([r.total_s * 1e3 for r in group])
        entry: dict[str, Any] = {
            "num_steps": len(group), "rows_mean": statistics.fmean(r.num_rows for r in group),
            "seqs_mean": statistics.fmean(r.num_seqs for r in group),
            "total_ms": {k: v for k, v in totals.items() if k != "count"},
            "sum_s": sum(r.total_s for r in group),
        }
        for phase in PHASES:
            values = [getattr(r, phase) * 1e3 for r in group]
            entry[phase.removesuffix("_s") + "_ms"] = {"mean": statistics.fmean(values),
                                                      "p50": statistics.median(values), "max": max(values)}
        out[path] = entry
    return out


def time_bare_decode(core: EngineCore, batch_sizes: list[int], reps: int) -> dict[str, Any]:
    """The forward alone, per decode batch bucket: graph replays back to back (the loop's floor)."""
    runner = core.runner
    graphs = runner.graphs
    if graphs is None or not graphs.graphs:
        return {}
    graphs.slot_mapping.fill_(-1)  # store no K/V: the last step's slots may be in cached prefix blocks
    out: dict[str, Any] = {}
    for bucket in sorted({graphs.bucket_for(b) for b in batch_sizes}):
        timing = time_fn(graphs.graphs[bucket].replay, runner.device, warmup=3, reps=reps)
        out[str(bucket)] = {"median_ms": timing.median_ms, "p90_ms": timing.p90_ms}
    return out


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The options `build_core` reads: a Serve YAML's engine settings and command-line overrides."""
    p.add_argument("--config", default=None, help="Serve YAML to take the engine settings from")
    p.add_argument("--preset", choices=("tiny", "full"), default="tiny")
    p.add_argument("--random-weights", action="store_true", help="required with --preset full")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--max-num-running", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--fast-path", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--check-matmuls", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine's start-up check of its matrix products (default: on CUDA)")
    p.add_argument("--check-largest-step", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine's start-up run of its largest step (default: on CUDA)")
    p.add_argument("--warm-step-shapes", action=argparse.BooleanOptionalAction, default=None,
                   help="the engine's start-up eager steps of runtime.engine.step_shapes (default: on CUDA, fast path)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--requests", default=None, help="requests per level: N or one per level (default 2 x c)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--sync", action="store_true", help="wait for the GPU after each forward launch")
    p.add_argument("--bare-reps", type=int, default=20)
    p.add_argument("--sampling-copies", choices=("pinned", "pageable"), default="pinned",
                   help="how the sampler's small host tensors reach the GPU: pinned (the engine's way, no wait) or "
                        "pageable (the earlier way: each copy waits for the stream), for an A/B")
    p.add_argument("--decode-inputs", default="staged",
                   help="how a graph decode step's inputs reach the GPU: staged (the engine's way: one copy from a "
                        "pinned mirror) or tensors (the earlier way: a tensor per input); a comma list runs every "
                        "level once per entry, in that order, in this one process (an A/B without the spread "
                        "between processes)")
    p.add_argument("--tie-margins", default=None,
                   help="runtime.sampling.TOPK_TIE_MARGIN (top-k candidates beyond the largest top_k): a comma list "
                        "runs every level once per entry in this process, with one --decode-inputs (an A/B; "
                        "default: the engine's); each level reports its full-sort redraws")
    p.add_argument("--async-steps", default=None,
                   help="EngineCore.async_scheduling: on (launch step n+1 before reading step n's ids), off, or legacy "
                        "(off, with the sampler's presence mask set as as of commit cafc81d, "
                        "which waited for the forward pass: bench.engine_loop.indexed_penalty_mask); a comma "
                        "list runs every level once per entry in this process (an A/B; default: the engine's, on for "
                        "CUDA); one option of --decode-inputs, --tie-margins, --async-steps may list several")
    p.add_argument("--check-async", type=int, default=0,
                   help="before timing, run this many seeded requests with synchronous and asynchronous steps and "
                        "compare their rows (under 'async_check')")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="per level, profile this many decode steps at full concurrency (GPU figures on CUDA): GPU busy "
                        "and idle time per step and the kernels by name, under 'timeline' (the profiler slows "
                        "the host and those steps count in the level's step times: run without it for those)")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every level, print one JSON line (and write --out); returns it."""
    args = parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    counts = requests_per_level(levels, args.requests) if args.requests else [2 * c for c in levels]
    built = time.perf_counter()
    core, engine_kwargs = build_core(args)
    if args.sync:
        sync_forward(core)
    if args.sampling_copies == "pageable":
        runtime.sampling.to_device = lambda t, device: t.to(device)

    modes = args.decode_inputs.split(",")
    if any(m not in ("staged", "tensors") for m in modes):
        raise SystemExit(f"--decode-inputs: staged or tensors, got {args.decode_inputs!r}")
    margins = [int(m) for m in args.tie_margins.split(",")] if args.tie_margins else [runtime.sampling.TOPK_TIE_MARGIN]
    steps = (["on" if core.async_scheduling else "off"] if args.async_steps is None
             else args.async_steps.split(","))
    if any(a not in ("on", "off", "legacy") for a in steps):
        raise SystemExit(f"--async-steps: on, off or legacy, got {args.async_steps!r}")
    if sum(len(v) > 1 for v in (modes, margins, steps)) > 1:
        raise SystemExit("only one of --decode-inputs, --tie-margins, --async-steps may list several entries")
    runs = [(m, t, a) for m in modes for t in margins for a in steps]
    device = core.runner.device
    summary: dict[str, Any] = {
        "benchmark": "engine_loop",
        "command": shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(argv),
        "engine": engine_kwargs, "build_s": time.perf_counter() - built, "sync": args.sync,
        "sampling_copies": args.sampling_copies, "decode_inputs": args.decode_inputs,
        "tie_margins": args.tie_margins, "async_steps": args.async_steps,
        "request": {"prompt_tokens": args.prompt_tokens, "max_new_tokens": args.max_new_tokens,
                    "fixed_length": True, "audio_sampling": "upstream defaults (0.6 / top-k 20 / top-p 0.95)"},
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "memory_after_build": memory_stats(device),  # the allocator's bytes (and the cap) on CUDA, else None
        "levels": [],
    }
    variants = itertools.count()

    def make_request() -> Any:
        text = speech_prompt_text(args.prompt_tokens, variant=next(variants))
        return speech_request(core.tokenizer, text, max_new_tokens=args.max_new_tokens,
                              min_new_tokens=args.max_new_tokens, seed=None, temperature=None)

    penalise_channel = runtime.sampling._penalise_channel
    run_level(core, make_request, 1, 2)  # warm-up: first-use costs (allocator, kernels, caches)
    if args.check_async:
        check_text = speech_prompt_text(args.prompt_tokens, variant=10**6)
        summary["async_check"] = check_async_rows(
            core, lambda seed: speech_request(core.tokenizer, check_text, max_new_tokens=args.max_new_tokens,
                                              min_new_tokens=args.max_new_tokens, seed=seed, temperature=None),
            args.check_async)
        if not summary["async_check"]["async_equals_sync"]:
            raise SystemExit(f"asynchronous steps changed rows: {summary['async_check']}")
    for mode, margin, async_steps in runs:
        runtime.model_runner.STAGED_DECODE_INPUTS = mode == "staged"
        runtime.sampling.TOPK_TIE_MARGIN = margin
        core.async_scheduling = async_steps == "on"  # (between levels nothing is in flight)
        runtime.sampling._penalise_channel = indexed_penalty_mask if async_steps == "legacy" else penalise_channel
        for concurrency, count in zip(levels, counts, strict=True):
            redraws, reruns = runtime.sampling.num_full_sort_redraws, core.num_step_reruns
            level = {"decode_inputs": mode, "tie_margin": margin, "async_steps": async_steps,
                     **run_level(core, make_request, concurrency, count, args.profile_steps)}
            level["full_sort_redraws"] = runtime.sampling.num_full_sort_redraws - redraws
            level["step_reruns"] = core.num_step_reruns - reruns
            level["bare_decode_ms"] = time_bare_decode(core, level["decode_batch_sizes"], args.bare_reps)
            summary["levels"].append(level)
            if args.out:
                Path(args.out).write_text(json.dumps(summary) + "\n")
    summary["memory_after_levels"] = memory_stats(device)
    line = json.dumps(summary)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")
    return summary


if __name__ == "__main__":
    main()
