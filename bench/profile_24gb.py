"""The 24 GB profile: the full model under `torch.cuda.set_per_process_memory_fraction(24 GiB)`.

    python bench/profile_24gb.py [--vocoder-gib 2]

For bf16 weights and then FP8 weights ("all": layers and heads; bf16 matrices freed layer by layer as
they are quantized): load the full shape (load peak reported; the allocator cache is emptied after
loading), allocate the KV cache (bf16: 16k tokens; FP8: as many as fit beside the serving overhead
measured with bf16 and the vocoder reserve), capture the decode graphs (buckets 1..64, max_model_len
4096), run a 2048-row prefill chunk and a decode step, and report the serving peak and what is left
for the vocoder. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.config import ModelConfig
from runtime.cuda_graph import DecodeGraphRunner
from runtime.fast_forward import FastForward, StepInputs
from runtime.fp8 import quantize_weight
from runtime.fused import FusedWeights, LayerWeights, fuse_model_weights
from runtime.kv_cache import allocate_kv_cache, kv_bytes_per_block
from runtime.model import build_model

GIB = 2**30
BLOCK = 16
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MAX_MODEL_LEN = 4096
CHUNK = 2048


def _quantize_in_place(box: list[FusedWeights]) -> FusedWeights:
    """FP8 copy of every matrix, dropping each bf16 layer as soon as its FP8 twin exists.

    `box` holds the only reference to the bf16 weights, so they can be freed while quantizing.
    """
    weights = box.pop()
    fields = {f.name: getattr(weights, f.name) for f in dataclasses.fields(weights)}
    del weights
    for block in ("shared", "text", "audio"):
        layers: list[LayerWeights] = list(fields.pop(block))
        for i, layer in enumerate(layers):
            layers[i] = dataclasses.replace(layer, **{k: quantize_weight(w) for k, w in layer.matrices().items()})
            del layer
        fields[block] = tuple(layers)
        torch.cuda.empty_cache()
    for head in ("text_head", "audio_head"):
        fields[head] = quantize_weight(fields.pop(head))
    torch.cuda.empty_cache()
    return FusedWeights(**fields)


def run(mode: str, budget: int, kv_tokens: int | None, vocoder: int, overhead: int | None) -> dict:
    device = torch.device("cuda")
    config = ModelConfig.preset("full")
    torch.cuda.reset_peak_memory_stats()
    model = build_model(config, seed=0, device=device, dtype=torch.bfloat16)
    weights = fuse_model_weights(model)
    del model  # the fused weights keep every tensor alive; the module tree is not needed
    if mode == "fp8":
        box = [weights]
        del weights
        weights = _quantize_in_place(box)
    torch.cuda.empty_cache()
    load_peak = torch.cuda.max_memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    weights_bytes = torch.cuda.memory_allocated()
    per_token = kv_bytes_per_block(config, 1, torch.bfloat16)
    if kv_tokens is None:  # as many as fit beside the measured activation/graph overhead and the vocoder
        assert overhead is not None
        kv_tokens = (budget - weights_bytes - overhead - vocoder) // per_token // BLOCK * BLOCK
    cache = allocate_kv_cache(config, kv_tokens // BLOCK, BLOCK, device, torch.bfloat16)
    fast = FastForward(weights)
    runner = DecodeGraphRunner(fast, cache, max_model_len=MAX_MODEL_LEN, buckets=BUCKETS)
    runner.capture()
    # one chunked-prefill-sized step (CHUNK rows of one sequence) and one decode step
    n = CHUNK
    tokens = torch.randint(0, 151643, (n,), device=device)
    step = StepInputs(
        tokens=tokens, is_audio=torch.zeros(n, dtype=torch.bool, device=device),
        positions=torch.arange(n, device=device), slot_mapping=torch.arange(n, device=device),
        block_tables=torch.arange(n // BLOCK, dtype=torch.int32, device=device)[None, :],
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        query_start=torch.tensor([0, n], dtype=torch.int32, device=device),
        logits_indices=torch.tensor([n - 1], device=device), max_query_len=n,
    )
    text, _ = fast(step, cache)
    ok = bool(torch.isfinite(text).all())
    t, a = runner.run(tokens[:1], step.is_audio[:1], torch.tensor([n], device=device),
                      torch.tensor([n], device=device), step.block_tables[:, : n // BLOCK + 1],
                      torch.tensor([n + 1], dtype=torch.int32, device=device))
    ok = ok and bool(torch.isfinite(t).all() and torch.isfinite(a).all())
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_reserved()
    kv_bytes = cache.k.numel() * cache.k.element_size() * 2
    out = {
        "weights": mode, "weights_gib": round(weights_bytes / GIB, 3), "load_peak_reserved_gib": round(load_peak / GIB, 3),
        "kv_tokens": kv_tokens,
        "kv_gib": round(kv_bytes / GIB, 3), "peak_reserved_gib": round(peak / GIB, 3),
        "overhead_gib": round((peak - weights_bytes - kv_bytes) / GIB, 3),
        "left_for_vocoder_gib": round((budget - peak) / GIB, 3), "outputs_finite": ok,
    }
    del runner, fast, cache, weights, text, t, a, step
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--budget-gib", type=float, default=24.0)
    p.add_argument("--vocoder-gib", type=float, default=2.0)
    p.add_argument("--bf16-kv-tokens", type=int, default=16384)
    args = p.parse_args()
    total = torch.cuda.get_device_properties(0).total_memory
    budget = int(args.budget_gib * GIB)
    torch.cuda.set_per_process_memory_fraction(budget / total)
    vocoder = int(args.vocoder_gib * GIB)
    result: dict = {"budget_gib": args.budget_gib, "vocoder_reserve_gib": args.vocoder_gib,
                    "buckets": list(BUCKETS), "max_model_len": MAX_MODEL_LEN, "prefill_chunk": CHUNK}
    runs = []
    for mode, tokens in (("bf16", args.bf16_kv_tokens), ("fp8", None)):
        try:
            overhead = None if not runs or "overhead_gib" not in runs[0] else int(runs[0]["overhead_gib"] * GIB)
            runs.append(run(mode, budget, tokens, vocoder, overhead))
        except torch.OutOfMemoryError as exc:
            runs.append({"weights": mode, "error": f"out of memory: {str(exc)[:300]}"})
            torch.cuda.empty_cache()
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    result["runs"] = runs
    print(json.dumps(result))


if __name__ == "__main__":
    main()
