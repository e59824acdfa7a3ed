"""Are PyTorch's bf16 matmuls finite and close to float32 on this GPU, for the engine's matrix shapes and
the row counts its steps use? (A check for kernels the BLAS library picks by device properties, e.g. the
SM count an MPS client is provisioned with.)

    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=75 python bench/gemm_finite_check.py --out gemm.json

For each (rows, matrix) pair: F.linear of normal(0, 1) activations and normal(0, 0.02) weights in bf16,
against the same product in float32; reports non-finite outputs, the max abs error relative to the
reference's max abs, and the first non-finite row. Both BLAS libraries are checked. Prints ONE JSON line.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fast_tools import emit

# (name, out features, in features) of the full preset's products (runtime/fused.py shapes)
MATRICES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288),
            ("audio_head", 16512, 4096))
ROWS = (1, 2, 4, 64, 128, 129, 257, 384, 385, 512, 513, 640, 1024, 1025, 2048)


def check(rows: int, out_features: int, in_features: int, gen: torch.Generator) -> dict:
    x = torch.randn(rows, in_features, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(out_features, in_features, generator=gen, device="cuda") * 0.02).bfloat16()
    y = F.linear(x, w).float()
    ref = x.float() @ w.float().T
    bad = ~torch.isfinite(y)
    first = bad.any(1).nonzero().flatten()
    err = (y - ref).abs().masked_fill(bad, 0).max().item() / ref.abs().max().item()
    return {"nonfinite": int(bad.sum()), "first_bad_row": int(first[0]) if first.numel() else None,
            "rel_err": round(err, 5)}


def kernel_names() -> dict:
    """The kernels each BLAS library launches for the qkv product at 64 and 513 rows."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    _, n, k = MATRICES[0]
    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        for m in (64, 513):
            x = torch.randn(m, k, device="cuda").bfloat16()
            w = torch.randn(n, k, device="cuda").bfloat16()
            F.linear(x, w)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                F.linear(x, w)
                torch.cuda.synchronize()
            out[f"{library}/{m}"] = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--kernels", action="store_true",
                   help="also name the GPU kernels each library runs for qkv at 64 and 513 rows (torch.profiler)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",") if r]
    props = torch.cuda.get_device_properties(0)
    summary = {
        "benchmark": "gemm_finite_check",
        "command": shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(argv),
        "device_name": props.name, "multi_processor_count": props.multi_processor_count,
        "mps_active_thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
        "results": [],
    }
    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        gen = torch.Generator(device="cuda").manual_seed(0)
        for name, n, k in MATRICES:
            for m in rows:
                summary["results"].append({"library": library, "matrix": name, "rows": m, **check(m, n, k, gen)})
    if args.kernels:
        summary["kernels"] = kernel_names()
    bad = [r for r in summary["results"] if r["nonfinite"] or r["rel_err"] > 0.02]
    summary["failures"] = bad
    emit(summary, None if args.out is None else Path(args.out))
    return summary


if __name__ == "__main__":
    main()
