"""FP8-weight products for more than 16 rows, per layer matrix of the full shape and row count (H200):
- `torch._scaled_mm` with per-row FP8 activations (runtime/fp8.py), its activations quantized by one Triton
  kernel (`fp8_scaled_mm`, the default) or by the eager ops it used before (`fp8_scaled_mm_eager`);
- the weight-only Triton kernel (runtime/kernels/fp8_gemm.py), over a sweep of tiles (its table `TILES`);
- bf16 cuBLAS, the baseline.

    python bench/fp8_rows.py --out bench/results/fp8-rows-h200/fp8-rows.json

Every candidate is first checked against a float32 product with the dequantized weights (relative error
under 1e-2, all finite); then each product is timed per call in a CUDA graph of 16 calls over 4 weight
copies (L2 holds none of them). `gbps` counts the weight bytes once. The sweep stops starting new shapes
after `--budget-s`.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fast_checks import act_quant_bit_equal
from bench.fast_tools import (
    MATRIX_SHAPES,
    bench_result,
    emit,
    graph_us_per_call,
    log,
    overridden,
    rel_err,
    sweep_tiles,
)
from runtime import fp8
from runtime.fp8 import _scaled_mm_linear, quantize_weight
from runtime.kernels.fp8_gemm import fp8_gemm
from runtime.kernels.fp8_gemv import fp8_gemv

COPIES = 4
CALLS = 16


def candidates(m: int, n: int, k: int) -> list[tuple[int, int, int, int, int, int]]:
    """(BM, BN, BK, warps, stages, SPLIT) to try for m rows."""
    if m <= 128:
        bm = max(16, 1 << (m - 1).bit_length())
        out = []
        for bn, bk, split in itertools.product((64, 128), (128, 256), (1, 2, 4, 8)):
            programs = -(-n // bn) * split
            if 96 <= programs <= 1200 and k % (split * bk) == 0:
                out.append((bm, bn, bk, 4, 4, split))
        return out
    return [(64, 128, 64, 4, 4, 1), (128, 128, 64, 8, 3, 1), (128, 128, 64, 8, 4, 1), (128, 256, 64, 8, 3, 1),
            (64, 256, 64, 8, 4, 1), (128, 128, 128, 8, 3, 1)]


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="24,64,128,512")
    p.add_argument("--shapes", default="qkv,o,gate_up,down,audio_head")
    p.add_argument("--budget-s", type=float, default=480)
    p.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the weight-only kernel's tiles")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    device = torch.device("cuda")
    result = bench_result("fp8_rows", argv, device, products=[], skipped=[])
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        n, k = MATRIX_SHAPES[name]
        ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        qs = [quantize_weight(w) for w in ws]
        deq = qs[0].weight.float() * qs[0].scale[:, None]
        for m in (int(r) for r in args.rows.split(",")):
            if time.perf_counter() - t0 > args.budget_s:
                result["skipped"].append({"matrix": name, "rows": m})
                continue
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            want = x.float() @ deq.t()
            row: dict = {"matrix": name, "n": n, "k": k, "rows": m, "fp8_bytes": n * k}
            row["bf16_cublas_us"] = round(graph_us_per_call(
                [functools.partial(F.linear, x, ws[i % COPIES]) for i in range(CALLS)]), 2)
            if m <= 16:  # what such rows run on: the tensor-core kernel of runtime/kernels/fp8_gemv.py
                row["fp8_gemv_us"] = round(graph_us_per_call(
                    [functools.partial(fp8_gemv, x, qs[i % COPIES].weight, qs[i % COPIES].scale)
                     for i in range(CALLS)]), 2)
            scaled = [functools.partial(_scaled_mm_linear, x, qs[i % COPIES]) for i in range(CALLS)]
            row["act_quant_bit_equal"] = act_quant_bit_equal(x)
            for kind, quant in (("fp8_scaled_mm", "triton"), ("fp8_scaled_mm_eager", "torch")):
                with overridden(fp8.OPTIONS, act_quant=quant):  # read while the graph is captured
                    row[kind + "_rel_err"] = round(rel_err(scaled[0](), want), 5)
                    row[kind + "_us"] = round(graph_us_per_call(scaled), 2)

            def calls_for(tiles: tuple, x: torch.Tensor = x, qs: list = qs) -> list:
                return [functools.partial(fp8_gemm, x, qs[i % COPIES].weight, qs[i % COPIES].scale, tiles)
                        for i in range(CALLS)]

            tried = sweep_tiles(candidates(m, n, k) if args.sweep else [], calls_for, want, nbytes=n * k)
            timed = [t for t in tried if "us" in t]
            row["candidates"] = tried
            if timed:
                best = min(timed, key=lambda t: t["us"])
                row["best"] = best
                row["speedup_vs_bf16"] = round(row["bf16_cublas_us"] / best["us"], 3)
                row["speedup_vs_scaled_mm"] = round(row["fp8_scaled_mm_us"] / best["us"], 3)
            log(f"{name} m={m}: bf16 {row['bf16_cublas_us']} us, fp8_gemv {row.get('fp8_gemv_us')} us, "
                f"scaled_mm {row['fp8_scaled_mm_us']} us "
                f"(eager quantization {row['fp8_scaled_mm_eager_us']}), weight-only best {row.get('best')}")
            result["products"].append(row)
        del ws, qs, deq
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
