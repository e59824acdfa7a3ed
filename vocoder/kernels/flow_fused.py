"""Fused Triton kernels of the flow estimator: fewer launches per Euler step.

At a first chunk the estimator runs on a few dozen rows, and each of its ~900 kernels per Euler step costs
its launch and ramp more than its work (bench/results/vocoder-profile-*.json). Two fusions:

- `fused_linear`: y = act(LN(x) @ W^T + b) + r, the LayerNorm in the prologue and bias, exact GELU and
  residual in the epilogue; a transformer block becomes LN1+QKV, attention, out+residual, LN2+FF1+GELU,
  FF2+residual (5 kernels instead of ~10). Narrow tiles for few rows: above ~400 rows cuBLAS's matmuls
  win (measured in bench/vocoder_profile.py), and ChunkTransformer routes by row count.
- `causal_conv_norm_mish`: a whole CausalBlock, the causal conv reading its left context straight from the
  stream's cache, LayerNorm over channels, Mish and the resnet's time bias, plus the cache update: one
  kernel instead of a concatenation, layout conversions around the conv, the conv, a transposed norm,
  the Mish, the add and the cache gather. At few rows (a first chunk) two: the conv split by output
  channel over many programs, then the norm, Mish and adds, including a resnet's 1x1 residual.

Rounding follows the PyTorch modules they replace: each intermediate the module would store in the
activation dtype (conv and linear outputs, the norm's output, the GELU's output) is rounded to it here
too; arithmetic is float32. bench/vocoder_profile.py checks both against the modules on the GPU.
Only imported when Triton is present (see vocoder/kernels/__init__.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.launch import pdl_args, pdl_enter
from vocoder.layout import empty_channels_last, is_channels_last, pointwise

_GELU_NONE, _GELU_ERF = 0, 1


@triton.jit
def _layer_norm_rows(xf, mask, g, bb, eps, n):
    """LayerNorm over axis 1 of a float32 [rows, n-lane] tile, as torch.layer_norm (mean and biased variance;
    lanes outside `mask` read as 0 and are left out); g, bb [n-lane] float32. Returns float32 (callers round
    to the dtype the module would store)."""
    mean = tl.sum(xf, 1) / n
    d = tl.where(mask, xf - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, 1) / n + eps)
    return d * rstd[:, None] * g[None, :] + bb[None, :]


@triton.jit
def _fused_linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    g_ptr,
    beta_ptr,
    r_ptr,
    y_ptr,
    M,
    N,
    eps,
    K: tl.constexpr,
    HAS_LN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    HAS_RES: tl.constexpr,
    IEEE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    USE_PDL: tl.constexpr,
    EARLY_W: tl.constexpr,
):
    # With HAS_LN, BK == K: the program holds whole rows, so the norm's statistics need no second read.
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_mask = rm < M
    n_mask = rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * K
    w_cols = w_ptr + rn[None, :].to(tl.int64) * K
    # Parameters do not depend on the previous kernel: with EARLY_W the first weight tile, the norm's and the
    # bias's values are fetched before waiting for it (programmatic dependent launch lets this program start
    # while that kernel drains), and each next weight tile one step ahead.
    if EARLY_W:
        w_next = tl.load(w_cols + rk[:, None], mask=(rk < K)[:, None] & n_mask[None, :], other=0.0)
    if HAS_LN:
        g = tl.load(g_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
        bb = tl.load(beta_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    pdl_enter(USE_PDL)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        k_mask = (k0 + rk) < K
        x = tl.load(x_rows + (k0 + rk)[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if HAS_LN:
            x = _layer_norm_rows(x.to(tl.float32), k_mask[None, :], g, bb, eps, K).to(w_ptr.dtype.element_ty)
        if EARLY_W:
            w = w_next
            nk = k0 + BK + rk
            w_next = tl.load(w_cols + nk[:, None], mask=(nk < K)[:, None] & n_mask[None, :], other=0.0)
        else:
            w = tl.load(w_cols + (k0 + rk)[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # W^T
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    y = acc
    if HAS_BIAS:
        y += bias[None, :]
    y = y.to(y_ptr.dtype.element_ty).to(tl.float32)  # the linear's stored output
    if ACT == 1:  # exact GELU (nn.GELU default)
        y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
    out_off = rm[:, None].to(tl.int64) * N + rn[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if HAS_RES:
        y += tl.load(r_ptr + out_off, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + out_off, y.to(y_ptr.dtype.element_ty), mask=out_mask)


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    gelu: bool = False,
    residual: torch.Tensor | None = None,
    tiles: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [M, K] -> [M, N]: `gelu?(layer_norm?(x) @ weight.T + bias) + residual`.

    weight [N, K] (an nn.Linear's), bias [N], norm (LayerNorm weight [K], bias [K], eps), residual [M, N];
    all in x's dtype on one CUDA device. float32 runs the dot in IEEE float32 (no TF32). Built for the
    few-row steps (first chunks): narrow column tiles spread a small matrix over many programs, each
    reading its rows whole (K <= 256 with a norm) or in 256-wide slices. `tiles` = (BM, BN, BK, warps,
    stages) overrides `linear_tiles` (bench/flow_linear_tiles.py sweeps them).
    """
    assert x.dim() == 2 and weight.dim() == 2  # CUDA tensors (CPU ones under TRITON_INTERPRET=1, for tests)
    x, weight = x.contiguous(), weight.contiguous()
    m = x.shape[0]
    n, k = weight.shape
    assert x.shape[1] == k, (x.shape, weight.shape)
    assert k % 16 == 0, k
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return y
    if residual is not None:
        assert residual.shape == (m, n), (residual.shape, (m, n))
        residual = residual.contiguous()
    if norm is not None and k > 256:
        raise ValueError(f"fused_linear holds normalised rows whole: K <= 256, got {k}")
    bm, bn, bk, warps, stages = tiles if tiles is not None else linear_tiles(m, k)
    if norm is not None:
        bk = triton.next_power_of_2(k)  # whole rows for the norm's statistics
        if m > SMALL_ROWS:
            stages = 1  # one K step: nothing to pipeline, and two big stages would not fit shared memory
    gamma, beta, eps = norm if norm is not None else (weight, weight, 0.0)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _fused_linear_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        gamma.contiguous(),
        beta.contiguous(),
        residual if residual is not None else y,
        y,
        m,
        n,
        float(eps),
        K=k,  # a compile-time loop bound (also what Triton's CPU interpreter needs)
        HAS_LN=norm is not None,
        HAS_BIAS=bias is not None,
        ACT=_GELU_ERF if gelu else _GELU_NONE,
        HAS_RES=residual is not None,
        IEEE=x.dtype == torch.float32,
        BM=bm,
        BN=bn,
        BK=bk,
        EARLY_W=m <= SMALL_ROWS,  # the narrow few-row tiles; GEMM-sized ones leave it to Triton's pipelining
        num_warps=warps,
        num_stages=stages,
        **pdl_args(),
    )
    return y


