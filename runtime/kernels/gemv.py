"""One-row matrix-vector product with the layer's small ops fused in front (Triton), for 1-stream decode.

out[N] = prologue(x) @ W.T, W [N, K] bf16 or FP8 (then times a per-row scale). Prologues:
- NONE: x as is.
- RMSNORM: rmsnorm(x) * norm_w, or rmsnorm(x + res) * norm_w with the sum also written (program 0), so
  the residual add and the RMSNorm cost no launch of their own.
- SILU_MUL: x = [gate, up] of length 2K; silu(gate) * up.
The RMSNorm prologue first reads the whole row for its sum of squares (OPTIONS["prologue"]), then each
weight tile's slice of x again. Rounding matches the eager ops (runtime/kernels/elementwise.py). Each
program streams BLOCK_N weight rows with wide loads (no tensor cores: one row of x).
Under PDL (runtime/kernels/__init__.py) a program may be scheduled while the previous kernel runs.

FP8 weights are widened to float32 by Triton's conversion (`cvt.rn.f16x2.e4m3x2`, then `cvt.f32.f16`).
Tried and measured slower on the H200 (commits ec0eeb8, 2274365; bench/results/gemv-fp8-unpack-h200/,
gemv-prefetch-h200/): unpacking FP8 by integer bit moves instead of the conversion unit (exact, 15% slower
step), loading the next weight tile ahead into registers, and loading the first tile before the PDL wait
(both raise the register count and cut the number of programs per SM).

The accumulator (`OPTIONS["fold"]`, per matrix from TILES_FOLD by default): fold 1 sums each tile's
products over K at once into BLOCK_N float32 values, with a cross-thread sum per tile; fold 2 sums only
within each thread's 16-byte vector (BLOCK_N x BLOCK_K/VEC values, no shuffles in the loop) and across
threads once at the end; the earlier kernel (fold 0) kept a BLOCK_N x BLOCK_K float32 accumulator. Folding
halves the registers (ptxas: 124 -> 56 for a 16 x 512 FP8 tile), so more programs fit per SM and wider
tiles fit at all. Same-process A/B of the one-stream step, unfolded vs the
table: FP8 3.007 vs 2.710 ms, bf16 all-GEMV vs last session's default (`mixed2`, unfolded) 4.472 vs 4.629 ms
(bench/results/gemv-fold-h200/). The forms sum in different orders, so their outputs differ by float32
rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels import pdl_mode
from runtime.kernels.launch import l2_prefetch_rows, pdl_args, pdl_enter

NONE, RMSNORM, SILU_MUL = 0, 1, 2


# Tiles of the unfolded kernel (`fold` off): (BLOCK_N, BLOCK_K, warps) per (weight bytes per element, N, K)
# of the full model's matrices: chosen from H200 sweeps of each matrix alone with cold L2
# (bench/gemv_tune.py), then by coordinate descent inside the captured one-stream decode step
# (bench/gemv_tune.py --in-step; bench/results/gemv-tune-*-h200.json).
# A fixed table instead of Triton's autotuner: the autotuner times each shape on one L2-warm matrix in
# isolation; it picked tiles up to 18% slower than the best (QKV 20.7 vs 17.5 us) and its choices varied
# from process to process.
TILES = {
    (2, 6144, 4096): (8, 512, 4),  # qkv
    (2, 4096, 4096): (16, 1024, 8),  # o
    (2, 24576, 4096): (16, 512, 4),  # gate_up
    (2, 4096, 12288): (4, 1024, 4),  # down
    (2, 151680, 4096): (16, 512, 4),  # text head
    (2, 16512, 4096): (16, 512, 4),  # audio head
    (1, 6144, 4096): (8, 512, 4),
    (1, 4096, 4096): (4, 1024, 4),
    (1, 24576, 4096): (32, 512, 8),
    (1, 4096, 12288): (8, 1024, 4),
    (1, 151680, 4096): (16, 256, 4),
    (1, 16512, 4096): (16, 256, 4),
}


# Launch-time options, read at each launch (so a CUDA graph keeps those in force at its capture):
# "fold" selects the accumulator (module docstring): 0 none (tiles from TILES), 1 across the tile, 2 within
# each thread's 16-byte vectors only, or "table": each matrix's mode from TILES_FOLD. bench/gemv_tune.py
# times the step each way.
# "prologue" (RMSNORM only): how the norm's sum of squares reads x (and the residual). "loop": in BLOCK_K
# steps, one dependent load per step (the kernel before the twenty-ninth session); "whole": the whole row
# with one load (K a power of two up to MAX_WHOLE_K); "whole_w": also the first weight tile's load issued
# before that read, so both are in flight together; "auto" (the default): "whole_w" for bf16 weights and
# "whole" for FP8, the faster of the three for each in the captured one-stream step (same-process A/B, six
# interleaved rounds, medians: bf16 4.527 / 4.582 / 4.477 ms, FP8 2.738 / 2.727 / 2.838 ms for loop /
# whole / whole_w; logits identical: bench/results/gemv-prologue-h200/).
# "l2_slice": under PDL, before its wait, thread 0 of each program asks L2 for the first this many bytes of
# its weight rows (one contiguous slice; -1: all of it; 0: nothing). "auto" (the default): 2048 for FP8
# weights, 0 for bf16. The captured one-stream FP8 step, 8 interleaved rounds: with serving's 4096-key table
# 2.631 / 2.628 ms without, 2.601 / 2.602 with 2048 bytes, 2.606 with 3072; with a 576-key table
# 2.600-2.606 without (five copies over two runs), 2.575-2.578 with 2048 (three), 2.592 with 1024, 2.588 /
# 2.594 with 4096 / 8192, 2.799 with 32768, 3.071 with the whole slice. bf16: copies of the same graph
# differed by up to 2.7% there, and 2048 bytes landed on both sides of the step without it, so it stays off
# (bench/results/l2-prefetch-before-wait-h200/). The FP8 2-4-row GEMV (fp8_gemv.py) follows this option too:
# 2 streams 3.020 / 3.016 ms against 3.044 / 3.041, 3-4 streams even.
OPTIONS: dict[str, int | str] = {"fold": "table", "prologue": "auto", "l2_slice": "auto"}
L2_SLICE_FP8 = 2048
PROLOGUES = ("loop", "whole", "whole_w", "auto")
MAX_WHOLE_K = 8192


# Tiles and fold modes (BLOCK_N, BLOCK_K, warps, fold) of the folded kernel (the default), for the FP8 and
# bf16 "gemv" modes: sweeps of each matrix alone with cold L2 ranked tiles under fold 1 and fold 2
# (bench/gemv_tune.py --settings "fold=1;fold=2"), then coordinate descent over each matrix's six fastest
# inside the one-stream step (bench/gemv_tune.py --in-step --from-sweep ...): FP8 step 2.835 -> 2.726 ms,
# bf16 4.576 -> 4.515 ms, mostly from FP8 down (fold 2) and bf16 gate/up; the other moves are within the
# noise (bench/results/gemv-fold-h200/fold2/).
TILES_FOLD = {
    (2, 6144, 4096): (4, 4096, 4, 2),  # qkv
    (2, 4096, 4096): (1, 2048, 4, 1),  # o
    (2, 24576, 4096): (32, 512, 8, 2),  # gate_up
    (2, 4096, 12288): (8, 1024, 8, 1),  # down
    (2, 151680, 4096): (32, 256, 8, 2),  # text head
    (2, 16512, 4096): (16, 512, 8, 2),  # audio head
    # FP8: descent again with the RMSNorm row read whole (twenty-ninth session;
    # bench/results/gemv-prologue-h200/gemv-tune-step-fp8-prologue.json): qkv (16, 1024, 8, 2), o (4, 2048, 4, 2), text head (32, 512, 8, 2),
    # audio head (16, 512, 4, 1) before; the step 2.640 -> 2.614 ms in 8 interleaved rounds, every round
    # faster. A second pass (gemv-tune-step-fp8-pass2.json, after the one-launch embedding and dynamic key
    # partitions) moved qkv from (16, 2048, 4, 2): 2.618 -> 2.602 ms in 8 interleaved rounds.
    (1, 6144, 4096): (8, 1024, 8, 2),
    (1, 4096, 4096): (4, 2048, 4, 1),
    (1, 24576, 4096): (32, 512, 4, 1),
    (1, 4096, 12288): (8, 2048, 8, 2),
    (1, 151680, 4096): (32, 512, 4, 2),
    (1, 16512, 4096): (32, 512, 8, 2),
}


def tiles() -> dict[tuple[int, int, int], tuple[int, ...]]:
    """The tile table of the kernel the options in force select."""
    return TILES if OPTIONS["fold"] == 0 else TILES_FOLD


def gemv_tile(elem_bytes: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, fold) for an [n, k] weight under the options in force: the table's, else
    by the nearest kind of matrix."""
    mode = OPTIONS["fold"]
    assert mode in (0, 1, 2, "table"), OPTIONS
    key = (elem_bytes, n, k)
    if mode == 0:
        if key in TILES:
            return (*TILES[key], 0)
        if n >= 65536:  # a head
            return (16, 512, 4, 0) if elem_bytes == 2 else (16, 256, 4, 0)
        if k > n:  # a down projection
            return (4, 1024, 4, 0) if elem_bytes == 2 else (8, 1024, 4, 0)
        return (16, 512, 4, 0) if elem_bytes == 2 else (8, 512, 4, 0)
    block_n, block_k, warps, fold = TILES_FOLD.get(key, (16, 1024, 8, 1) if k > n else (32, 512, 4, 1))
    return block_n, block_k, warps, fold if mode == "table" else int(mode)


