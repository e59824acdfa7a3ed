"""A weight-streaming Triton product for 64-128-row decode steps against cuBLAS (H200 probe; not adopted).

    python bench/rows_gemm.py --out bench/results/rows-gemm-h200.json

At 64-128 rows cuBLAS reads the layer matrices at 2.1-3.5 TB/s (bench/results/decode-ab-h200/tunableop/). The
kernel below: one program owns BN output columns for all rows (BM >= M), streams its [BN, K] weight slice
through `stages` BK-deep tiles (cp.async + wgmma, as Triton pipelines it on sm_90), float32 accumulation.
For each layer matrix of the full shape (and the audio head) and each row count, every (BN, BK, warps,
stages) candidate is first checked against a float32 product on fresh random data (relative error under
1e-2, all finite), then timed per call in a CUDA graph of 16 calls
over 4 weight copies (L2 holds none of them). `F.linear` (cuBLAS) is timed the same way in the same run as
the baseline, with the copy rate; `gbps` counts the weight bytes once.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench.fast_tools import copy_bandwidth_gbps, emit, fastest, graph_us_per_call, log
from runtime.kernels.launch import pdl_args, pdl_enter

MATRICES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
            "audio_head": (16384 + 8, 4096)}
CALLS = 16


@triton.jit
def _rows_gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    m_mask = rm < M
    n_mask = rn < N
    x_rows = x_ptr + rm[:, None] * K + rk[None, :]
    w_cols = w_ptr + rn[None, :].to(tl.int64) * K + rk[:, None]
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):  # K % BK == 0 (checked by the wrapper)
        x = tl.load(x_rows + k0, mask=m_mask[:, None], other=0.0)  # [BM, BK]
        w = tl.load(w_cols + k0, mask=n_mask[None, :], other=0.0)  # [BK, BN]: W^T tile
        acc = tl.dot(x, w, acc)
    out = y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def rows_gemm(x: torch.Tensor, w: torch.Tensor, tiles: tuple[int, int, int, int]) -> torch.Tensor:
    """x [M, K] @ w[N, K].T -> [M, N] in x's dtype; tiles = (BN, BK, warps, stages); M <= 128, K % BK == 0."""
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1] and x.dtype == w.dtype
    m, k = x.shape
    n = w.shape[0]
    bn, bk, warps, stages = tiles
    assert 0 < m <= 128 and k % bk == 0, (m, k, bk)
    x = x.contiguous()
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _rows_gemm_kernel[(triton.cdiv(n, bn),)](
        x, w, y, m, n, K=k, BM=max(16, triton.next_power_of_2(m)), BN=bn, BK=bk,
        num_warps=warps, num_stages=stages, **pdl_args(),
    )
    return y


def sweep_product(
    name: str, m: int, ws: list[torch.Tensor], candidates: list[tuple], run: Callable[..., torch.Tensor],
    extra: Callable[[dict, torch.Tensor, list[torch.Tensor], tuple], None] | None = None,
) -> dict:
    """One matrix (4 copies `ws`, [N, K] bf16) at `m` rows: cuBLAS (`F.linear`) and each candidate
    `run(x, w, tiles)` first checked against a float32 product (relative error under 1e-2, all finite; the
    largest difference from cuBLAS's output recorded), then timed per call in a CUDA graph of CALLS calls over
    the copies. `extra(entry, x, ws, tiles)` may add timings to a candidate that passed."""
    n, k = ws[0].shape
    nbytes = n * k * ws[0].element_size()
    x = torch.randn(m, k, device=ws[0].device, dtype=ws[0].dtype)
    ref = x.float() @ ws[0].float().t()
    cublas_out = F.linear(x, ws[0]).float()
    cublas_us = graph_us_per_call([functools.partial(F.linear, x, ws[i % 4]) for i in range(CALLS)])
    row = {"matrix": name, "n": n, "k": k, "m": m, "cublas_us": round(cublas_us, 2),
           "cublas_gbps": round(nbytes / cublas_us / 1e3, 1),
           "cublas_rel_err": float((cublas_out - ref).norm() / ref.norm()), "tiles": []}
    for tiles in candidates:
        entry: dict = {"tiles": list(tiles)}
        try:
            got = run(x, ws[0], tiles).float()
            entry["rel_err"] = float((got - ref).norm() / ref.norm())
            entry["finite"] = bool(torch.isfinite(got).all())
            entry["max_abs_vs_cublas"] = float((got - cublas_out).abs().max())
            if entry["rel_err"] < 1e-2 and entry["finite"]:
                us = graph_us_per_call([functools.partial(run, x, ws[i % 4], tiles) for i in range(CALLS)])
                entry.update(us=round(us, 2), gbps=round(nbytes / us / 1e3, 1), vs_cublas=round(cublas_us / us, 3))
                if extra is not None:
                    extra(entry, x, ws, tiles)
        except Exception as exc:  # noqa: BLE001 - reported in the JSON (e.g. too much shared memory)
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        row["tiles"].append(entry)
    row["best"] = fastest(row["tiles"])
    log(f"{name} m={m}: cuBLAS {row['cublas_us']} us ({row['cublas_gbps']} GB/s); best {row['best']}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16,32,64,128")
    ap.add_argument("--bn", default="32,64,128,256")
    ap.add_argument("--bk", default="64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="3,4,5")
    ap.add_argument("--matrices", default=",".join(MATRICES))
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    ints = lambda s: [int(v) for v in s.split(",")]
    cands = list(itertools.product(ints(args.bn), ints(args.bk), ints(args.warps), ints(args.stages)))
    result: dict = {"bench": "rows_gemm", "command": shlex.join(["python", "bench/rows_gemm.py", *sys.argv[1:]]),
                    "device_name": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "copy_gbps": round(copy_bandwidth_gbps(dev), 1), "rows": []}
    log(f"copy {result['copy_gbps']} GB/s; {len(cands)} candidates")
    for name in args.matrices.split(","):
        n, k = MATRICES[name]
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(4)]
        for m in ints(args.rows):
            result["rows"].append(sweep_product(name, m, ws, cands, rows_gemm))
            emit(result, Path(args.out) if args.out else None)
        del ws
    emit(result, Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
