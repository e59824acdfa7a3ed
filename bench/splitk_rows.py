"""Split-K Triton products (runtime/kernels/splitk.py) against cuBLAS for 64-128-row decode steps (H200 probe).

    python bench/splitk_rows.py --out bench/results/splitk-rows-h200/splitk-rows.json

For each layer matrix of the full shape and each row count, every candidate (BN, BK, warps, stages, SPLIT,
TMA) is first checked against a float32 product on random data (relative error under 1e-2, all finite; the
largest difference from cuBLAS's bf16 output is reported), then timed per call in a CUDA graph of 16 calls
over 4 weight copies (L2 holds none of them): the whole product (with the partials' reduction kernel when
SPLIT > 1) and the split kernel alone (what is left if a consumer sums the partials itself). `F.linear`
(cuBLAS) is timed the same way in the same run as the baseline, with the copy rate; `gbps` counts the weight
bytes once.
"""
from __future__ import annotations

import argparse
import functools
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from bench.fast_tools import copy_bandwidth_gbps, emit, fastest, graph_us_per_call, log
from runtime.kernels.splitk import splitk_linear, splitk_partials

MATRICES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
SPLITS = {"qkv": "1,2,4", "o": "1,2,4", "gate_up": "1", "down": "2,3,4,6"}
CALLS = 16


def candidates(n: int, k: int, m: int, splits: list[int], bns: list[int], bks: list[int], loads: list[int]) -> list:
    """(BN, BK, warps, stages, SPLIT, TMA) that divide the shape: 8 warps for 128 x 128 tiles, else 4; 4 stages
    of 64-deep tiles or 3 of 128-deep ones (what fits the shared memory)."""
    out = []
    for bn in bns:
        for bk in bks:
            for split in splits:
                if n % bn or k % (split * bk):
                    continue
                warps = 8 if bn == 128 and m > 64 else 4
                for tma in loads:
                    out.append((bn, bk, warps, 4 if bk == 64 else 3, split, bool(tma)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="64,128")
    ap.add_argument("--bn", default="64,128")
    ap.add_argument("--bk", default="64,128")
    ap.add_argument("--loads", default="0,1", help="0: pointer loads, 1: TMA descriptors")
    ap.add_argument("--matrices", default="o,down,qkv,gate_up")
    ap.add_argument("--splits", default="", help="matrix=1,2,4;... in place of SPLITS")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new matrices after this")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    ints = lambda s: [int(v) for v in s.split(",") if v]
    splits = dict(SPLITS)
    for item in filter(None, args.splits.split(";")):
        name, _, vals = item.partition("=")
        splits[name] = vals
    result: dict = {"bench": "splitk_rows", "command": shlex.join(["python", "bench/splitk_rows.py", *sys.argv[1:]]),
                    "device_name": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "copy_gbps": round(copy_bandwidth_gbps(dev), 1), "rows": []}
    log(f"copy {result['copy_gbps']} GB/s")
    out = Path(args.out) if args.out else None
    for name in args.matrices.split(","):
        if time.perf_counter() - t0 > args.budget_s:
            result.setdefault("skipped", []).append(name)
            continue
        n, k = MATRICES[name]
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(4)]
        nbytes = n * k * 2
        for m in ints(args.rows):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ ws[0].float().t()
            cublas_out = F.linear(x, ws[0]).float()
            cublas_us = graph_us_per_call([functools.partial(F.linear, x, ws[i % 4]) for i in range(CALLS)])
            row = {"matrix": name, "n": n, "k": k, "m": m, "cublas_us": round(cublas_us, 2),
                   "cublas_gbps": round(nbytes / cublas_us / 1e3, 1),
                   "cublas_rel_err": float((cublas_out - ref).norm() / ref.norm()), "tiles": []}
            for tiles in candidates(n, k, m, ints(splits[name]), ints(args.bn), ints(args.bk), ints(args.loads)):
                entry: dict = {"tiles": list(tiles)}
                try:
                    got = splitk_linear(x, ws[0], tiles).float()
                    entry["rel_err"] = float((got - ref).norm() / ref.norm())
                    entry["finite"] = bool(torch.isfinite(got).all())
                    entry["max_abs_vs_cublas"] = float((got - cublas_out).abs().max())
                    if entry["rel_err"] < 1e-2 and entry["finite"]:
                        us = graph_us_per_call([functools.partial(splitk_linear, x, ws[i % 4], tiles)
                                                for i in range(CALLS)])
                        entry.update(us=round(us, 2), gbps=round(nbytes / us / 1e3, 1),
                                     vs_cublas=round(cublas_us / us, 3))
                        if tiles[4] > 1:
                            main_us = graph_us_per_call([functools.partial(splitk_partials, x, ws[i % 4], tiles)
                                                         for i in range(CALLS)])
                            entry["split_kernel_us"] = round(main_us, 2)
                except Exception as exc:  # noqa: BLE001 - reported in the JSON (e.g. too much shared memory)
                    entry["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                row["tiles"].append(entry)
            row["best"] = fastest(row["tiles"])
            log(f"{name} m={m}: cuBLAS {row['cublas_us']} us ({row['cublas_gbps']} GB/s); best {row['best']}")
            result["rows"].append(row)
            emit(result, out)
        del ws
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(result, out)


if __name__ == "__main__":
    main()
