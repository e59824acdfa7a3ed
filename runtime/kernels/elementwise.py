"""Fused elementwise Triton kernels of one decoder layer.

Each kernel rounds exactly where the plain PyTorch layer rounds (runtime/layers.py), so on bf16 the
fused results equal the eager ones bit for bit:
- `add_rmsnorm`: residual add (rounded to the activation dtype), RMSNorm in float32, cast, times weight.
- `qk_norm_rope_store`: per-head q/k RMSNorm, rotate-half RoPE from a cos/sin table, q out, and the new
  K/V written straight into the paged cache at `slot_mapping` (slot < 0 = padding row, not written); into
  an FP8 cache as e4m3 codes and a scale per (row, KV head) (`fp8_quantize`, runtime/kv_cache.py).
- `silu_mul`: silu(gate) rounded, times up.
- `embed`: each row's embedding from the text or the audio table (a copy; never a sum).
Only imported when Triton is present (see runtime/kernels/__init__.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.launch import pdl_args, pdl_enter


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    y = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype)
    tl.store(out_ptr + row * n_cols + cols, out, mask=mask)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [N, C] -> (rmsnorm(x + residual) * weight [N, C], x + residual [N, C]).

    With `residual=None` the sum is x itself (first layer), returned as is.
    """
    assert x.is_contiguous() and x.dim() == 2
    n_rows, n_cols = x.shape
    out = torch.empty_like(x)
    block = triton.next_power_of_2(n_cols)
    warps = 8 if block >= 4096 else 4
    if residual is None:
        _add_rmsnorm_kernel[(n_rows,)](x, x, weight, out, x, n_cols, eps, HAS_RES=False, BLOCK=block,
                                       num_warps=warps, **pdl_args())
        return out, x
    assert residual.is_contiguous() and residual.shape == x.shape
    summed = torch.empty_like(x)
    _add_rmsnorm_kernel[(n_rows,)](x, residual, weight, out, summed, n_cols, eps, HAS_RES=True, BLOCK=block,
                                   num_warps=warps, **pdl_args())
    return out, summed


@triton.jit
def rms_rope(ptrs, partner_ptrs, mask, w, w_p, cos, sin, d, eps, HEAD_DIM: tl.constexpr):
    """Per-head RMSNorm then rotate-half RoPE of a [rows, D] tile of heads, rounded where the plain layers
    round. `ptrs` / `partner_ptrs` address each element and its rotation partner ((d + D/2) % D); w, w_p
    [rows or 1, D] the norm weight at d and at the partner; cos, sin [1, D] of the row's position.
    Returns (normed and rotated heads in the activation dtype, the raw heads as loaded)."""
    half: tl.constexpr = HEAD_DIM // 2
    x = tl.load(ptrs, mask=mask, other=0.0)
    x_p = tl.load(partner_ptrs, mask=mask, other=0.0).to(tl.float32)
    act_ty = x.dtype
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)[:, None]  # [rows, 1]
    y = (w.to(tl.float32) * (xf * rstd).to(act_ty).to(tl.float32)).to(act_ty)
    y_p = (w_p.to(tl.float32) * (x_p * rstd).to(act_ty).to(tl.float32)).to(act_ty).to(tl.float32)
    rot = tl.where((d < half)[None, :], -y_p, y_p)  # rotate_half(y)
    a = (y.to(tl.float32) * cos.to(tl.float32)).to(act_ty).to(tl.float32)
    b = (rot * sin.to(tl.float32)).to(act_ty).to(tl.float32)
    return (a + b).to(act_ty), x


@triton.jit
def fp8_quantize(x):
    """[rows, D] float32 -> (x / scale [rows, D], still float32: the caller's store rounds it to e4m3;
    scale [rows] = max|row| x (1 / 448), 0 for a zero row), as runtime/kv_cache.quantize_rows."""
    # the scale as max|row| times float32(1/448) and the codes by an IEEE division (`/` would be the
    # approximate div.full.f32), as quantize_rows computes them: the same bits
    scale = tl.max(tl.abs(x), axis=1) * (1.0 / 448.0)  # runtime.kv_cache.FP8_KV_MAX
    return tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0)[:, None]), scale


