"""The 24 GB profile: the full model under `torch.cuda.set_per_process_memory_fraction(24 GiB)`.

    python bench/profile_24gb.py [--vocoder-gib 2] [--kv-cache-dtype fp8 --bf16-kv-tokens 32768]

For bf16 weights and then FP8 weights ("all": layers and heads; bf16 matrices freed layer by layer as
they are quantized): load the full shape (load peak reported; the allocator cache is emptied after
loading), allocate the KV cache (bf16: 16k tokens; FP8: as many as fit beside the serving overhead
measured with bf16 and the vocoder reserve), capture the decode graphs (buckets 1..64, max_model_len
4096) and the prefill graphs (the engine's default buckets, 64..2048 rows), run a 2048-row prefill chunk and a decode step, and report the serving peak and what is left
for the vocoder. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.config import ModelConfig
from runtime.cuda_graph import DEFAULT_PREFILL_BUCKETS, DecodeGraphRunner, PrefillGraphRunner
from runtime.device_memory import cap_device_memory
from runtime.fast_forward import FastForward
from runtime.fused import fuse_model_weights, quantize_model_in_place
from runtime.kv_cache import allocate_kv_cache, kv_bytes_per_block, kv_storage_dtype
from runtime.model import build_model

GIB = 2**30
BLOCK = 16
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MAX_MODEL_LEN = 4096
CHUNK = 2048
MARGIN = GIB // 2  # FP8 serving overhead measured 0.3 GiB above bf16's (FP8 GEMV autotune, scaled_mm pads)


def run(mode: str, budget: int, kv_tokens: int | None, vocoder: int, overhead: int | None,
        prefill_buckets: list[int] | None = None, kv_cache_dtype: str = "auto") -> dict:
    device = torch.device("cuda")
    config = ModelConfig.preset("full")
    torch.cuda.reset_peak_memory_stats()
    model = build_model(config, seed=0, device=device, dtype=torch.bfloat16)
    # as EngineCore does with fast_path (and fp8_scope="all"): bf16 matrices released while quantizing
    weights = quantize_model_in_place(model, "all") if mode == "fp8" else fuse_model_weights(model)
    del model  # the fused weights keep every tensor the fast path needs
    torch.cuda.empty_cache()
    load_peak = torch.cuda.max_memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    weights_bytes = torch.cuda.memory_allocated()
    kv_dtype = kv_storage_dtype(kv_cache_dtype, torch.bfloat16)
    per_token = kv_bytes_per_block(config, 1, kv_dtype)  # with FP8 codes, their scales
    if kv_tokens is None:  # as many as fit beside the measured activation/graph overhead and the vocoder
        assert overhead is not None
        kv_tokens = (budget - weights_bytes - overhead - MARGIN - vocoder) // per_token // BLOCK * BLOCK
    cache = allocate_kv_cache(config, kv_tokens // BLOCK, BLOCK, device, kv_dtype)
    fast = FastForward(weights)
    runner = DecodeGraphRunner(fast, cache, max_model_len=MAX_MODEL_LEN, buckets=BUCKETS)
    runner.capture()
    prefill = PrefillGraphRunner(fast, cache, max_model_len=MAX_MODEL_LEN,  # the engine's buckets by default
                                 buckets=prefill_buckets)
    prefill.capture()
    # one chunked-prefill-sized step (CHUNK rows of one sequence) and one decode step after it
    n = CHUNK
    tokens = torch.randint(0, 151643, (n,), device=device)
    is_audio = torch.zeros(n, dtype=torch.bool, device=device)
    table = torch.arange(n // BLOCK + 1, dtype=torch.int32, device=device)
    text, _ = prefill.run(tokens, is_audio, torch.arange(n, device=device), torch.arange(n, device=device),
                          table[: n // BLOCK], n)
    ok = bool(torch.isfinite(text).all())
    t, a = runner.run(tokens[:1], is_audio[:1], torch.tensor([n], device=device), torch.tensor([n], device=device),
                      table[None, :], torch.tensor([n + 1], dtype=torch.int32, device=device))
    ok = ok and bool(torch.isfinite(t).all() and torch.isfinite(a).all())
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_reserved()
    kv_bytes = kv_tokens * per_token
    out = {
        "weights": mode, "kv_cache_dtype": kv_cache_dtype, "weights_gib": round(weights_bytes / GIB, 3), "load_peak_reserved_gib": round(load_peak / GIB, 3),
        "kv_tokens": kv_tokens,
        "kv_gib": round(kv_bytes / GIB, 3), "peak_reserved_gib": round(peak / GIB, 3),
        "overhead_gib": round((peak - weights_bytes - kv_bytes) / GIB, 3),
        "left_for_vocoder_gib": round((budget - peak) / GIB, 3), "outputs_finite": ok,
    }
    del runner, prefill, fast, cache, weights, text, t, a
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--budget-gib", type=float, default=24.0)
    p.add_argument("--vocoder-gib", type=float, default=2.0)
    p.add_argument("--bf16-kv-tokens", type=int, default=16384)
    p.add_argument("--prefill-buckets", default="", help="comma-separated row buckets (default: the engine's)")
    p.add_argument("--kv-cache-dtype", default="auto", help='"auto" (bf16) or "fp8" (runtime/kv_cache.py)')
    args = p.parse_args()
    prefill_buckets = [int(b) for b in args.prefill_buckets.split(",") if b] or None
    budget = int(args.budget_gib * GIB)
    cap_device_memory("cuda", budget)  # as a replica's memory_cap_bytes does
    vocoder = int(args.vocoder_gib * GIB)
    result: dict = {"budget_gib": args.budget_gib, "vocoder_reserve_gib": args.vocoder_gib,
                    "buckets": list(BUCKETS), "max_model_len": MAX_MODEL_LEN, "prefill_chunk": CHUNK,
                    "prefill_buckets": prefill_buckets or list(DEFAULT_PREFILL_BUCKETS)}
    runs = []
    for mode, tokens in (("bf16", args.bf16_kv_tokens), ("fp8", None)):
        try:
            overhead = None if not runs or "overhead_gib" not in runs[0] else int(runs[0]["overhead_gib"] * GIB)
            runs.append(run(mode, budget, tokens, vocoder, overhead, prefill_buckets, args.kv_cache_dtype))
        except torch.OutOfMemoryError as exc:
            runs.append({"weights": mode, "error": f"out of memory: {str(exc)[:300]}"})
            torch.cuda.empty_cache()
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    result["runs"] = runs
    print(json.dumps(result))


if __name__ == "__main__":
    main()
