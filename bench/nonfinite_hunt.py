"""Hunt for non-finite logits: staggered arrivals through `EngineCore`, with a post-mortem at the first
request that ends with "the model produced non-finite logits".

    python bench/nonfinite_hunt.py --config config/serve-h200.yaml --preset full --random-weights \
        --device cuda --arrivals 64 --interval-ms 130 --variants base,nocache,sync --out hunt.json

Each variant runs the same workload on a fresh prefix cache and a zeroed KV cache: `--arrivals` requests
(512-token speech prompts that share the system prompt's blocks, as bench/client.py sends them), one every
`--interval-ms`, each generating `--max-new-tokens` codes, the core stepped on this thread as the engine's
step thread does. Variants: `base` (the config as it is), `nocache` (prefix caching off), `sync` (no
asynchronous steps), `solo` (one request at a time: no mixed prefill + decode steps), `torchops` (steps
outside the CUDA graphs run the PyTorch reference ops instead of the Triton kernels; matmuls unchanged),
`cublaslt` (PyTorch's matmuls through cuBLASLt instead of cuBLAS). At the first broken
request of a variant it records the engine's latest step records (path, sequences, rows), where the KV cache
holds non-finite values (layer instance, block, and what the block is: free, prefix-cached, whose), and
whether any weight is non-finite. Prints ONE JSON line.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shlex
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.engine_loop import add_engine_args, build_core
from bench.fast_tools import emit
from bench.measure import speech_prompt_text
from bench.pipeline import speech_request
from runtime.block_manager import BlockManager
from runtime.engine import EngineCore
from runtime.fast_ops import TorchOps
from runtime.matmul_check import MatmulCheckError
from runtime.request import Finished
from runtime.scheduler import Scheduler

VARIANTS = ("base", "nocache", "sync", "solo", "torchops", "cublaslt")


def nonfinite_blocks(core: EngineCore, limit: int = 64) -> dict[str, Any]:
    """Where the KV cache holds NaN or inf: (layer instance, block) pairs, and what each block is now."""
    cache = core.runner.kv_cache
    found: list[tuple[int, int, str]] = []
    for name, tensor in (("k", cache.k), ("v", cache.v)):
        for layer in range(tensor.shape[0]):
            bad = (~torch.isfinite(tensor[layer])).flatten(1).any(1).nonzero().flatten().tolist()
            found += [(layer, block, name) for block in bad]
    bm = core.block_manager
    owners: dict[int, list[str]] = {}
    for seq in core.scheduler.seqs.values():
        for block in seq.block_table:
            owners.setdefault(block, []).append(seq.request_id)
    cached = {block for block in (b.block_id for b in bm.blocks) if bm.blocks[block].block_hash is not None}
    blocks = sorted({block for _, block, _ in found})
    return {
        "num_pairs": len(found),
        "layers": sorted({layer for layer, _, _ in found}),
        "blocks": [{"block": b, "ref_count": bm.ref_count(b), "prefix_cached": b in cached,
                    "owners": owners.get(b, [])} for b in blocks[:limit]],
        "num_blocks": len(blocks),
    }


def nonfinite_weights(core: EngineCore) -> list[str]:
    """Names of the model's tensors (parameters and buffers) holding NaN or inf."""
    model = core.runner.model
    named = list(model.named_parameters()) + list(model.named_buffers())
    return [name for name, t in named if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def reset(core: EngineCore) -> None:
    """A zeroed KV cache, a fresh block manager + scheduler (no prefix cache, nothing running), no step log."""
    assert not core.has_work
    core.runner.kv_cache.k.zero_()
    core.runner.kv_cache.v.zero_()
    bm = core.block_manager
    core.block_manager = BlockManager(bm.num_blocks, bm.block_size, core.config.enable_prefix_caching)
    core.scheduler = Scheduler(core.config.scheduler_config(), core.block_manager)
    core.step_log.clear()  # (a full log would keep its length, and the paths counted below would be lost)


def run_variant(core: EngineCore, variant: str, make_request: Any, arrivals: int, interval_s: float,
                timeout_s: float) -> dict[str, Any]:
    """One variant's workload -> finish reasons, broken requests, the post-mortem of the first."""
    reset(core)
    core.async_scheduling = variant != "sync" and core.runner.device.type == "cuda"
    if variant == "nocache":
        core.block_manager.enable_prefix_caching = False
    broken: list[dict[str, Any]] = []
    post_mortem: dict[str, Any] = {}
    fail = core._fail_broken_logits

    def recording_fail(request_id: str, num_sampled: int) -> list[Any]:
        seq = core.scheduler.seqs.get(request_id)
        broken.append({"request": request_id, "step": steps, "sampled": num_sampled,
                       "computed": None if seq is None else seq.num_computed_tokens,
                       "generated": None if seq is None else seq.num_generated})
        if not post_mortem:
            post_mortem["steps"] = [dataclasses.asdict(r) for r in list(core.step_log)[-4:]]
            post_mortem["kv"] = nonfinite_blocks(core)
            post_mortem["weights"] = nonfinite_weights(core)
            post_mortem["running"] = [{"request": s.request_id, "computed": s.num_computed_tokens,
                                       "cached": s.num_cached_tokens, "blocks": list(s.block_table)}
                                      for s in core.scheduler.running]
        return fail(request_id, num_sampled)

    core._fail_broken_logits = recording_fail  # type: ignore[method-assign]
    fast = core.runner.fast
    ops = None if fast is None else fast.ops
    if variant == "torchops" and fast is not None:
        fast.ops = TorchOps()
    cuda = core.runner.device.type == "cuda"
    blas = torch.backends.cuda.preferred_blas_library() if cuda else None
    if variant == "cublaslt":
        if not cuda:
            raise SystemExit("the cublaslt variant needs CUDA")
        torch.backends.cuda.preferred_blas_library("cublaslt")
    finished: dict[str, Finished] = {}
    paths: Counter[str] = Counter()
    steps, added, start = 0, 0, time.perf_counter()
    try:
        while added < arrivals or core.has_work:
            now = time.perf_counter() - start
            if now > timeout_s:
                raise RuntimeError(f"variant {variant} ran past {timeout_s} s")
            solo_busy = variant == "solo" and core.has_work
            while added < arrivals and added * interval_s <= now and not solo_busy:
                core.add_request(make_request())
                added += 1
                solo_busy = variant == "solo"
            if not core.has_work:
                time.sleep(min(0.002, max(0.0, added * interval_s - now)))
                continue
            logged = len(core.step_log)
            for rid, event in core.step():
                if isinstance(event, Finished):
                    finished[rid] = event
            steps += 1
            paths.update(r.path for r in list(core.step_log)[logged:])
    finally:
        core._fail_broken_logits = fail  # type: ignore[method-assign]
        if fast is not None:
            fast.ops = ops
        if blas is not None:
            torch.backends.cuda.preferred_blas_library(blas)
    after = nonfinite_blocks(core) if broken else None
    return {
        "variant": variant, "async_steps": core.async_scheduling, "prefix_caching": core.block_manager.enable_prefix_caching,
        "wall_s": round(time.perf_counter() - start, 2), "steps": steps, "paths": dict(paths),
        "finish_reasons": dict(Counter(f.reason for f in finished.values())),
        "num_broken": len(broken), "broken": broken[:16], "post_mortem": post_mortem, "kv_after": after,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    p.add_argument("--arrivals", type=int, default=16)
    p.add_argument("--interval-ms", type=float, default=130.0)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--variants", default="base")
    p.add_argument("--timeout-s", type=float, default=120.0, help="per variant")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run every variant, print one JSON line (and write --out); returns it."""
    args = parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if unknown := set(variants) - set(VARIANTS):
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {VARIANTS}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    summary: dict[str, Any] = {
        "benchmark": "nonfinite_hunt",
        "command": shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(argv),
        "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "mps_active_thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
    }
    built = time.perf_counter()
    try:
        core, engine_kwargs = build_core(args)
    except MatmulCheckError as exc:  # the engine refused to start: that is the result
        summary["refused"] = str(exc)
        emit(summary, None if args.out is None else Path(args.out))
        return summary
    ids = iter(range(10**6))

    def make_request() -> Any:
        text = speech_prompt_text(args.prompt_tokens, variant=next(ids))
        return speech_request(core.tokenizer, text, max_new_tokens=args.max_new_tokens,
                              min_new_tokens=args.max_new_tokens, seed=None, temperature=None)

    summary.update({"engine": engine_kwargs, "build_s": round(time.perf_counter() - built, 2),
                    "num_kv_blocks": core.block_manager.num_blocks, "variants": []})
    for variant in variants:
        summary["variants"].append(run_variant(core, variant, make_request, args.arrivals,
                                               args.interval_ms / 1e3, args.timeout_s))
    emit(summary, None if args.out is None else Path(args.out))
    return summary


if __name__ == "__main__":
    main()
