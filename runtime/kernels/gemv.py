"""One-row matrix-vector product with the layer's small ops fused in front (Triton), for 1-stream decode.

out[N] = prologue(x) @ W.T, W [N, K] bf16 or FP8 (then times a per-row scale). Prologues:
- NONE: x as is.
- RMSNORM: rmsnorm(x) * norm_w, or rmsnorm(x + res) * norm_w with the sum also written (program 0), so
  the residual add and the RMSNorm cost no launch of their own.
- SILU_MUL: x = [gate, up] of length 2K; silu(gate) * up.
Rounding matches the eager ops (runtime/kernels/elementwise.py). Each program streams BLOCK_N weight
rows with wide loads and reduces along K once at the end (no tensor cores: one row of x).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

NONE, RMSNORM, SILU_MUL = 0, 1, 2


@triton.autotune(
    configs=[
        triton.Config({"BLOCK_N": 8, "BLOCK_K": 512}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_N": 16, "BLOCK_K": 256}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_N": 4, "BLOCK_K": 1024}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_N": 16, "BLOCK_K": 512}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_N": 32, "BLOCK_K": 256}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_N": 8, "BLOCK_K": 2048}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_N": 16, "BLOCK_K": 1024}, num_warps=8, num_stages=2),
    ],
    key=["N", "K", "PROLOGUE", "HAS_RES", "HAS_SCALE"],
)
@triton.jit
def _gemv_kernel(
    x_ptr, res_ptr, nw_ptr, res_out_ptr, w_ptr, s_ptr, out_ptr, N, K, eps,
    PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    n = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    nmask = n < N
    act_ty = x_ptr.dtype.element_ty
    rstd = 0.0
    if PROLOGUE == 1:
        ss = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + k)
            if HAS_RES:
                xv = (xv.to(tl.float32) + tl.load(res_ptr + k).to(tl.float32)).to(act_ty)
                if pid == 0:
                    tl.store(res_out_ptr + k, xv)
            xf = xv.to(tl.float32)
            ss += xf * xf
        rstd = tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        if PROLOGUE == 0:
            xv = tl.load(x_ptr + k).to(tl.float32)
        elif PROLOGUE == 1:
            xs = tl.load(x_ptr + k)
            if HAS_RES:
                xs = (xs.to(tl.float32) + tl.load(res_ptr + k).to(tl.float32)).to(act_ty)
            y = (xs.to(tl.float32) * rstd).to(act_ty).to(tl.float32)
            xv = (tl.load(nw_ptr + k).to(tl.float32) * y).to(act_ty).to(tl.float32)
        else:
            g = tl.load(x_ptr + k).to(tl.float32)
            u = tl.load(x_ptr + K + k).to(tl.float32)
            a = (g / (1.0 + tl.exp(-g))).to(act_ty).to(tl.float32)
            xv = (a * u).to(act_ty).to(tl.float32)
        w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=nmask[:, None], other=0.0)
        acc += w.to(tl.float32) * xv[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_SCALE:
        out = out * tl.load(s_ptr + n, mask=nmask, other=0.0)
    tl.store(out_ptr + n, out.to(out_ptr.dtype.element_ty), mask=nmask)


def gemv(
    x: torch.Tensor, weight: torch.Tensor, *, scale: torch.Tensor | None = None, prologue: int = NONE,
    residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [1, K] (SILU_MUL: [1, 2K]) -> (out [1, N], x + residual [1, K] when RMSNORM with a residual).

    RMSNORM without a residual returns x itself as the residual (the first layer's stream).
    """
    assert x.shape[0] == 1 and x.is_contiguous() and weight.is_contiguous()
    n_dim, k_dim = weight.shape
    assert x.shape[1] == (2 * k_dim if prologue == SILU_MUL else k_dim)
    assert k_dim % 2048 == 0, "K must be a multiple of the largest BLOCK_K"
    out = torch.empty(1, n_dim, device=x.device, dtype=x.dtype)
    res_out = x
    has_res = prologue == RMSNORM and residual is not None
    if has_res:
        assert residual is not None and residual.shape == x.shape and residual.is_contiguous()
        res_out = torch.empty_like(x)
    if prologue == RMSNORM:
        assert norm_weight is not None

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(n_dim, meta["BLOCK_N"]),)

    _gemv_kernel[grid](
        x, residual if has_res else x, norm_weight if norm_weight is not None else x, res_out, weight,
        scale if scale is not None else weight, out, n_dim, k_dim, eps,
        PROLOGUE=prologue, HAS_RES=has_res, HAS_SCALE=scale is not None,
    )
    return out, (res_out if prologue == RMSNORM else None)
