"""Prefill chunks through the engine's prefill graphs with the doubling row buckets against the finer default.

    PYTHONUNBUFFERED=1 python bench/prefill_buckets.py --out bench/results/prefill-buckets-h200/prefill-buckets.json

A prompt's new rows run in the smallest bucket that holds them (`PrefillGraphRunner`), and the padding rows
cost as much as real ones. The case that matters most: a 512-token prompt behind the 128-token cached system
prompt is a 384-row chunk, which the doubling buckets (64, 128, 256, 512, ...) ran as 512 rows.

One process, full shape, random weights: the plain model prefills a cached prefix of `--prefix` rows, then each
chunk of n new rows (context prefix + n) runs through both runners. Each runner's last-row logits are first
compared with the plain eager model's on the same inputs (top-1 agreement, max |log p| difference, finite),
then every forward is timed with CUDA events (median / p10 / p90 of `--reps`). Same run: the plain eager
prefill (the unfused model) as the baseline and a large bf16 matmul's rate as the compute roofline.
"""
from __future__ import annotations

import argparse
import functools
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fast_tools import emit, log, logit_compare, make_rows, plain_inputs, time_ms
from runtime.config import ModelConfig
from runtime.cuda_graph import DEFAULT_PREFILL_BUCKETS, PrefillGraphRunner
from runtime.fast_forward import FastForward
from runtime.fused import fuse_model_weights
from runtime.kv_cache import allocate_kv_cache
from runtime.model import build_model

DOUBLING_BUCKETS = (64, 128, 256, 512, 1024, 2048)  # the runner's buckets before this bench


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="full")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prefix", type=int, default=128, help="cached rows before each chunk")
    p.add_argument("--sizes", default="64,128,192,256,320,384,448,512,640,768,1024")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def matmul_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """Rate of one large square product: the compute roofline of this run."""
    n = 8192
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    ms = time_ms(lambda: a @ b, 3, 20, device)["median_ms"]
    return 2 * n**3 / (ms / 1e3) / 1e12


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    dtype = torch.bfloat16 if on_cuda else torch.float32
    config = ModelConfig.preset(args.preset)
    sizes = [int(s) for s in args.sizes.split(",")]
    bs = args.block_size
    result: dict = {"bench": "prefill_buckets", "command": shlex.join(["python", "bench/prefill_buckets.py", *argv]),
                    "preset": args.preset, "device": str(device), "prefix_rows": args.prefix,
                    "buckets": {"doubling": list(DOUBLING_BUCKETS), "default": list(DEFAULT_PREFILL_BUCKETS)}}
    if on_cuda:
        result["device_name"] = torch.cuda.get_device_name(device)
        result["matmul_tflops"] = round(matmul_tflops(device, dtype), 1)
        log(f"matmul {result['matmul_tflops']} TFLOP/s")

    model = build_model(config, seed=0, device=device, dtype=dtype)
    weights = fuse_model_weights(model)
    fast = FastForward(weights)
    # matmul FLOPs of a chunk: every projection and MLP for all rows; the heads for its last row only
    head_params = config.hidden_size * (config.vocab_size + config.audio_vocab_size)
    params = weights.matrix_bytes() // dtype.itemsize - head_params
    longest = args.prefix + max(sizes)
    table = list(range(1, 1 + -(-longest // bs)))  # block 0 is what a runner's padding sequence reads
    cache = allocate_kv_cache(config, len(table) + 1, bs, device, dtype)
    table_t = torch.tensor(table, dtype=torch.int32, device=device)
    rows = make_rows(longest, 3)
    tok, aud, pos, attn = plain_inputs(rows[: args.prefix], [(args.prefix, args.prefix, table)], bs, device)
    model(tok, aud, pos, cache, attn)  # the cached prefix, as the prefix cache would hold it

    runners = {}
    for name, buckets in (("doubling", DOUBLING_BUCKETS), ("default", DEFAULT_PREFILL_BUCKETS)):
        runners[name] = PrefillGraphRunner(fast, cache, max_model_len=longest, buckets=buckets)
        runners[name].capture()
    log("graphs captured")

    chunks = []
    for n in sizes:
        seq_len = args.prefix + n
        tok, aud, pos, attn = plain_inputs(rows[args.prefix: seq_len], [(n, seq_len, table)], bs, device)
        want = model(tok, aud, pos, cache, attn)
        row: dict = {"rows": n, "context": seq_len, "matmul_flops": 2 * params * n}
        for name, runner in runners.items():
            run = functools.partial(runner.run, tok, aud, pos, attn.slot_mapping, table_t, seq_len)
            got = tuple(x.clone() for x in run())
            finite = all(bool(torch.isfinite(x).all()) for x in got)
            shapes_ok = got[0].shape == (1, config.vocab_size) and got[1].shape == (1, config.audio_vocab_size)
            entry = {"bucket": runner.bucket_for(n), "finite": finite, "shapes_ok": shapes_ok,
                     "vs_plain": logit_compare(got, want)}
            if not (finite and shapes_ok):
                raise SystemExit(f"{name} at {n} rows: finite={finite} shapes_ok={shapes_ok}")
            t = time_ms(run, 3, args.reps, device)
            entry.update(t)
            if on_cuda:
                entry["tflops"] = round(row["matmul_flops"] / (t["median_ms"] / 1e3) / 1e12, 1)
            row[name] = entry
        plain = time_ms(functools.partial(model, tok, aud, pos, cache, attn), 2, max(3, args.reps // 4), device)
        row["plain_eager"] = plain
        row["default_vs_doubling"] = round(row["doubling"]["median_ms"] / row["default"]["median_ms"], 3)
        log(f"{n} rows: doubling {row['doubling']['median_ms']} ms (bucket {row['doubling']['bucket']}), "
            f"default {row['default']['median_ms']} ms (bucket {row['default']['bucket']}), "
            f"plain {plain['median_ms']} ms")
        chunks.append(row)
    result["chunks"] = chunks
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
