"""In-place per-channel bias add on channels-last [B, C, T] data (BigVGAN's conv outputs).

PyTorch adds a conv's bias after cuDNN's conv as a broadcast `add_`; on channels-last outputs that add takes
the non-vectorised elementwise path, ~1.4 TB/s on the H200 (19 such adds per BigVGAN stage, ~100 ms of a
256-stream step; bench/results/vocoder-flowcl-h200/). Here the data is [B*T, C] rows with the bias along
the contiguous channels. Only imported when Triton is present (see vocoder/kernels/__init__.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.launch import pdl_args, pdl_enter
from vocoder.layout import is_channels_last


@triton.jit
def _channel_bias_kernel(y_ptr, b_ptr, R, C: tl.constexpr, BC: tl.constexpr, ROWS: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BC)
    mask = (r < R)[:, None] & (c < C)[None, :]
    off = r[:, None] * C + c[None, :]
    bias = tl.load(b_ptr + c, mask=c < C, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + off, mask=mask, other=0.0).to(tl.float32) + bias[None, :]
    tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=mask)


def add_channel_bias_(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """y[:, c, :] += bias[c] in place for a channels-last y [B, C, T] (`vocoder.layout`); returns y. Each
    sum is rounded to y's dtype once, as `y.add_(bias[:, None])` rounds it."""
    assert is_channels_last(y) and bias.shape == (y.shape[1],), (y.shape, y.stride(), bias.shape)
    b, c, t = y.shape
    rows_total = b * t
    if rows_total == 0:
        return y
    bc = triton.next_power_of_2(c)
    rows = max(1, 4096 // bc)  # 4096 elements (8 KB of bf16) per program
    _channel_bias_kernel[(triton.cdiv(rows_total, rows),)](
        y, bias.contiguous(), rows_total, C=c, BC=bc, ROWS=rows, num_warps=4, **pdl_args()
    )
    return y
