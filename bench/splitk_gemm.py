"""Does splitting K help cuBLAS on the decode step's matrix products at 8-128 rows? (H200 probe)

    python bench/splitk_gemm.py --out bench/results/splitk-gemm-h200.json

At 64-128 rows cuBLAS reads the layer matrices at 2.1-3.5 TB/s (bench/results/decode-ab-h200/tunableop/):
an [M, 4096] x [4096, 4096] product with 128 x 128 output tiles has only 32 tiles for 132 SMs. Splitting K
into s slices gives s times as many tiles: `torch.bmm` over the slices (strided views, no copy), each
slice's partial product in float32 (`out_dtype`) or bf16, then one sum over the slices. For each matrix
of a layer, each row count and each split, the result is first compared with the plain product (float32
reference), then timed per call in a CUDA graph of 16 calls over 4 weight copies (L2 holds none of them),
sum included. The plain `F.linear` is timed in the same run as the baseline, with the copy rate.
"""
from __future__ import annotations

import argparse
import functools
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from bench.fast_tools import copy_bandwidth_gbps, emit, graph_us_per_call, log

MATRICES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
CALLS = 16


def split_linear(x: torch.Tensor, w: torch.Tensor, splits: int, partial: torch.dtype) -> torch.Tensor:
    """x [M, K] @ w[N, K].T as `splits` K-slices in one batched product, then summed (in float32)."""
    m, k = x.shape
    n = w.shape[0]
    kc = k // splits
    xs = x.view(m, splits, kc).transpose(0, 1)  # [s, M, kc], row stride K
    ws = w.view(n, splits, kc).permute(1, 2, 0)  # [s, kc, N], column-major slices of w
    if partial == torch.float32:
        parts = torch.bmm(xs, ws, out_dtype=torch.float32)
        return parts.sum(0).to(x.dtype)
    return torch.bmm(xs, ws).sum(0, dtype=torch.float32).to(x.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="8,32,64,128")
    ap.add_argument("--splits", default="2,3,4,6,8")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    result: dict = {"bench": "splitk_gemm", "command": shlex.join(["python", "bench/splitk_gemm.py", *sys.argv[1:]]),
                    "device_name": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "copy_gbps": round(copy_bandwidth_gbps(dev), 1), "rows": []}
    log(f"copy {result['copy_gbps']} GB/s")
    for name, (n, k) in MATRICES.items():
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(4)]
        nbytes = n * k * 2
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ ws[0].float().t()
            plain_us = graph_us_per_call([functools.partial(F.linear, x, ws[i % 4]) for i in range(CALLS)])
            row = {"matrix": name, "n": n, "k": k, "m": m, "plain_us": round(plain_us, 2),
                   "plain_gbps": round(nbytes / plain_us / 1e3, 1),
                   "plain_rel_err": float((F.linear(x, ws[0]).float() - ref).norm() / ref.norm()), "splits": []}
            for s in map(int, args.splits.split(",")):
                if k % (s * 64):
                    continue
                for partial in (torch.float32, torch.bfloat16):
                    entry: dict = {"splits": s, "partial": str(partial).removeprefix("torch.")}
                    try:
                        got = split_linear(x, ws[0], s, partial).float()
                        entry["rel_err"] = float((got - ref).norm() / ref.norm())
                        us = graph_us_per_call([functools.partial(split_linear, x, ws[i % 4], s, partial)
                                                for i in range(CALLS)])
                        entry.update(us=round(us, 2), gbps=round(nbytes / us / 1e3, 1),
                                     vs_plain=round(plain_us / us, 3))
                    except Exception as exc:  # noqa: BLE001 - reported in the JSON
                        entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    row["splits"].append(entry)
            timed = [e for e in row["splits"] if "us" in e and e["rel_err"] < 1e-2]
            row["best"] = min(timed, key=lambda e: e["us"]) if timed else None
            log(f"{name} m={m}: plain {row['plain_us']} us ({row['plain_gbps']} GB/s); best {row['best']}")
            result["rows"].append(row)
        del ws
    emit(result, Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