@triton.jit
def _ln_qkv_attention_kernel(
    x_ptr,
    w_ptr,
    g_ptr,
    beta_ptr,
    out_ptr,
    M,
    eps,
    scale,
    K: tl.constexpr,
    BK: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    CHUNK: tl.constexpr,
    BM: tl.constexpr,
    IEEE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # one program = BM rows (whole chunks) x one head: LN1 of the rows, the head's q, k and v, attention
    # inside each chunk; the weights (the head's [D, K] slices of W_q, W_k, W_v) are fetched before the wait
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    h = tl.program_id(1)
    rk = tl.arange(0, BK)
    k_mask = rk < K
    d = tl.arange(0, D)
    w_cols = w_ptr + (h * D + d)[None, :].to(tl.int64) * K + rk[:, None]  # [BK, D] of W_q^T for head h
    wq = tl.load(w_cols, mask=k_mask[:, None], other=0.0)
    wk = tl.load(w_cols + H * D * K, mask=k_mask[:, None], other=0.0)
    wv = tl.load(w_cols + 2 * H * D * K, mask=k_mask[:, None], other=0.0)
    g = tl.load(g_ptr + rk, mask=k_mask, other=0.0).to(tl.float32)
    bb = tl.load(beta_ptr + rk, mask=k_mask, other=0.0).to(tl.float32)
    pdl_enter(USE_PDL)
    m_mask = rm < M
    x = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                other=0.0)
    # the norm's stored output
    xn = _layer_norm_rows(x.to(tl.float32), k_mask[None, :], g, bb, eps, K).to(w_ptr.dtype.element_ty)
    if IEEE:
        q = tl.dot(xn, wq, input_precision="ieee")
        k = tl.dot(xn, wk, input_precision="ieee")
        v = tl.dot(xn, wv, input_precision="ieee")
    else:
        q = tl.dot(xn, wq)
        k = tl.dot(xn, wk)
        v = tl.dot(xn, wv)
    # the projection's stored output, then attention in float32 (as the chunk attention kernel computes it)
    q = q.to(out_ptr.dtype.element_ty).to(tl.float32) * scale
    k = k.to(out_ptr.dtype.element_ty).to(tl.float32)
    v = v.to(out_ptr.dtype.element_ty).to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BM, BM]
    same_chunk = (rm[:, None] // CHUNK) == (rm[None, :] // CHUNK)
    s = tl.where(same_chunk, s, float("-inf"))
    p = tl.exp(s - tl.max(s, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    a = tl.dot(p, v, input_precision="ieee")  # [BM, D]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * (H * D) + h * D + d[None, :], a.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None])


def ln_qkv_attention(
    x: torch.Tensor,
    qkv_weight: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor, float],
    num_heads: int,
    head_dim: int,
    chunk: int,
    rows: int = 16,
) -> torch.Tensor:
    """A transformer block's LN1 + QKV projection (no bias) + chunk attention in one kernel:
    x [M, K] (rows grouped in chunks of `chunk` frames) -> [M, H * D], as `chunk_attention(fused_linear(x,
    qkv_weight, norm=norm), H, D, chunk)` computes it (the same roundings; float32 attention). One program
    per `rows` rows (whole chunks) and head reads that head's third of the weight: at a first chunk 8
    programs instead of a projection spread over many and an attention kernel after it."""
    assert x.dim() == 2 and qkv_weight.dim() == 2  # CUDA tensors (CPU ones under TRITON_INTERPRET=1, for tests)
    x = x.contiguous()
    m, k = x.shape
    assert qkv_weight.shape == (3 * num_heads * head_dim, k), (qkv_weight.shape, x.shape)
    assert head_dim == triton.next_power_of_2(head_dim) and head_dim >= 16, head_dim
    assert m % chunk == 0 and rows % chunk == 0 and rows == triton.next_power_of_2(rows), (m, chunk, rows)
    out = torch.empty(m, num_heads * head_dim, device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    gamma, beta, eps = norm
    _ln_qkv_attention_kernel[(triton.cdiv(m, rows), num_heads)](
        x,
        qkv_weight.contiguous(),
        gamma.contiguous(),
        beta.contiguous(),
        out,
        m,
        float(eps),
        1.0 / head_dim**0.5,
        K=k,
        BK=triton.next_power_of_2(k),
        H=num_heads,
        D=head_dim,
        CHUNK=chunk,
        BM=rows,
        IEEE=x.dtype == torch.float32,
        num_warps=4,
        num_stages=1,
        **pdl_args(),
    )
    return out


@triton.jit
def _add_layer_norm_kernel(
    x_ptr,
    y_ptr,
    g_ptr,
    beta_ptr,
    s_ptr,
    n_ptr,
    M,
    eps,
    C: tl.constexpr,
    BC: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_ADD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BC)
    mask = (r < M)[:, None] & (c < C)[None, :]
    off = r[:, None].to(tl.int64) * C + c[None, :]
    v = tl.load(x_ptr + off, mask=mask, other=0.0)
    if HAS_ADD:  # the residual sum, rounded as the module's add stores it
        v = (v.to(tl.float32) + tl.load(y_ptr + off, mask=mask, other=0.0).to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + off, v, mask=mask)
    g = tl.load(g_ptr + c, mask=c < C, other=0.0).to(tl.float32)
    bb = tl.load(beta_ptr + c, mask=c < C, other=0.0).to(tl.float32)
    tl.store(n_ptr + off, _layer_norm_rows(v.to(tl.float32), mask, g, bb, eps, C).to(n_ptr.dtype.element_ty),
             mask=mask)


def add_layer_norm(
    x: torch.Tensor, y: torch.Tensor | None, norm: tuple[torch.Tensor, torch.Tensor, float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, layer_norm(s)) with s = x + y (x itself when y is None), rows [M, C] in one pass: the residual add
    and the next LayerNorm of an estimator transformer at many rows, where PyTorch's LayerNorm over 256
    channels ran at a fifth of the copy bandwidth (bench/results/vocoder-flowcl-h200/)."""
    assert x.dim() == 2 and (y is None or y.shape == x.shape), (x.shape, None if y is None else y.shape)
    x = x.contiguous()
    m, c = x.shape
    s = x if y is None else torch.empty_like(x)
    n = torch.empty_like(x)
    if m == 0:
        return s, n
    gamma, beta, eps = norm
    rows = 16
    _add_layer_norm_kernel[(triton.cdiv(m, rows),)](
        x,
        y.contiguous() if y is not None else x,
        gamma.contiguous(),
        beta.contiguous(),
        s,
        n,
        m,
        float(eps),
        C=c,
        BC=triton.next_power_of_2(c),
        ROWS=rows,
        HAS_ADD=y is not None,
        num_warps=4,
        **pdl_args(),
    )
    return s, n


SMALL_ROWS = 1024  # up to here the narrow tiles of the few-row steps
LINEAR_OPTIONS = {"small_bn": 32}  # output columns per program of those tiles (bench/vocoder_profile.py times others)
# (BM, BN, BK, warps, stages) above SMALL_ROWS: among the best of bench/flow_linear_tiles.py's candidates, yet
# slower than PyTorch's modules with a norm in front (bench/results/flow-linear-tiles-h200.json), which is why
# ChunkTransformer sends steps of more than `fused_max_rows` rows to the modules and never gets here.
LARGE_TILES = (64, 128, 64, 8, 3)


def linear_tiles(m: int, k: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, warps, stages) of `fused_linear` for an [m, k] input: narrow column tiles for few rows
    (a small matrix spread over many programs), GEMM-sized tiles for many (`fused_linear` widens BK to K
    when a norm comes first)."""
    if m <= SMALL_ROWS:
        return (16 if m <= 16 else 32), LINEAR_OPTIONS["small_bn"], min(256, triton.next_power_of_2(k)), 4, 2
    return LARGE_TILES


@triton.jit
def _frame_offsets(c, t, C, T, TIME_MAJOR: tl.constexpr):
    """Offsets of [channels c, frames t] in one row of a [C, T] tensor stored channels-first ([C, T]
    contiguous) or time-major ([T, C] contiguous, the transposed view the estimator carries)."""
    if TIME_MAJOR:
        return t[None, :] * C + c[:, None]
    return c[:, None] * T + t[None, :]


@triton.jit
def _history_frames(
    x_row, cache_row, ci, ci_mask, src, CI, T, HAS_CACHE: tl.constexpr, CTX: tl.constexpr, X_TM: tl.constexpr
):
    """[channels ci, frames src] of one row's [cache | x]: src in [0, T) reads x (time-major with X_TM),
    src in [-CTX, 0) the cache ([CI, CTX], zeros without one: a stream's start); anything else reads 0."""
    v = tl.load(
        x_row + _frame_offsets(ci, src, CI, T, X_TM),
        mask=ci_mask[:, None] & ((src >= 0) & (src < T))[None, :],
        other=0.0,
    )
    if HAS_CACHE:
        v += tl.load(
            cache_row + ci[:, None] * CTX + (src + CTX)[None, :],
            mask=ci_mask[:, None] & ((src < 0) & (src >= -CTX))[None, :],
            other=0.0,
        )
    return v


@triton.jit
def _store_cache_update(
    x_row, cache_row, valid_ptr, upd_ptr, b, CI: tl.constexpr, T, HAS_CACHE: tl.constexpr, CTX: tl.constexpr,
    TIME_MAJOR: tl.constexpr, BK: tl.constexpr,
):
    """Row b's new conv cache [CI, CTX]: the last CTX frames of [cache | x] before the row's padding (its
    valid_ptr[b] new frames)."""
    nv = tl.load(valid_ptr + b)
    c = tl.arange(0, CTX)
    src = nv + c - CTX  # frame in x; negative: frame CTX + src of the old cache
    for k0 in range(0, CI, BK):
        ci = k0 + tl.arange(0, BK)
        ci_mask = ci < CI
        u = _history_frames(x_row, cache_row, ci, ci_mask, src, CI, T, HAS_CACHE, CTX, TIME_MAJOR)
        tl.store(upd_ptr + b * CI * CTX + ci[:, None] * CTX + c[None, :], u, mask=ci_mask[:, None])


@triton.jit
def _norm_mish(h, mask, g, bb, eps, CO, dtype: tl.constexpr):
    """LayerNorm over axis 0 (channels) of a float32 [channels, frames] tile of conv outputs (lanes outside
    `mask` left out), rounded to `dtype` as the module stores it, then Mish; float32."""
    h = tl.where(mask, h, 0.0)
    mean = tl.sum(h, 0) / CO
    d = tl.where(mask, h - mean[None, :], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, 0) / CO + eps)
    h = (d * rstd[None, :] * g[:, None] + bb[:, None]).to(dtype).to(tl.float32)
    sp = tl.where(h > 20.0, h, tl.log(1.0 + tl.exp(tl.minimum(h, 20.0))))  # softplus >= 0
    e = tl.exp(-2.0 * sp)
    return h * (1.0 - e) / (1.0 + e)  # mish = h * tanh(softplus(h))


@triton.jit
def _causal_conv_norm_mish_kernel(
    x_ptr,
    cache_ptr,
    w_ptr,
    cb_ptr,
    g_ptr,
    beta_ptr,
    add_ptr,
    valid_ptr,
    y_ptr,
    upd_ptr,
    CO,
    T,
    add_stride,
    eps,
    CI: tl.constexpr,
    HAS_CACHE: tl.constexpr,
    HAS_ADD: tl.constexpr,
    HAS_UPDATE: tl.constexpr,
    NORM_MISH: tl.constexpr,
    TIME_MAJOR: tl.constexpr,
    IEEE: tl.constexpr,
    CTX: tl.constexpr,
    BCO: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    co = tl.arange(0, BCO)
    co_mask = co < CO
    rk = tl.arange(0, BK)
    x_row = x_ptr + b * CI * T
    cache_row = cache_ptr + b * CI * CTX
    acc = tl.zeros([BCO, BT], tl.float32)
    for j in tl.static_range(CTX + 1):  # tap j reads input frame t + j - CTX (negative: the cache)
        src = t + (j - CTX)
        for k0 in range(0, CI, BK):
            ci = k0 + rk
            ci_mask = ci < CI
            w = tl.load(
                w_ptr + j * CO * CI + co[:, None] * CI + ci[None, :],
                mask=co_mask[:, None] & ci_mask[None, :],
                other=0.0,
            )  # [BCO, BK] of tap j ([taps, C_out, C_in] layout)
            v = _history_frames(x_row, cache_row, ci, ci_mask, src, CI, T, HAS_CACHE, CTX, TIME_MAJOR)  # [BK, BT]
            if IEEE:
                acc = tl.dot(w, v, acc, input_precision="ieee")
            else:
                acc = tl.dot(w, v, acc)
    h = acc + tl.load(cb_ptr + co, mask=co_mask, other=0.0).to(tl.float32)[:, None]
    mask = co_mask[:, None] & (t < T)[None, :]
    if NORM_MISH:
        h = h.to(y_ptr.dtype.element_ty).to(tl.float32)  # the conv's stored output
        g = tl.load(g_ptr + co, mask=co_mask, other=0.0).to(tl.float32)
        bb = tl.load(beta_ptr + co, mask=co_mask, other=0.0).to(tl.float32)
        y = _norm_mish(h, mask, g, bb, eps, CO, y_ptr.dtype.element_ty)
    else:  # a plain causal conv
        y = h
    if HAS_ADD:
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
        y += tl.load(add_ptr + b * add_stride + co, mask=co_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + b * CO * T + _frame_offsets(co, t, CO, T, TIME_MAJOR), y.to(y_ptr.dtype.element_ty), mask=mask)
    if HAS_UPDATE:  # noqa: SIM102 - one program per row writes its new cache
        if tl.program_id(1) == 0:
            _store_cache_update(x_row, cache_row, valid_ptr, upd_ptr, b, CI, T, HAS_CACHE, CTX, TIME_MAJOR, BK)


CONV_BK = 32  # input channels per step of the causal conv kernel (bench/vocoder_profile.py times others)


@triton.jit
def _causal_conv_split_kernel(
    x_ptr,
    cache_ptr,
    w_ptr,
    cb_ptr,
    rx_ptr,
    rw_ptr,
    rb_ptr,
    valid_ptr,
    h_ptr,
    r_ptr,
    upd_ptr,
    CO,
    T,
    CI: tl.constexpr,
    CIR: tl.constexpr,
    HAS_CACHE: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_UPDATE: tl.constexpr,
    TIME_MAJOR: tl.constexpr,
    RES_TM: tl.constexpr,
    IEEE: tl.constexpr,
    CTX: tl.constexpr,
    BCO: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BKR: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The causal conv of few rows with its output channels split over programs (grid: rows, frame tiles,
    channel slices of BCO), so a first chunk's conv weight streams through many SMs instead of one per row.
    Writes the conv's output + bias (rounded to the activation dtype: what the module stores) to h, and with
    HAS_RES the resnet's 1x1 residual conv of rx (+ its bias) to r; both in x's layout. The norm, Mish and
    adds run in `_norm_mish_finish_kernel`, which needs whole frames. The slice-0 programs of the first frame
    tile write the row's cache update. Each weight tile is fetched one step ahead, the first before
    `pdl_enter`: weights do not depend on the previous kernel."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    co = tl.program_id(2) * BCO + tl.arange(0, BCO)
    co_mask = co < CO
    rk = tl.arange(0, BK)
    NK: tl.constexpr = (CI + BK - 1) // BK
    STEPS: tl.constexpr = (CTX + 1) * NK
    w_rows = w_ptr + co[:, None] * CI
    w_next = tl.load(w_rows + rk[None, :], mask=co_mask[:, None] & (rk < CI)[None, :], other=0.0)  # step 0
    cb = tl.load(cb_ptr + co, mask=co_mask, other=0.0).to(tl.float32)
    pdl_enter(USE_PDL)
    x_row = x_ptr + b * CI * T
    cache_row = cache_ptr + b * CI * CTX
    acc = tl.zeros([BCO, BT], tl.float32)
    for s in range(STEPS):  # step s: tap s // NK (reads input frame t + tap - CTX), channels (s % NK) * BK + rk
        w = w_next
        s1 = s + 1
        k1 = (s1 % NK) * BK + rk
        w_next = tl.load(
            w_rows + (s1 // NK) * CO * CI + k1[None, :],
            mask=co_mask[:, None] & ((k1 < CI) & (s1 < STEPS))[None, :],
            other=0.0,
        )
        ci = (s % NK) * BK + rk
        v = _history_frames(x_row, cache_row, ci, ci < CI, t + (s // NK - CTX), CI, T, HAS_CACHE, CTX, TIME_MAJOR)
        if IEEE:
            acc = tl.dot(w, v, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, v, acc)
    mask = co_mask[:, None] & (t < T)[None, :]
    out = b * CO * T + _frame_offsets(co, t, CO, T, TIME_MAJOR)
    tl.store(h_ptr + out, (acc + cb[:, None]).to(h_ptr.dtype.element_ty), mask=mask)
    if HAS_RES:  # the 1x1 conv of the resnet's input: [BCO, CIR] @ [CIR, BT]
        rkr = tl.arange(0, BKR)
        racc = tl.zeros([BCO, BT], tl.float32)
        for k0 in range(0, CIR, BKR):
            cr = k0 + rkr
            wr = tl.load(rw_ptr + co[:, None] * CIR + cr[None, :], mask=co_mask[:, None] & (cr < CIR)[None, :],
                         other=0.0)
            vr = tl.load(rx_ptr + b * CIR * T + _frame_offsets(cr, t, CIR, T, RES_TM),
                         mask=(cr < CIR)[:, None] & (t < T)[None, :], other=0.0)
            if IEEE:
                racc = tl.dot(wr, vr, racc, input_precision="ieee")
            else:
                racc = tl.dot(wr, vr, racc)
        rb = tl.load(rb_ptr + co, mask=co_mask, other=0.0).to(tl.float32)
        tl.store(r_ptr + out, (racc + rb[:, None]).to(r_ptr.dtype.element_ty), mask=mask)
    if HAS_UPDATE:  # noqa: SIM102 - one program per row writes its new cache
        if (tl.program_id(1) == 0) & (tl.program_id(2) == 0):
            _store_cache_update(x_row, cache_row, valid_ptr, upd_ptr, b, CI, T, HAS_CACHE, CTX, TIME_MAJOR, BK)


@triton.jit
def _norm_mish_finish_kernel(
    h_ptr,
    r_ptr,
    g_ptr,
    beta_ptr,
    add_ptr,
    y_ptr,
    CO,
    T,
    add_stride,
    eps,
    HAS_ADD: tl.constexpr,
    HAS_RES: tl.constexpr,
    TIME_MAJOR: tl.constexpr,
    BCO: tl.constexpr,
    BT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """LayerNorm over the channels of each frame of h (the split conv's output), Mish, + add[b, c], + r (the
    resnet's residual), rounded as `_causal_conv_norm_mish_kernel` rounds; grid: rows, frame tiles."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    co = tl.arange(0, BCO)
    co_mask = co < CO
    g = tl.load(g_ptr + co, mask=co_mask, other=0.0).to(tl.float32)
    bb = tl.load(beta_ptr + co, mask=co_mask, other=0.0).to(tl.float32)
    pdl_enter(USE_PDL)
    mask = co_mask[:, None] & (t < T)[None, :]
    off = b * CO * T + _frame_offsets(co, t, CO, T, TIME_MAJOR)
    h = tl.load(h_ptr + off, mask=mask, other=0.0).to(tl.float32)
    y = _norm_mish(h, mask, g, bb, eps, CO, y_ptr.dtype.element_ty)
    if HAS_ADD:
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
        y += tl.load(add_ptr + b * add_stride + co, mask=co_mask, other=0.0).to(tl.float32)[:, None]
    if HAS_RES:
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
        y += tl.load(r_ptr + off, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=mask)


# Few-row convs split their output channels (`_causal_conv_split_kernel`) into slices of "bco" while rows x
# 16-frame tiles are under "below" programs; "bk" input channels per product step. The slice width is fixed,
# not fitted to the grid, so the kernel's compile-time constants do not depend on a step's rows or frames: the
# variants a server's warm-up compiles do not depend on the sizes of the steps that follow. A
# resnet of 2 rows x 8 frames (a first chunk's) on the H200: 35.3 us with the whole-channel kernel + the
# residual's matmul and add, 15.6 us split with bk 256, 18.6 with bk 128, 21.1 with 64; 32-channel slices or 8
# warps no better; the split wins up to 40 programs (2 rows x 320 frames: 32.9 against 38.8 us) and loses
# from 80 (55.1 against 38.8 us) (bench/results/vocoder-split-h200/).
SPLIT_OPTIONS = {"below": 64, "bco": 16, "bk": 256, "warps": 4}


def causal_conv_norm_mish(
    x: torch.Tensor,
    cache: torch.Tensor | None,
    taps: torch.Tensor,
    conv_bias: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None,
    add: torch.Tensor | None = None,
    num_valid: torch.Tensor | None = None,
    residual: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The estimator's whole CausalBlock: causal conv (kernel CTX + 1) over [cache | x], LayerNorm over the
    channels of each frame, Mish, + add[b, c]; with norm None only the conv (+ add); with `residual`
    (x_res [B, C_res, T], weight [C_out, C_res], bias [C_out]) + the resnet's 1x1 conv of x_res.

    x [B, C_in, T], channels-first or channels-last (`vocoder.layout`; the output [B, C_out, T] is stored the
    same way, so the estimator's transformers, which work on frames as rows, need no copies around it);
    cache [B, C_in, CTX] or None (zeros: a stream's start); taps [CTX + 1, C_out, C_in]
    (`conv.weight.permute(2, 0, 1)`); norm (weight, bias, eps) over C_out; num_valid [B]: new valid frames
    per row, for the updated cache (the last CTX frames of [cache | x] before row b's padding), returned
    as [B, C_in, CTX], or None without num_valid.

    Many rows x frames: one kernel (`_causal_conv_norm_mish_kernel`, one program per row and 16 frames, all
    channels; a residual then goes through a matmul and an add). Few (a first chunk): the conv's output
    channels split over programs, then a norm kernel that also adds the residual (SPLIT_OPTIONS).
    """
    assert x.dim() == 3 and taps.dim() == 3  # CUDA tensors (CPU ones under TRITON_INTERPRET=1, for tests)
    time_major = is_channels_last(x)
    if not time_major:
        x = x.contiguous()
    b, ci, t = x.shape
    ctx, co = taps.shape[0] - 1, taps.shape[1]
    assert taps.shape[2] == ci and ctx >= 1 and ctx & (ctx - 1) == 0, (taps.shape, x.shape)
    if cache is not None:
        assert cache.shape == (b, ci, ctx), (cache.shape, (b, ci, ctx))
        cache = cache.to(x.dtype).contiguous()
    y = empty_channels_last(b, co, t, x) if time_major else torch.empty(b, co, t, device=x.device, dtype=x.dtype)
    upd = None if num_valid is None else torch.empty(b, ci, ctx, device=x.device, dtype=x.dtype)
    if add is not None:
        assert add.shape == (b, co), (add.shape, (b, co))
        if add.stride(1) != 1:
            add = add.contiguous()
    bt = 16
    tiles = b * triton.cdiv(t, bt)
    # (a plain conv is split only without extras: the estimator's plain convs have neither an add nor a residual)
    slices = _split_slices(tiles, co) if norm is not None or (add is None and residual is None) else 1
    if slices > 1:
        _causal_conv_split(x, cache, taps, conv_bias, norm, add, num_valid, residual, y, upd, slices, bt)
        return y, upd
    gamma, beta, eps = norm if norm is not None else (conv_bias, conv_bias, 0.0)
    _causal_conv_norm_mish_kernel[(b, triton.cdiv(t, bt))](
        x,
        cache if cache is not None else x,
        taps,
        conv_bias.contiguous(),
        gamma.contiguous(),
        beta.contiguous(),
        add if add is not None else x,
        num_valid if num_valid is not None else x,
        y,
        upd if upd is not None else y,
        co,
        t,
        add.stride(0) if add is not None else 0,
        float(eps),
        CI=ci,  # a compile-time loop bound (also what Triton's CPU interpreter needs)
        HAS_CACHE=cache is not None,
        HAS_ADD=add is not None,
        HAS_UPDATE=upd is not None,
        NORM_MISH=norm is not None,
        TIME_MAJOR=time_major,
        IEEE=x.dtype == torch.float32,
        CTX=ctx,
        BCO=triton.next_power_of_2(co),
        BT=bt,
        BK=CONV_BK,
        num_warps=8,
        **pdl_args(),
    )
    if residual is not None:
        x_res, weight, bias = residual
        y = y + pointwise(x_res, weight, bias)
    return y, upd


def _split_slices(tiles: int, co: int) -> int:
    """Channel slices for a conv of `tiles` programs (rows x frame tiles) and `co` output channels: 1 (the
    whole-channel kernel) from SPLIT_OPTIONS["below"] programs up or under two slices' worth of channels, else
    slices of SPLIT_OPTIONS["bco"] channels (the products' smallest tile side is 16)."""
    bco = SPLIT_OPTIONS["bco"]
    if tiles >= SPLIT_OPTIONS["below"] or co < 2 * bco:
        return 1
    return triton.cdiv(co, bco)


def _causal_conv_split(
    x: torch.Tensor,
    cache: torch.Tensor | None,
    taps: torch.Tensor,
    conv_bias: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None,
    add: torch.Tensor | None,
    num_valid: torch.Tensor | None,
    residual: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    y: torch.Tensor,
    upd: torch.Tensor | None,
    slices: int,
    bt: int,
) -> None:
    """`causal_conv_norm_mish` for few rows: the split conv kernel, then with a norm the finishing kernel (norm,
    Mish, add, residual); a plain conv's output goes straight to y."""
    b, ci, t = x.shape
    ctx, co = taps.shape[0] - 1, taps.shape[1]
    time_major = is_channels_last(x)
    h = y if norm is None else torch.empty_like(y)  # the conv's output (same layout as y)
    r = None if residual is None else torch.empty_like(y)  # the residual conv's output
    # without a residual its pointers are never read: the conv's own stand in
    x_res, r_weight, r_bias = residual if residual is not None else (x, taps[0], conv_bias)
    assert x_res.shape[0] == b and x_res.shape[2] == t and r_weight.shape[0] == co, (x_res.shape, r_weight.shape)
    res_tm = is_channels_last(x_res)
    if not res_tm:
        x_res = x_res.contiguous()
    cir = x_res.shape[1]

    def step(channels: int) -> int:  # input channels per product step
        return min(SPLIT_OPTIONS["bk"], max(16, triton.next_power_of_2(channels)))

    _causal_conv_split_kernel[(b, triton.cdiv(t, bt), slices)](
        x,
        cache if cache is not None else x,
        taps,
        conv_bias.contiguous(),
        x_res,
        r_weight.contiguous(),
        r_bias.contiguous(),
        num_valid if num_valid is not None else x,
        h,
        r if r is not None else h,
        upd if upd is not None else h,
        co,
        t,
        CI=ci,
        CIR=cir,
        HAS_CACHE=cache is not None,
        HAS_RES=residual is not None,
        HAS_UPDATE=upd is not None,
        TIME_MAJOR=time_major,
        RES_TM=res_tm,
        IEEE=x.dtype == torch.float32,
        CTX=ctx,
        BCO=SPLIT_OPTIONS["bco"],
        BT=bt,
        BK=step(ci),
        BKR=step(cir),
        num_warps=SPLIT_OPTIONS["warps"],
        **pdl_args(),
    )
    if norm is None:
        return
    gamma, beta, eps = norm
    _norm_mish_finish_kernel[(b, triton.cdiv(t, bt))](
        h,
        r if r is not None else h,
        gamma.contiguous(),
        beta.contiguous(),
        add if add is not None else h,
        y,
        co,
        t,
        add.stride(0) if add is not None else 0,
        float(eps),
        HAS_ADD=add is not None,
        HAS_RES=residual is not None,
        TIME_MAJOR=time_major,
        BCO=triton.next_power_of_2(co),
        BT=bt,
        num_warps=8,
        **pdl_args(),
    )
