"""Attention inside fixed chunks of a few frames (the flow estimator's code-aligned 4-frame chunks).

`F.scaled_dot_product_attention` over [B*N, H, 4, D] runs a flash kernel built for 64-128 row tiles on
4 rows, which made attention the largest cost of the flow estimator (bench/results/vocoder-profile-*.json).
Here a program takes ROWS consecutive token rows and one head straight out of the fused QKV projection;
row m attends to the CHUNK rows of its own chunk (m // CHUNK), with an online softmax in float32.
Only imported when Triton is present (see vocoder/kernels/__init__.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from runtime.kernels.launch import pdl_args, pdl_enter


@triton.jit
def _chunk_attention_kernel(
    qkv_ptr,
    out_ptr,
    M,
    scale,
    H: tl.constexpr,
    D: tl.constexpr,
    CHUNK: tl.constexpr,
    ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # token rows
    h = tl.program_id(1)
    d = tl.arange(0, D)
    row_mask = (m < M)[:, None]
    stride = 3 * H * D
    q = tl.load(qkv_ptr + m[:, None].to(tl.int64) * stride + h * D + d[None, :], mask=row_mask, other=0.0)
    q = q.to(tl.float32) * scale
    first = (m // CHUNK) * CHUNK
    best = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    for j in tl.static_range(CHUNK):
        key_row = (first + j)[:, None].to(tl.int64) * stride
        k = tl.load(qkv_ptr + key_row + (H + h) * D + d[None, :], mask=row_mask, other=0.0).to(tl.float32)
        v = tl.load(qkv_ptr + key_row + (2 * H + h) * D + d[None, :], mask=row_mask, other=0.0).to(tl.float32)
        s = tl.sum(q * k, axis=1)  # [ROWS]
        new_best = tl.maximum(best, s)
        correction = tl.exp(best - new_best)
        p = tl.exp(s - new_best)
        total = total * correction + p
        acc = acc * correction[:, None] + p[:, None] * v
        best = new_best
    out = acc / total[:, None]
    tl.store(
        out_ptr + m[:, None].to(tl.int64) * (H * D) + h * D + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask,
    )


def chunk_attention(qkv: torch.Tensor, num_heads: int, head_dim: int, chunk: int) -> torch.Tensor:
    """qkv [M, 3 * H * D] (q | k | v, head-major inside each) -> [M, H * D]; rows attend within their chunk.

    M must be a multiple of `chunk`; equal to softmax(q k^T / sqrt(D)) v per chunk and head (no mask).
    """
    assert qkv.is_cuda and qkv.dim() == 2 and qkv.shape[1] == 3 * num_heads * head_dim
    assert qkv.shape[0] % chunk == 0 and head_dim == triton.next_power_of_2(head_dim)
    qkv = qkv.contiguous()
    rows_total = qkv.shape[0]
    out = torch.empty(rows_total, num_heads * head_dim, device=qkv.device, dtype=qkv.dtype)
    if rows_total == 0:
        return out
    rows = max(16, min(64, 4096 // head_dim))
    rows -= rows % chunk if rows % chunk else 0
    grid = (triton.cdiv(rows_total, rows), num_heads)
    _chunk_attention_kernel[grid](
        qkv,
        out,
        rows_total,
        1.0 / math.sqrt(head_dim),
        H=num_heads,
        D=head_dim,
        CHUNK=chunk,
        ROWS=rows,
        num_warps=4,
        **pdl_args(),
    )
    return out