@triton.jit
def scale_offsets(slot, kvh, NUM_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Element offset of the scale of cache slot(s) `slot` and KV head(s) `kvh` in one layer's
    [num_blocks, KV, block_size] scales."""
    return (slot // BLOCK_SIZE) * (NUM_KV * BLOCK_SIZE) + kvh * BLOCK_SIZE + slot % BLOCK_SIZE


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    ks_ptr, vs_ptr, eps,
    NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr, QUANT: tl.constexpr = False, BLOCK_SIZE: tl.constexpr = 1,
):
    # one program = one row x HEADS_BLOCK of its H + 2KV heads, as a [HEADS_BLOCK, D] tile
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    h = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
    d = tl.arange(0, HEAD_DIM)
    partner = (d + half) % HEAD_DIM
    is_q = h < NUM_HEADS
    is_k = (h >= NUM_HEADS) & (h < NUM_HEADS + NUM_KV)
    is_v = (h >= NUM_HEADS + NUM_KV) & (h < NUM_HEADS + 2 * NUM_KV)
    valid = (h < NUM_HEADS + 2 * NUM_KV)[:, None]
    row_ptr = qkv_ptr + row * ((NUM_HEADS + 2 * NUM_KV) * HEAD_DIM) + h[:, None] * HEAD_DIM
    w = tl.where(is_q[:, None], tl.load(qw_ptr + d)[None, :], tl.load(kw_ptr + d)[None, :])
    w_p = tl.where(is_q[:, None], tl.load(qw_ptr + partner)[None, :], tl.load(kw_ptr + partner)[None, :])
    pos = tl.load(pos_ptr + row)
    cos = tl.load(cos_ptr + pos * HEAD_DIM + d)[None, :]
    sin = tl.load(sin_ptr + pos * HEAD_DIM + d)[None, :]
    out, x = rms_rope(row_ptr + d[None, :], row_ptr + partner[None, :], valid, w, w_p, cos, sin, d, eps, HEAD_DIM)
    tl.store(q_out_ptr + row * (NUM_HEADS * HEAD_DIM) + h[:, None] * HEAD_DIM + d[None, :], out,
             mask=is_q[:, None])
    slot = tl.load(slot_ptr + row)
    if slot >= 0:
        base = slot * (NUM_KV * HEAD_DIM) + d[None, :]
        k_val = out
        v_val = x
        if QUANT:  # e4m3 codes + one scale per (row, KV head)
            k_val, k_s = fp8_quantize(out.to(tl.float32))
            v_val, v_s = fp8_quantize(x.to(tl.float32))
            tl.store(ks_ptr + scale_offsets(slot, h - NUM_HEADS, NUM_KV, BLOCK_SIZE), k_s, mask=is_k)
            tl.store(vs_ptr + scale_offsets(slot, h - NUM_HEADS - NUM_KV, NUM_KV, BLOCK_SIZE), v_s, mask=is_v)
        tl.store(k_cache_ptr + base + (h[:, None] - NUM_HEADS) * HEAD_DIM,
                 k_val.to(k_cache_ptr.dtype.element_ty), mask=is_k[:, None])
        tl.store(v_cache_ptr + base + (h[:, None] - NUM_HEADS - NUM_KV) * HEAD_DIM,
                 v_val.to(v_cache_ptr.dtype.element_ty), mask=is_v[:, None])


def qk_norm_rope_store(
    qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos_table: torch.Tensor,
    sin_table: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, eps: float, *,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """qkv [N, (H + 2KV) * D] -> q [N, H, D] (normed, rotated); K/V of the rows stored into the
    layer's cache `k_cache`, `v_cache` ([num_blocks, block_size, KV, D]) at `slot_mapping` [N] (FP8 codes
    and their scales `k_scale`, `v_scale` [num_blocks, KV, block_size] when given)."""
    n_rows = qkv.shape[0]
    head_dim = q_norm.shape[0]
    assert qkv.is_contiguous() and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    q = torch.empty(n_rows, num_heads, head_dim, device=qkv.device, dtype=qkv.dtype)  # [N, H, D]
    # measured on the H200: one head per program is fastest for a few rows (2.2 us at 1 row vs 3.4 us with
    # 8 heads), 8 heads per program for many rows (prefill of 512: 5.8 us vs 16.8 us with one head)
    heads_block = 1 if n_rows <= 64 else 8
    grid = (n_rows, triton.cdiv(num_heads + 2 * num_kv_heads, heads_block))
    _qk_norm_rope_store_kernel[grid](
        qkv, q_norm, k_norm, cos_table, sin_table, positions, slot_mapping, q, k_cache, v_cache,
        *scale_args(k_scale, v_scale, k_cache), eps,
        NUM_HEADS=num_heads, NUM_KV=num_kv_heads, HEAD_DIM=head_dim, HEADS_BLOCK=heads_block,
        QUANT=k_scale is not None, BLOCK_SIZE=k_cache.shape[1], num_warps=1 if heads_block == 1 else 2,
        **pdl_args(),
    )
    return q


def scale_args(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
               stand_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale pointers of an FP8 cache (both or neither), else a stand-in the kernel never reads."""
    assert (k_scale is None) == (v_scale is None)
    if k_scale is None:
        return stand_in, stand_in
    assert k_scale.is_contiguous() and v_scale.is_contiguous() and k_scale.dtype == torch.float32
    return k_scale, v_scale


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * 2 * inter + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(out_ptr + row * inter + cols, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2I] (gate then up) -> silu(gate) * up [N, I]."""
    assert gate_up.is_contiguous()
    n_rows, two_inter = gate_up.shape
    inter = two_inter // 2
    out = torch.empty(n_rows, inter, device=gate_up.device, dtype=gate_up.dtype)
    block = 1024
    _silu_mul_kernel[(n_rows, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block, num_warps=4,
                                                            **pdl_args())
    return out


@triton.jit
def _embed_kernel(tok_ptr, audio_ptr, text_w_ptr, audio_w_ptr, out_ptr, HIDDEN: tl.constexpr,
                  BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    tok = tl.load(tok_ptr + row).to(tl.int64)
    is_audio = tl.load(audio_ptr + row) != 0
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    # both loads issued, one of them masked off: only the row's own table is read
    text = tl.load(text_w_ptr + tok * HIDDEN + cols, mask=mask & (not is_audio), other=0.0)
    audio = tl.load(audio_w_ptr + tok * HIDDEN + cols, mask=mask & is_audio, other=0.0)
    tl.store(out_ptr + row * HIDDEN + cols, tl.where(is_audio, audio, text), mask=mask)


def embed(tokens: torch.Tensor, is_audio: torch.Tensor, text_table: torch.Tensor,
          audio_table: torch.Tensor) -> torch.Tensor:
    """tokens [N], is_audio [N] bool -> [N, hidden]: the audio table's row for audio rows, the text table's
    otherwise (one launch instead of the reference's two gathers, three selects and a fill)."""
    assert tokens.is_contiguous() and is_audio.is_contiguous()
    assert text_table.is_contiguous() and audio_table.is_contiguous()
    hidden = text_table.shape[1]
    out = torch.empty(tokens.shape[0], hidden, device=tokens.device, dtype=text_table.dtype)
    block = triton.next_power_of_2(hidden)
    _embed_kernel[(tokens.shape[0],)](tokens, is_audio, text_table, audio_table, out, HIDDEN=hidden,
                                      BLOCK=block, num_warps=4, **pdl_args())
    return out

