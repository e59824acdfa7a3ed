"""Per-row FP8 (e4m3) quantization of activations for `torch._scaled_mm` (runtime/fp8.py), in one launch.

The eager form (x.float(), a pad to a multiple of 16 rows, abs, amax, clamp, a product for the scale, a
division and a cast for the codes) ran as six to seven kernels before every FP8 product of more than 16 rows,
15-57 us more per product on the H200 (bench/results/fp8-rows-h200/), as much as the product itself at
24-128 rows. This kernel gives the same bits:
- scale = max(max|row|, 1e-12) x float32(1 / 448), a product, as PyTorch's CUDA division by a scalar
  computes it (by the reciprocal);
- codes = row / scale, an IEEE-rounded division, as PyTorch's between tensors, then the hardware's
  round-to-nearest-even cast to e4m3 (saturating; no quotient exceeds 448 by more than a rounding).
Rows past the input's (the padding) get zero codes and the scale of a zero row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.launch import pdl_args, pdl_enter

INV_FP8_MAX = tl.constexpr(1.0 / 448.0)  # float32(1 / 448) in the kernel, as in runtime/fp8.py
TINY = tl.constexpr(1e-12)  # runtime/fp8.py: the scale's floor


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, M, K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0)
    pdl_enter(USE_PDL)
    base = row.to(tl.int64) * K
    # rows past M (the padding) branch off whole: a row mask on the loads made the kernel 2-3x slower on the
    # H200 (15.4 against 5.4 us for 24 rows padded to 32, K = 12288)
    if row < M:
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in tl.static_range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + base + cols, mask=cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0), TINY) * INV_FP8_MAX
        for k0 in tl.static_range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            mask = cols < K
            x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(q_ptr + base + cols, tl.math.div_rn(x, scale).to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)
    else:
        for k0 in tl.static_range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            tl.store(q_ptr + base + cols, tl.zeros([BLOCK], tl.float32).to(q_ptr.dtype.element_ty), mask=cols < K)
        tl.store(s_ptr + row, tl.full((), TINY, tl.float32) * INV_FP8_MAX)  # a float32 product, as above


def quantize_rows(x: torch.Tensor, rows: int, codes_dtype: torch.dtype = torch.float8_e4m3fn
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (codes [rows, K] float8_e4m3fn, scales [rows, 1] float32), rows >= M;
    rows past M are zero rows (the padding `torch._scaled_mm` needs). `codes_dtype` float32 stores the
    quotients before their rounding to e4m3 (for tests under Triton's interpreter, whose e4m3 rounding is not
    the GPU's: it rounds ties away from zero and loses a carry into the next power of two)."""
    m, k = x.shape
    assert rows >= m and x.is_contiguous()
    q = torch.empty(rows, k, device=x.device, dtype=codes_dtype)
    s = torch.empty(rows, 1, device=x.device, dtype=torch.float32)
    block = min(2048, triton.next_power_of_2(k))
    _quantize_rows_kernel[(rows,)](x, q, s, m, K=k, BLOCK=block, num_warps=4, **pdl_args())
    return q, s
