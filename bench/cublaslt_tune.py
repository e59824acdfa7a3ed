"""Every algorithm cuBLASLt's heuristic lists for the decode step's products, timed against `F.linear` (H200).

    python bench/cublaslt_tune.py --out bench/results/cublaslt-tune-h200/cublaslt-tune-h200.json

PyTorch runs the heuristic's first algorithm; `bench/cublaslt.py` can run any listed one. For each
layer matrix of the full shape and each row count, every listed algorithm is first checked against a float32
product on random data (relative error under 1e-2, all finite), then timed per call in a CUDA graph of 16
calls over 4 weight copies (L2 holds none of them), as `bench/rows_gemm.py` times its kernels. `F.linear` is
timed the same way in the same run as the baseline (`vs_torch` > 1: faster than it), with the copy rate;
`gbps` counts the weight bytes once.
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

from bench.cublaslt import LtMatmul
from bench.fast_tools import copy_bandwidth_gbps, emit, fastest, graph_us_per_call, log

MATRICES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
            "audio_head": (16384 + 8, 4096), "text_head": (151680, 4096)}
CALLS = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="8,16,32,64,96,128")
    ap.add_argument("--matrices", default="qkv,o,gate_up,down,audio_head")
    ap.add_argument("--max-algos", type=int, default=32)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    out = Path(args.out) if args.out else None
    result: dict = {"bench": "cublaslt_tune", "command": shlex.join(["python", "bench/cublaslt_tune.py", *sys.argv[1:]]),
                    "device_name": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "copy_gbps": round(copy_bandwidth_gbps(dev), 1), "rows": []}
    log(f"copy {result['copy_gbps']} GB/s")
    capture = torch.cuda.Stream(dev)
    for name in args.matrices.split(","):
        n, k = MATRICES[name]
        copies = 2 if n > 100000 else 4
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        nbytes = n * k * 2
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ ws[0].float().t()
            torch_us = graph_us_per_call([functools.partial(F.linear, x, ws[i % copies]) for i in range(CALLS)],
                                         capture)
            plan = LtMatmul(m, n, k, torch.bfloat16, max_algos=args.max_algos)
            LtMatmul.reserve(capture)
            row: dict = {"matrix": name, "n": n, "k": k, "m": m, "torch_us": round(torch_us, 2),
                         "torch_gbps": round(nbytes / torch_us / 1e3, 1), "listed": len(plan.algorithms), "algos": []}
            for algo in plan.algorithms:
                entry = algo.describe()
                try:
                    got = plan(x, ws[0], algo).float()
                    entry["rel_err"] = float((got - ref).norm() / ref.norm())
                    entry["finite"] = bool(torch.isfinite(got).all())
                    if entry["rel_err"] < 1e-2 and entry["finite"]:
                        us = graph_us_per_call([functools.partial(plan, x, ws[i % copies], algo) for i in range(CALLS)],
                                               capture)
                        entry.update(us=round(us, 2), gbps=round(nbytes / us / 1e3, 1), vs_torch=round(torch_us / us, 3))
                except Exception as exc:  # noqa: BLE001 - reported in the JSON
                    entry["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                row["algos"].append(entry)
            row["best"] = fastest(row["algos"])
            best = row["best"] or {}
            log(f"{name} m={m}: torch {row['torch_us']} us ({row['torch_gbps']} GB/s); {sum('us' in e for e in row['algos'])} of "
                f"{row['listed']} algos timed; best {best.get('us')} us (x{best.get('vs_torch')}, index "
                f"{best.get('index')}, tile {best.get('tile')}, splitk {best.get('splitk')})")
            result["rows"].append(row)
            emit(result, out)
        del ws
    emit(result, out)


if __name__ == "__main__":
    main()
