"""How much faster a decode product runs when its weights are already in L2: the ceiling of any scheme that
brings a small matrix into L2 while the step's attention leaves DRAM partly idle.

    python bench/l2_resident.py --out bench/results/fusion-ceiling-h200/l2-resident.json

Per matrix that fits L2 (o, qkv of the full shape) and row count: the product in CUDA graphs of back-to-back
calls, "cold" rotating 8 weight copies (none left in L2 by the call before), "warm" on one copy (all of it
left in L2 by the call before). Rows 1: the step's one-row GEMV (bf16 and FP8); more rows: cuBLAS (F.linear),
as the step runs them. Outputs are checked against float32 first.
"""
from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fast_tools import MATRIX_SHAPES, bench_result, emit, graph_us_per_call
from runtime.fp8 import quantize_weight
from runtime.kernels.gemv import gemv

COPIES = 8


def products(rows: int, ws: list[torch.Tensor], x: torch.Tensor) -> dict[str, list]:
    """Per kind: one call per weight copy."""
    if rows == 1:
        w8s = [quantize_weight(w) for w in ws]
        return {"bf16_gemv": [functools.partial(gemv, x, w) for w in ws],
                "fp8_gemv": [functools.partial(gemv, x, w.weight, scale=w.scale) for w in w8s]}
    return {"bf16_cublas": [functools.partial(F.linear, x, w) for w in ws]}


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,64,128")
    p.add_argument("--calls", type=int, default=32, help="calls per captured graph")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    device = torch.device("cuda")
    result = bench_result("l2_resident", argv, device, products=[],
                          l2_bytes=torch.cuda.get_device_properties(device).L2_cache_size)
    for name in ("o", "qkv"):
        n, k = MATRIX_SHAPES[name]
        ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            for kind, calls in products(rows, ws, x).items():
                w0 = ws[0].float()
                if kind.startswith("fp8"):  # against the product of the dequantized weights
                    q = quantize_weight(ws[0])
                    w0 = q.weight.float() * q.scale[:, None]
                want = x.float() @ w0.t()
                got = calls[0]()
                got = got[0] if isinstance(got, tuple) else got
                err = (got.float() - want).abs().max().item()
                assert got.shape == (rows, n) and err < 0.02 * want.abs().max().item(), (name, rows, kind, err)
                elem = 1 if kind.startswith("fp8") else 2
                cold = graph_us_per_call([calls[i % COPIES] for i in range(args.calls)])
                warm = graph_us_per_call([calls[0]] * args.calls)
                row = {"matrix": name, "n": n, "k": k, "rows": rows, "kind": kind, "max_abs_err_vs_fp32": err,
                       "cold_us": round(cold, 2), "warm_us": round(warm, 2),
                       "cold_gbps": round(n * k * elem / cold / 1e3, 1),
                       "saved_us_if_in_l2": round(cold - warm, 2)}
                print(row, file=sys.stderr, flush=True)
                result["products"].append(row)
        del ws
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
