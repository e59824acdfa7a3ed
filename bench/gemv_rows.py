"""FP8-weight products of 2-8 rows: the multi-row CUDA-core GEMV (runtime/kernels/fp8_gemv.py `gemv_rows`) over
a sweep of tiles, against the tensor-core kernel those rows ran on before (`fp8_gemv`: 16 rows by masking) and
against the one-row GEMV run once (runtime/kernels/gemv.py, the rate a weight-streaming kernel can reach here).
H200.

    python bench/gemv_rows.py --out bench/results/fp8-rows-h200/gemv-rows.json

Every output is checked against a float32 product with the dequantized weights first; then each product is timed
per call in CUDA graphs of 16 calls over 4 weight copies (L2 holds none of them).
"""
from __future__ import annotations

import argparse
import functools
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fast_tools import MATRIX_SHAPES, bench_result, emit, graph_us_per_call, log, sweep_tiles
from runtime.fp8 import quantize_weight
from runtime.kernels.fp8_gemv import fp8_gemv, gemv_rows
from runtime.kernels.gemv import gemv

COPIES = 4
CALLS = 16


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="2,4,8")
    p.add_argument("--budget-s", type=float, default=400)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    device = torch.device("cuda")
    result = bench_result("gemv_rows", argv, device, products=[])
    torch.manual_seed(0)
    for name in ("qkv", "o", "gate_up", "down"):
        n, k = MATRIX_SHAPES[name]
        qs = [quantize_weight(torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02) for _ in range(COPIES)]
        deq = qs[0].weight.float() * qs[0].scale[:, None]
        x1 = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        one_row = graph_us_per_call([functools.partial(gemv, x1, q.weight, scale=q.scale) for q in qs] * 4)
        for m in (int(r) for r in args.rows.split(",")):
            if time.perf_counter() - t0 > args.budget_s:
                break
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            want = x.float() @ deq.t()
            row: dict = {"matrix": name, "n": n, "k": k, "rows": m, "one_row_gemv_us": round(one_row, 2),
                         "tensor_core_us": round(graph_us_per_call(
                             [functools.partial(fp8_gemv, x, q.weight, q.scale) for q in qs] * 4), 2)}
            tiles_list = [t for t in itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8)) if k % t[1] == 0]

            def calls_for(tiles: tuple, x: torch.Tensor = x, qs: list = qs) -> list:
                return [functools.partial(gemv_rows, x, q.weight, q.scale, tiles) for q in qs] * 4

            tried = sweep_tiles(tiles_list, calls_for, want)
            timed = sorted((t for t in tried if "us" in t), key=lambda t: t["us"])
            row["best"] = timed[:3]
            row["candidates"] = tried
            log(f"{name} m={m}: one-row {row['one_row_gemv_us']} us, tensor cores {row['tensor_core_us']} us, "
                f"multi-row best {timed[:1]}")
            result["products"].append(row)
        del qs, deq
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