@triton.jit
def _row_squares(x_ptr, res_ptr, res_out_ptr, k, pid, act_ty: tl.constexpr, HAS_RES: tl.constexpr):
    """The RMSNorm's row at columns k squared in float32: x, or x + the residual rounded to the activation
    type (that sum stored by program 0 as the next residual)."""
    xv = tl.load(x_ptr + k)
    if HAS_RES:
        xv = (xv.to(tl.float32) + tl.load(res_ptr + k).to(tl.float32)).to(act_ty)
        if pid == 0:
            tl.store(res_out_ptr + k, xv)
    xf = xv.to(tl.float32)
    return xf * xf


@triton.jit
def _x_tile(x_ptr, res_ptr, nw_ptr, k, K, rstd, act_ty: tl.constexpr, PROLOGUE: tl.constexpr,
            HAS_RES: tl.constexpr):
    """The prologue's x at columns k, float32 (rounded to the activation type as the eager ops round)."""
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
    return xv


@triton.jit
def _accumulate(acc, w, xv, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
                FOLD: tl.constexpr):
    if FOLD == 1:
        acc += tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
    elif FOLD == 2:
        acc += tl.sum(tl.reshape(w.to(tl.float32) * xv[None, :], [BLOCK_N, BLOCK_K // VEC, VEC]), axis=2)
    else:
        acc += w.to(tl.float32) * xv[None, :]
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr, res_ptr, nw_ptr, res_out_ptr, w_ptr, s_ptr, out_ptr, N, K, eps,
    PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_SCALE: tl.constexpr, USE_PDL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FOLD: tl.constexpr, WHOLE_K: tl.constexpr,
    FIRST_W: tl.constexpr, L2_SLICE: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    n = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    nmask = n < N
    tile = tl.arange(0, BLOCK_K)
    # the weight pointers once, before the loop: formed in the loop, a folded 32 x 512 FP8 tile took 96
    # registers instead of 80 and the folded FP8 step lost to the unfolded one (3.14 vs 3.04 ms; folded with
    # these pointers it wins, 2.83 vs 3.02: bench/results/gemv-fold-h200/)
    w_ptrs = w_ptr + n[:, None] * K + tile[None, :]
    if L2_SLICE != 0:  # the first L2_SLICE bytes of the program's weight rows (-1: all) asked before the wait
        l2_prefetch_rows(w_ptr, pid, N, K, BLOCK_N, L2_SLICE)
    pdl_enter(USE_PDL)
    if FIRST_W:  # the first tile's load in flight while the norm's row is read (OPTIONS "whole_w")
        w_first = tl.load(w_ptrs, mask=nmask[:, None], other=0.0)
    act_ty = x_ptr.dtype.element_ty
    rstd = 0.0
    if PROLOGUE == 1:
        if WHOLE_K > 0:  # the whole row in one load (OPTIONS "whole")
            ss = _row_squares(x_ptr, res_ptr, res_out_ptr, tl.arange(0, WHOLE_K), pid, act_ty, HAS_RES)
        else:
            ss = tl.zeros([BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                ss += _row_squares(x_ptr, res_ptr, res_out_ptr, k0 + tile, pid, act_ty, HAS_RES)
        rstd = tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
    VEC: tl.constexpr = 128 // w_ptr.dtype.element_ty.primitive_bitwidth  # elements per 16-byte load
    if FOLD == 1:
        acc = tl.zeros([BLOCK_N], tl.float32)
    elif FOLD == 2:
        acc = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    start = 0
    if FIRST_W:
        x_first = _x_tile(x_ptr, res_ptr, nw_ptr, tile, K, rstd, act_ty, PROLOGUE, HAS_RES)
        acc = _accumulate(acc, w_first, x_first, BLOCK_N, BLOCK_K, VEC, FOLD)
        start = BLOCK_K
    for k0 in range(start, K, BLOCK_K):
        # the weight load first: issued before the prologue's math, whose latency it then covers (the
        # other order: 3.71 vs 3.47 ms in an FP8 step, bench/results/gemv-fp8-unpack-h200/)
        w = tl.load(w_ptrs + k0, mask=nmask[:, None], other=0.0)
        xv = _x_tile(x_ptr, res_ptr, nw_ptr, k0 + tile, K, rstd, act_ty, PROLOGUE, HAS_RES)
        acc = _accumulate(acc, w, xv, BLOCK_N, BLOCK_K, VEC, FOLD)
    if FOLD == 1:
        out = acc
    else:
        out = tl.sum(acc, axis=1)
    if HAS_SCALE:
        out = out * tl.load(s_ptr + n, mask=nmask, other=0.0)
    # rounded to the activations' type first, so a float32 output (the heads' logits) holds the values the
    # activation-typed output would, widened (as `.float()` of it would give them, without that launch)
    tl.store(out_ptr + n, out.to(act_ty).to(out_ptr.dtype.element_ty), mask=nmask)


def prologue_launch(prologue: int, k_dim: int, elem_bytes: int) -> dict[str, int | bool]:
    """WHOLE_K and FIRST_W for a launch under OPTIONS["prologue"] (see OPTIONS) on weights of `elem_bytes`
    bytes: the whole-row read applies to the RMSNorm prologue over a power-of-two K up to MAX_WHOLE_K,
    else the loop runs."""
    mode = OPTIONS["prologue"]
    if mode not in PROLOGUES:
        raise ValueError(f"OPTIONS['prologue'] must be one of {PROLOGUES}, got {mode!r}")
    if mode == "auto":
        mode = "whole_w" if elem_bytes >= 2 else "whole"
    whole = mode != "loop" and prologue == RMSNORM and k_dim <= MAX_WHOLE_K and k_dim & (k_dim - 1) == 0
    return {"WHOLE_K": k_dim if whole else 0, "FIRST_W": whole and mode == "whole_w"}


def l2_slice_launch(elem_bytes: int) -> dict[str, int]:
    """L2_SLICE for a launch on weights of `elem_bytes` bytes under OPTIONS["l2_slice"]: nothing without PDL
    (the prefetch is there to run before the wait; PDL also implies Hopper, which the prefetch needs)."""
    mode = OPTIONS["l2_slice"]
    if mode == "auto":
        mode = L2_SLICE_FP8 if elem_bytes == 1 else 0
    if not isinstance(mode, int) or isinstance(mode, bool) or (mode != -1 and (mode < 0 or mode % 16)):
        raise ValueError(f"OPTIONS['l2_slice'] must be 'auto', -1 or a multiple of 16 >= 0, got {mode!r}")
    return {"L2_SLICE": mode} if mode and pdl_mode() != "off" else {}


def gemv(
    x: torch.Tensor, weight: torch.Tensor, *, scale: torch.Tensor | None = None, prologue: int = NONE,
    residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [1, K] (SILU_MUL: [1, 2K]) -> (out [1, N], x + residual [1, K] when RMSNORM with a residual).

    RMSNORM without a residual returns x itself as the residual (the first layer's stream). `out_dtype`
    (default x's): the output is rounded to x's dtype, then stored in this one (float32 logits equal to
    the x-typed output's `.float()`).
    """
    assert x.shape[0] == 1 and x.is_contiguous() and weight.is_contiguous()
    n_dim, k_dim = weight.shape
    assert x.shape[1] == (2 * k_dim if prologue == SILU_MUL else k_dim)
    block_n, block_k, warps, fold = gemv_tile(weight.element_size(), n_dim, k_dim)
    assert k_dim % block_k == 0, f"K ({k_dim}) must be a multiple of BLOCK_K ({block_k})"
    out = torch.empty(1, n_dim, device=x.device, dtype=out_dtype or x.dtype)
    res_out = x
    has_res = prologue == RMSNORM and residual is not None
    if has_res:
        assert residual is not None and residual.shape == x.shape and residual.is_contiguous()
        res_out = torch.empty_like(x)
    if prologue == RMSNORM:
        assert norm_weight is not None
    _gemv_kernel[(triton.cdiv(n_dim, block_n),)](
        x, residual if has_res else x, norm_weight if norm_weight is not None else x, res_out, weight,
        scale if scale is not None else weight, out, n_dim, k_dim, eps,
        PROLOGUE=prologue, HAS_RES=has_res, HAS_SCALE=scale is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        FOLD=fold, num_warps=warps, num_stages=1, **prologue_launch(prologue, k_dim, weight.element_size()),
        **l2_slice_launch(weight.element_size()), **pdl_args(),
    )
    return out, (res_out if prologue == RMSNORM else None)
