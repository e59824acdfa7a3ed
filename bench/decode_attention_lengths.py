"""Decode-attention launch shapes at every loop-trip edge: runs to completion and agrees (H200).

    python bench/decode_attention_lengths.py --configs "32,1,2;64,4,2" \
        --out bench/results/decode-attention-tune-h200/lengths.json

Each (key tile, warps, stages) runs the decode kernel with and without the fused q/k RoPE + K/V store, and
the store-only mode, at `--batches` sequences (96 and 128) whose contexts are 1, 2, 3, 15-17, 31-34, 63-66,
95-97, 100, 513, 1000 keys or mixed (1-1023), with the new rows stored or all padding (slot -1), and compares
each output with the engine's wide launch (64, 4, 2) over unsplit keys (`--parts`: the checked launches split
them). A launch that hangs the GPU never returns: a watchdog ends the process after `--watchdog` seconds with
a traceback, so run one process per config in a loop (as the command in the results README does). Found this
way: (32, 1, 3) with the fused RoPE hangs when a sequence has at most 32 keys (one loop trip); (32, 1, 2)
does not (runtime/kernels/paged_attention.py, NARROW_LAUNCH).
"""
from __future__ import annotations

import argparse
import faulthandler
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.decode_attention_tune import BLOCK, DIM, EPS, HEADS, KV, THETA, new_row_slots
from bench.fast_checks import fp8_cache
from bench.fast_tools import emit, log
from runtime.fast_ops import rope_tables
from runtime.kernels.paged_attention import paged_decode_attention, paged_decode_attention_rope

WIDTH = 64  # blocks per sequence's table
LENGTHS = (1, 2, 3, 15, 16, 17, 31, 32, 33, 34, 63, 64, 65, 66, 95, 96, 97, 100, 513, 1000, "mixed")
WIDE = {"block_n": 64, "num_warps": 4, "num_stages": 2}


def check_config(cfg: dict, dev: torch.device, batches: tuple[int, ...] = (96, 128), parts: int = 1,
                 fp8: bool = False) -> dict:
    """Every case for one launch shape -> {"cases": n, "max_abs_vs_wide": x, "all_finite": bool}. `fp8`: the
    caches hold FP8 codes and scales (runtime/kv_cache.py), the wide launch reads the same codes."""
    cos, sin = rope_tables(4096, DIM, THETA, torch.bfloat16, dev)
    q_norm = torch.ones(DIM, device=dev, dtype=torch.bfloat16)
    k_cache = torch.randn(max(batches) * WIDTH, BLOCK, KV, DIM, device=dev, dtype=torch.bfloat16)  # no sharing
    v_cache = torch.randn_like(k_cache)
    scales: dict[str, torch.Tensor] = {}
    if fp8:
        k_cache, v_cache, scales = fp8_cache(k_cache, v_cache)
    gen = torch.Generator().manual_seed(0)
    cases, worst, finite = 0, 0.0, True
    for batch in batches:
        tables = torch.arange(batch * WIDTH, dtype=torch.int32, device=dev).view(batch, WIDTH)
        for n in LENGTHS:
            if n == "mixed":
                lens = torch.randint(1, BLOCK * WIDTH, (batch,), generator=gen, dtype=torch.int32).to(dev)
            else:
                lens = torch.full((batch,), n, dtype=torch.int32, device=dev)
            pos = (lens - 1).long()
            for padding in (False, True):
                if padding:
                    slots = torch.full((batch,), -1, dtype=torch.int64, device=dev)
                else:
                    slots = new_row_slots(tables, pos)
                qkv = torch.randn(batch, (HEADS + 2 * KV) * DIM, device=dev, dtype=torch.bfloat16)
                args = (qkv, q_norm, q_norm, cos, sin, pos, slots, k_cache, v_cache, tables, lens)
                got = paged_decode_attention_rope(*args, parts, HEADS, EPS, **cfg, **scales)
                want = paged_decode_attention_rope(*args, 1, HEADS, EPS, **WIDE, **scales)
                paged_decode_attention_rope(*args, parts, HEADS, EPS, store_only=True, **cfg, **scales)
                q = torch.randn(batch, HEADS, DIM, device=dev, dtype=torch.bfloat16)
                got_q = paged_decode_attention(q, k_cache, v_cache, tables, lens, parts, **cfg, **scales)
                want_q = paged_decode_attention(q, k_cache, v_cache, tables, lens, 1, **WIDE, **scales)
                torch.cuda.synchronize()
                finite &= bool(torch.isfinite(got).all() and torch.isfinite(got_q).all())
                worst = max(worst, float((got.float() - want.float()).abs().max()),
                            float((got_q.float() - want_q.float()).abs().max()))
                cases += 1
    return {"cases": cases, "max_abs_vs_wide": worst, "all_finite": finite}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="32,1,2", help="key tile,warps,stages;...")
    ap.add_argument("--batches", default="96,128", help="sequences per call")
    ap.add_argument("--parts", type=int, default=1, help="key partitions of the checked launches")
    ap.add_argument("--watchdog", type=float, default=100.0, help="seconds before a hung process is ended")
    ap.add_argument("--fp8", action="store_true", help="FP8 caches (codes and scales)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.watchdog, exit=True)
    dev = torch.device("cuda")
    result: dict = {"bench": "decode_attention_lengths",
                    "command": shlex.join(["python", "bench/decode_attention_lengths.py", *sys.argv[1:]]),
                    "device_name": torch.cuda.get_device_name(), "torch": torch.__version__, "configs": []}
    for spec in args.configs.split(";"):
        bn, warps, stages = (int(v) for v in spec.split(","))
        cfg = {"block_n": bn, "num_warps": warps, "num_stages": stages}
        log(f"{spec} ...")
        batches = tuple(int(b) for b in args.batches.split(","))
        result["configs"].append({"config": spec, "batches": list(batches), "parts": args.parts, "fp8": args.fp8,
                                  **check_config(cfg, dev, batches, args.parts, args.fp8)})
        log(f"{spec}: {result['configs'][-1]}")
    emit(result, Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
