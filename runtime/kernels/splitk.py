"""Split-K products for decode steps of 64-128 rows (Triton): x [M, K] @ w[N, K].T.

At 64-128 rows cuBLAS reads the small layer matrices at half the copy rate (the o projection at 128 rows:
32 output tiles of 128 columns for 132 SMs; bench/results/rows-gemm-h200/). Here a program owns BN output
columns of all M rows (BM >= M) over one K slice: N / BN x SPLIT programs, each streaming a [BN, K / SPLIT]
weight slice (pointer loads or TMA) into wgmma, float32 accumulation. With SPLIT > 1 each program stores its
float32 partial [M, BN] into `partials` [SPLIT, M, N] and `reduce_partials` (or a consumer that reads them,
summing in split order) rounds the sum to the activation dtype: deterministic, unlike atomics.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.launch import pdl_args, pdl_enter

# (rows, N, K) -> (BN, BK, warps, stages, SPLIT, TMA): the fastest of bench/splitk_rows.py's candidates on the
# H200 (bench/results/splitk-rows-h200/) for the full shape's layer matrices; others stay on cuBLAS.
ROWS_TILES = {
    (64, 6144, 4096): (64, 128, 4, 3, 2, True),
    (64, 4096, 4096): (64, 128, 4, 3, 4, True),
    (64, 24576, 4096): (128, 64, 4, 4, 1, True),
    (64, 4096, 12288): (64, 128, 4, 3, 4, True),
    (128, 4096, 4096): (64, 64, 4, 4, 4, True),
    (128, 4096, 12288): (64, 64, 4, 4, 4, True),
}
# the full shape's layer matrices by (N, K); OPTIONS["products"]: those of them that use ROWS_TILES (a
# benchmark switches it while it captures; the others stay on cuBLAS)
PRODUCTS = {(6144, 4096): "qkv", (4096, 4096): "o", (24576, 4096): "gate_up", (4096, 12288): "down"}
OPTIONS: dict[str, tuple[str, ...]] = {"products": ("qkv", "o", "gate_up", "down")}


def rows_tiles(rows: int, n: int, k: int) -> tuple[int, int, int, int, int, bool] | None:
    """The split-K tiles for this product, or None (cuBLAS): ROWS_TILES, for the products OPTIONS names."""
    if PRODUCTS.get((n, k)) not in OPTIONS["products"]:
        return None
    return ROWS_TILES.get((rows, n, k))


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
    partials: bool = False,
) -> torch.Tensor:
    """x [M, K] @ w[N, K].T -> [M, N] in x's dtype (see `splitk_partials`). `early`: the first weight tile is
    loaded before the kernel waits on its predecessor (programmatic dependent launch). `partials`: a split
    product returns its float32 partials [SPLIT, M, N] unreduced (for a consumer that sums them itself)."""
    out = splitk_partials(x, w, tiles, early)
    return out if tiles[4] == 1 or partials else reduce_partials(out, x.dtype)
