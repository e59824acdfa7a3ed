"""FP8 (e4m3) weights with one float32 scale per output channel, computed at load time.

`quantize_weight(w)` turns a bf16 [N, K] matrix into `Fp8Weight` (scale = max |w[n, :]| / 448). `linear`
is the one matrix product the fast path calls: plain `F.linear` for bf16 weights; for FP8 weights on
CUDA a Triton weight-only GEMV for <= 16 rows (runtime/kernels/fp8_gemv.py: on the CUDA cores for the 2-4-row
products its table names, else on the tensor cores), a weight-only Triton product for
the 17-64-row products its table names (runtime/kernels/fp8_gemm.py), else `torch._scaled_mm` with per-row
dynamic activation scales (quantized by runtime/kernels/fp8_act.py); elsewhere (CPU) the weight is dequantized.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.kernels import HAS_TRITON

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
GEMV_MAX_ROWS = 16


@dataclass(frozen=True)
class Fp8Weight:
    """A quantized linear weight: `weight` [N, K] float8_e4m3fn, `scale` [N] float32 (w ~= weight * scale)."""

    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] in `dtype` (for CPU fallback and drift checks)."""
        return (self.weight.float() * self.scale[:, None]).to(dtype)

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.scale.numel() * 4


Weight = torch.Tensor | Fp8Weight


def quantize_weight(w: torch.Tensor, chunk_rows: int = 8192) -> Fp8Weight:
    """Per-output-channel symmetric e4m3 quantization of w [N, K]; chunked so no full float32 copy exists."""
    assert w.dim() == 2
    q = torch.empty(w.shape, device=w.device, dtype=FP8_DTYPE)
    scale = torch.empty(w.shape[0], device=w.device, dtype=torch.float32)
    for start in range(0, w.shape[0], chunk_rows):
        block = w[start : start + chunk_rows].float()  # [n, K]
        s = block.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX  # [n]
        q[start : start + chunk_rows] = (block / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        scale[start : start + chunk_rows] = s
    return Fp8Weight(q, scale)


# "act_quant": how `_scaled_mm_linear` quantizes its activations: "triton" = one kernel
# (runtime/kernels/fp8_act.py), "torch" = the eager ops (six to seven kernels, 15-57 us more per product on the
# H200, bench/results/fp8-rows-h200/); the same bits either way. "weight_only": "table" = the products of 2-4
# rows that runtime/kernels/fp8_gemv.py's ROWS_TILES names go through its multi-row CUDA-core GEMV, and those
# of 17-64 rows that runtime/kernels/fp8_gemm.py's table names through that weight-only kernel; "off" = 2-16
# rows through fp8_gemv.py's tensor-core kernel, more through `torch._scaled_mm`.
OPTIONS: dict[str, str] = {"act_quant": "triton", "weight_only": "table"}


def quantize_activations(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 codes [rows, K], float32 scales [rows, 1]): per row, scale = max(max|row|, 1e-12) x
    float32(1 / 448) and codes = row / scale; rows past M are zero rows (padding)."""
    if OPTIONS["act_quant"] == "triton" and HAS_TRITON and x.is_cuda:
        from runtime.kernels.fp8_act import quantize_rows

        return quantize_rows(x.contiguous(), rows)
    xf = x.float()
    if rows != x.shape[0]:
        xf = F.pad(xf, (0, 0, 0, rows - x.shape[0]))
    # times float32(1 / 448), not / 448: what PyTorch's CUDA division by a scalar computes (a multiplication by
    # the reciprocal), written out so that the CPU (which divides) gives the same bits
    sa = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) * (1.0 / FP8_MAX)  # [rows, 1]
    return (xf / sa).to(FP8_DTYPE), sa


def _scaled_mm_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """Dynamic per-row activation quantization + torch._scaled_mm (rowwise scales); rows padded to 16."""
    rows = x.shape[0]
    xq, sa = quantize_activations(x, -(-rows // 16) * 16)
    out = torch._scaled_mm(xq, w.weight.t(), scale_a=sa, scale_b=w.scale[None, :], out_dtype=x.dtype)
    return out[:rows]


def linear(x: torch.Tensor, w: Weight, *, small_batch_kernel: str = "triton") -> torch.Tensor:
    """x [M, K] @ w.T -> [M, N]; `small_batch_kernel` ("triton" | "scaled_mm") picks the FP8 path for M <= 16."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    if x.device.type != "cuda":
        return F.linear(x, w.dequantize(x.dtype))
    if x.shape[0] <= GEMV_MAX_ROWS and small_batch_kernel == "triton" and HAS_TRITON and x.shape[1] % 512 == 0:
        from runtime.kernels.fp8_gemv import fp8_gemv, gemv_rows, rows_tiles

        rows = rows_tiles(x.shape[0], *w.weight.shape) if OPTIONS["weight_only"] == "table" else None
        if rows is not None:
            return gemv_rows(x.contiguous(), w.weight, w.scale, rows)
        return fp8_gemv(x.contiguous(), w.weight, w.scale)
    if OPTIONS["weight_only"] == "table" and HAS_TRITON:
        from runtime.kernels.fp8_gemm import fp8_gemm, weight_only_tiles

        tiles = weight_only_tiles(x.shape[0], *w.weight.shape)
        if tiles is not None:
            return fp8_gemm(x.contiguous(), w.weight, w.scale, tiles)
    return _scaled_mm_linear(x, w)
