"""Weight-only FP8 (e4m3) matrix product for 17-64 rows (Triton): decode steps of that many streams, where
`torch._scaled_mm` (runtime/fp8.py) is slowest against its bytes.

out[M, N] = x[M, K] @ (w_fp8[N, K] * scale[N, None]).T, x in bf16. Each weight tile is read once as 1 byte
per value, widened to bf16 in registers (exact: every e4m3 value is a bf16 value) and multiplied on the tensor
cores as the left operand (the product is computed transposed, W x^T, so the widened tile never goes back to
shared memory and the rows are the narrow side of the instruction); float32 accumulation, the per-channel
scale on the accumulator. Unlike `torch._scaled_mm`, the activations stay in bf16: the only rounding FP8 adds
is the weights' own, as in the one-row GEMV (runtime/kernels/gemv.py) and the 2-16-row kernel (fp8_gemv.py).

A program owns BN output channels of BM rows over one K slice; grid (row tiles, channel tiles, SPLIT), row
tiles fastest, so the programs that share a weight tile run together. With SPLIT > 1 each program stores a
float32 partial and a second kernel sums the partials in split order (deterministic), scales and rounds.
Which products take it, and with which tiles, is the table `TILES` (H200 sweep, bench/fp8_rows.py); the
others stay on `torch._scaled_mm`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.launch import pdl_args, pdl_enter


@triton.jit
def _fp8_gemm_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, M, N, K: tl.constexpr, K_SPLIT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PARTIAL: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    k_lo = pid_s * K_SPLIT
    m_mask = rm < M
    n_mask = rn < N
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * K + (k_lo + rk)[None, :]  # [BN, BK], fp8
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * K + (k_lo + rk)[None, :]  # [BM, BK]
    pdl_enter(USE_PDL)
    acc = tl.zeros([BN, BM], tl.float32)
    for k0 in range(0, K_SPLIT, BK):
        w = tl.load(w_ptrs + k0, mask=n_mask[:, None], other=0.0)
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)
        acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
    if PARTIAL:  # [SPLIT, M, N] float32, unscaled
        out = out_ptr + (pid_s * M + rm[None, :]).to(tl.int64) * N + rn[:, None]
        tl.store(out, acc, mask=m_mask[None, :] & n_mask[:, None])
    else:
        acc = acc * tl.load(s_ptr + rn, mask=n_mask, other=0.0)[:, None]
        out = out_ptr + rm[None, :].to(tl.int64) * N + rn[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[None, :] & n_mask[:, None])


@triton.jit
def _reduce_kernel(part_ptr, s_ptr, out_ptr, M, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                   USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.load(part_ptr + row * N + cols, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + (s * M + row) * N + cols, mask=mask, other=0.0)
    acc = acc * tl.load(s_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * N + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
             tiles: tuple[int, int, int, int, int, int]) -> torch.Tensor:
    """x [M, K] bf16 or fp16, w [N, K] float8_e4m3fn, scale [N] float32 -> [M, N] in x's dtype;
    tiles = (BM, BN, BK, warps, stages, SPLIT)."""
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1], (x.shape, w.shape)
    assert x.is_contiguous() and w.is_contiguous() and scale.shape == (w.shape[0],)
    m, k = x.shape
    n = w.shape[0]
    bm, bn, bk, warps, stages, split = tiles
    assert k % (split * bk) == 0, f"K ({k}) must be a multiple of SPLIT x BK ({split} x {bk})"
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    target = out if split == 1 else torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    _fp8_gemm_kernel[grid](x, w, scale, target, m, n, K=k, K_SPLIT=k // split, BM=bm, BN=bn, BK=bk,
                           PARTIAL=split > 1, num_warps=warps, num_stages=stages, **pdl_args())
    if split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _reduce_kernel[(m, triton.cdiv(n, block))](target, scale, out, m, n, SPLIT=split, BLOCK=block,
                                                    num_warps=4, **pdl_args())
    return out


# (BM, BN, BK, warps, stages, SPLIT) per (row bucket, N, K) of the full model's matrices: the sweep's best
# tiles (bench/results/fp8-rows-h200/fp8-rows-sweep.json: 24 and 64 rows, each product alone, cold L2), for
# the matrices where the kernel beat `torch._scaled_mm` with its one-kernel activation quantization both alone
# (fp8-rows-17-64.json) and in the captured step (qkv and gate/up lost there at 24 and 32 rows:
# decode-ab-weight-only-all-matrices.json against decode-ab-weight-only-od.json); us per product alone, this
# kernel against `_scaled_mm`:
TILES: dict[tuple[int, int, int], tuple[int, int, int, int, int, int]] = {
    (32, 4096, 4096): (32, 64, 128, 4, 4, 4),  # o: 12.5 against 16.7
    (32, 4096, 12288): (32, 64, 128, 4, 4, 4),  # down: 26.6 against 39.0
    (64, 4096, 4096): (64, 64, 128, 4, 4, 4),  # o: 14.2 against 16.8
    (64, 4096, 12288): (64, 64, 128, 4, 4, 4),  # down: 30.0 against 38.8
}
ROW_BUCKETS = (32, 64)


def weight_only_tiles(m: int, n: int, k: int) -> tuple[int, int, int, int, int, int] | None:
    """The table's tiles for an m-row product with an [n, k] weight (rows 17-32 in the 32-row bucket, 33-64 in
    the 64-row one), or None where `torch._scaled_mm` is the faster path."""
    bucket = next((b for b in ROW_BUCKETS if m <= b), None)
    return None if bucket is None else TILES.get((bucket, n, k))
