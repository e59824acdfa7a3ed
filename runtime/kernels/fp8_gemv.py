"""Weight-only FP8 (e4m3) matrix-vector product for small batches (Triton).

out[M, N] = x[M, K] @ (w_fp8[N, K] * scale[N, None]).T with M <= 16: the weights are streamed once
from memory as 1 byte each, widened to bf16 in registers and multiplied on the tensor cores (x rows are
padded to 16 by masking); the per-output-channel scale is applied to the float32 accumulator.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.launch import pdl_args, pdl_enter

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
