"""Split-K Triton products against cuBLAS for 64-128-row decode steps (H200 probe; not adopted).

    python bench/splitk_rows.py --out bench/results/splitk-rows-h200/splitk-rows.json

For each layer matrix of the full shape and each row count, every candidate (BN, BK, warps, stages, SPLIT,
TMA) is first checked against a float32 product on random data (relative error under 1e-2, all finite; the
largest difference from cuBLAS's bf16 output is reported), then timed per call in a CUDA graph of 16 calls
over 4 weight copies (L2 holds none of them): the whole product (with the partials' reduction kernel when
SPLIT > 1) and the split kernel alone (what is left if a consumer sums the partials itself). `F.linear`
(cuBLAS) is timed the same way in the same run as the baseline, with the copy rate; `gbps` counts the weight
bytes once.

The kernel: a program owns BN output columns of all M rows (BM >= M) over one K slice, N / BN x SPLIT programs,
each streaming a [BN, K / SPLIT] weight slice (pointer loads or TMA) into wgmma, float32 accumulation; with
SPLIT > 1 each stores its float32 partial [M, BN] and a second kernel sums them in split order (deterministic).
In the thirty-first session it also ran inside the decode step (commit 95628bb: `FastForward(rows_gemm=)`,
the partials of o and down summed by `add_rmsnorm`): 1% faster at 64 rows with PDL, slower at 128
(bench/results/splitk-rows-h200/README.md).
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
import triton
import triton.language as tl

from bench.fast_tools import copy_bandwidth_gbps, emit, graph_us_per_call, log
from bench.rows_gemm import CALLS, sweep_product
from runtime.kernels.launch import pdl_args, pdl_enter


@triton.jit
def _splitk_kernel(
    x_ptr, w_ptr, x_desc, w_desc, out_ptr, M, N, K: tl.constexpr, K_SPLIT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr, PARTIAL: tl.constexpr,
    USE_PDL: tl.constexpr, EARLY: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n0 = pid_n * BN
    rn = n0 + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    k_lo = pid_s * K_SPLIT
    m_mask = rm < M
    x_ptrs = x_ptr + rm[:, None] * K + (k_lo + rk)[None, :]  # [BM, BK]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * K + (k_lo + rk)[:, None]  # [BK, BN]: a W^T tile
    acc = tl.zeros([BM, BN], tl.float32)
    START: tl.constexpr = BK if EARLY else 0
    if EARLY:  # the first weight tile (never written by a kernel) loaded before waiting on the previous kernel
        if TMA:
            w_first = w_desc.load([n0, k_lo])
        else:
            w_first = tl.load(w_ptrs)
    pdl_enter(USE_PDL)
    if EARLY:
        if TMA:
            acc = tl.dot(x_desc.load([0, k_lo]), w_first.T, acc)
        else:
            acc = tl.dot(tl.load(x_ptrs, mask=m_mask[:, None], other=0.0), w_first, acc)
    for k0 in range(START, K_SPLIT, BK):
        if TMA:
            x = x_desc.load([0, k_lo + k0])  # [BM, BK]
            w = w_desc.load([n0, k_lo + k0])  # [BN, BK]
            acc = tl.dot(x, w.T, acc)
        else:
            x = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs + k0)
            acc = tl.dot(x, w, acc)
    if PARTIAL:
        out = out_ptr + (pid_s * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
        tl.store(out, acc, mask=m_mask[:, None])
    else:
        out = out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


@triton.jit
def _reduce_kernel(part_ptr, out_ptr, M, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.load(part_ptr + row * N + cols)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + (s * M + row) * N + cols)
    tl.store(out_ptr + row * N + cols, acc.to(out_ptr.dtype.element_ty))


def splitk_partials(
    x: torch.Tensor, w: torch.Tensor, tiles: tuple[int, int, int, int, int, bool], early: bool = False,
) -> torch.Tensor:
    """x [M, K] @ w[N, K].T: with SPLIT 1 -> [M, N] in x's dtype, else the float32 partials [SPLIT, M, N].
    tiles = (BN, BK, warps, stages, SPLIT, TMA); M <= 128, N % BN == 0, K % (SPLIT * BK) == 0."""
    bn, bk, warps, stages, split, tma = tiles
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1] and x.dtype == w.dtype
    assert x.is_contiguous() and w.is_contiguous()
    m, k = x.shape
    n = w.shape[0]
    assert 0 < m <= 128 and n % bn == 0 and k % (split * bk) == 0, (m, n, k, tiles)
    bm = max(16, triton.next_power_of_2(m))
    if split == 1:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    else:
        out = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    x_desc, w_desc = x, w
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
        w_desc = TensorDescriptor.from_tensor(w, [bn, bk])
    _splitk_kernel[(n // bn, split)](
        x, w, x_desc, w_desc, out, m, n, K=k, K_SPLIT=k // split, BM=bm, BN=bn, BK=bk, TMA=tma, PARTIAL=split > 1,
        EARLY=early, num_warps=warps, num_stages=stages, **pdl_args(),
    )
    return out


def reduce_partials(partials: torch.Tensor, dtype: torch.dtype, block: int = 1024) -> torch.Tensor:
    """[SPLIT, M, N] float32 -> [M, N] `dtype`: the partials summed in split order, then rounded."""
    split, m, n = partials.shape
    block = min(block, n)
    assert n % block == 0
    out = torch.empty(m, n, device=partials.device, dtype=dtype)
    _reduce_kernel[(m, n // block)](partials, out, m, n, SPLIT=split, BLOCK=block, num_warps=4, **pdl_args())
    return out


def splitk_linear(
    x: torch.Tensor, w: torch.Tensor, tiles: tuple[int, int, int, int, int, bool], early: bool = False,
) -> torch.Tensor:
    """x [M, K] @ w[N, K].T -> [M, N] in x's dtype (see `splitk_partials`). `early`: the first weight tile is
    loaded before the kernel waits on its predecessor (programmatic dependent launch)."""
    out = splitk_partials(x, w, tiles, early)
    return out if tiles[4] == 1 else reduce_partials(out, x.dtype)


MATRICES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
SPLITS = {"qkv": "1,2,4", "o": "1,2,4", "gate_up": "1", "down": "2,3,4,6"}


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


def _split_kernel_alone(entry: dict, x: torch.Tensor, ws: list[torch.Tensor], tiles: tuple) -> None:
    """The split kernel's time without the partials' reduction (what a consumer that sums them pays)."""
    if tiles[4] > 1:
        us = graph_us_per_call([functools.partial(splitk_partials, x, ws[i % 4], tiles) for i in range(CALLS)])
        entry["split_kernel_us"] = round(us, 2)


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
        for m in ints(args.rows):
            cands = candidates(n, k, m, ints(splits[name]), ints(args.bn), ints(args.bk), ints(args.loads))
            result["rows"].append(sweep_product(name, m, ws, cands, splitk_linear, _split_kernel_alone))
            emit(result, out)
        del ws
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(result, out)


if __name__ == "__main__":
    main()
