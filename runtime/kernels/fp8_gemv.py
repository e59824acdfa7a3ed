"""Weight-only FP8 (e4m3) matrix-vector product for small batches (Triton).

out[M, N] = x[M, K] @ (w_fp8[N, K] * scale[N, None]).T with M <= 16: the weights are streamed once
from memory as 1 byte each, widened to bf16 in registers and multiplied on the tensor cores (x rows are
padded to 16 by masking); the per-output-channel scale is applied to the float32 accumulator.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels import gemv as gemv_mod
from runtime.kernels.launch import l2_prefetch_rows, pdl_args, pdl_enter

MAX_ROWS = 16


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_N": 32, "BLOCK_K": 256}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_N": 64, "BLOCK_K": 256}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_N": 16, "BLOCK_K": 512}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_N": 64, "BLOCK_K": 128}, num_warps=4, num_stages=6),
    ],
    key=["N", "K"],  # not USE_PDL: both modes use the same tiles
)
@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, USE_PDL: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    n = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m = tl.arange(0, 16)
    nmask = n < N
    mmask = m < M
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=mmask[:, None], other=0.0)  # [16, BK]
        w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=nmask[:, None], other=0.0)  # [BN, BK] fp8
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    s = tl.load(s_ptr + n, mask=nmask, other=0.0)
    out = acc * s[None, :]
    tl.store(out_ptr + m[:, None] * N + n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 (M <= 16), w [N, K] float8_e4m3fn, scale [N] float32 -> [M, N] in x's dtype."""
    m_rows, k_dim = x.shape
    n_dim = w.shape[0]
    assert m_rows <= MAX_ROWS and x.is_contiguous() and w.is_contiguous() and w.shape[1] == k_dim
    assert k_dim % 512 == 0, "K must be a multiple of the largest BLOCK_K"
    out = torch.empty(m_rows, n_dim, device=x.device, dtype=x.dtype)

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(n_dim, meta["BLOCK_N"]),)

    _fp8_gemv_kernel[grid](x, w, scale, out, m_rows, n_dim, k_dim, **pdl_args())
    return out


# Two to four rows: a CUDA-core GEMV over every row (the tensor-core kernel above pads them to 16 and read its
# weights at 1.3-2.7 TB/s there). Each weight tile [BLOCK_N, BLOCK_K] is read once and widened to float32,
# multiplied with each row's x tile and summed per thread over its 16-value vectors (fold 2 of gemv.py);
# the cross-thread sum runs once after the loop. The products grow with the rows, so it pays at 2 rows for
# every layer matrix and at 3-4 rows only for qkv and o (bench/results/fp8-rows-h200/gemv-rows.json, each
# product alone with cold L2, us against the tensor-core kernel): `ROWS_TILES` below.


@triton.jit
def _gemv_rows_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K: tl.constexpr, ROWS: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
                      L2_SLICE: tl.constexpr = 0):
    pid = tl.program_id(0)
    n = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    nmask = n < N
    tile = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + n[:, None] * K + tile[None, :]
    r_idx = tl.arange(0, ROWS)
    VEC: tl.constexpr = 16
    if L2_SLICE != 0:  # as the one-row GEMV (gemv.py OPTIONS["l2_slice"])
        l2_prefetch_rows(w_ptr, pid, N, K, BLOCK_N, L2_SLICE)
    pdl_enter(USE_PDL)
    acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K // VEC], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_ptrs + k0, mask=nmask[:, None], other=0.0).to(tl.float32)  # [BN, BK]
        for r in tl.static_range(ROWS):
            xr = tl.load(x_ptr + r * K + k0 + tile, mask=(tile < K) & (r < M), other=0.0).to(tl.float32)
            part = tl.sum(tl.reshape(w * xr[None, :], [BLOCK_N, BLOCK_K // VEC, VEC]), axis=2)
            acc = tl.where((r_idx == r)[:, None, None], acc + part[None, :, :], acc)
    out = tl.sum(acc, axis=2) * tl.load(s_ptr + n, mask=nmask, other=0.0)[None, :]  # [ROWS, BN]
    tl.store(out_ptr + r_idx[:, None] * N + n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(r_idx < M)[:, None] & nmask[None, :])


def gemv_rows(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, tiles: tuple[int, int, int]) -> torch.Tensor:
    """x [M, K] bf16 (M <= 8), w [N, K] e4m3, scale [N] -> [M, N] bf16; tiles = (BLOCK_N, BLOCK_K, warps)."""
    m, k = x.shape
    n = w.shape[0]
    bn, bk, warps = tiles
    rows = max(2, triton.next_power_of_2(m))
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _gemv_rows_kernel[(triton.cdiv(n, bn),)](x, w, scale, out, m, n, K=k, ROWS=rows, BLOCK_N=bn, BLOCK_K=bk,
                                            num_warps=warps, num_stages=1, **gemv_mod.l2_slice_launch(1),
                                            **pdl_args())
    return out


# (BLOCK_N, BLOCK_K, warps) per (row bucket, N, K): the sweep's best tiles where they beat the tensor-core
# kernel alone; us per product, this kernel against it (the one-row GEMV of gemv.py in brackets)
ROWS_TILES: dict[tuple[int, int, int], tuple[int, int, int]] = {
    (2, 6144, 4096): (8, 1024, 4),  # qkv: 9.8 against 15.5 (8.8)
    (2, 4096, 4096): (4, 1024, 4),  # o: 7.9 against 12.2 (6.7)
    (2, 24576, 4096): (32, 256, 4),  # gate_up: 28.8 against 37.8 (25.6)
    (2, 4096, 12288): (4, 1024, 4),  # down: 18.8 against 29.9 (14.7)
    (4, 6144, 4096): (16, 512, 4),  # qkv: 14.5 against 16.0
    (4, 4096, 4096): (8, 1024, 4),  # o: 10.0 against 12.2
}


def rows_tiles(m: int, n: int, k: int) -> tuple[int, int, int] | None:
    """The table's tiles for an m-row product with an [n, k] FP8 weight (2 rows; 3-4 rows in the 4-row
    bucket), or None where the tensor-core kernel runs."""
    if not 2 <= m <= 4:
        return None
    return ROWS_TILES.get((2 if m == 2 else 4, n, k))
