"""Attention over the paged KV cache without gathering pages into contiguous copies (Triton).

- `paged_decode_attention`: one query row per sequence. A program owns one (sequence, KV head, key
  partition) and all GQA query heads of that KV head (padded to 16 rows for the tensor cores); keys are
  addressed through the block table token by token. With several partitions (small batches, where
  sequences x KV heads would leave most SMs idle) a second kernel merges the partial softmaxes.
- `paged_prefill_attention`: flash-style causal attention of each sequence's new rows over its earlier
  pages and itself (chunked prefill included): program = (query tile, sequence, query head).
Cache layout per layer: [num_blocks, block_size, KV, D]; slot = block_id * block_size + offset.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from runtime.kernels.launch import pdl_args, pdl_enter


def _dot_precision(q: torch.Tensor) -> str:
    """float32 inputs multiply in full precision (checks against float32 references), not TF32."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr, tables_ptr, seq_lens_ptr, scale, max_blocks,
    BLOCK_SIZE: tl.constexpr, NUM_KV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PART: tl.constexpr, NUM_PARTS: tl.constexpr,
    DOT_PREC: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    gmask = g < GROUP
    heads = kvh * GROUP + g  # [GP]
    q = tl.load(q_ptr + seq * (NUM_KV * GROUP * HEAD_DIM) + heads[:, None] * HEAD_DIM + d[None, :],
                mask=gmask[:, None], other=0.0)  # [GP, D]
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    start = part * PART
    end = tl.minimum(seq_len, start + PART)
    qk_scale = scale * 1.4426950408889634  # exp2 domain
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
        blk = tl.load(tables_ptr + seq * max_blocks + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        slot = blk * BLOCK_SIZE + n % BLOCK_SIZE  # [BN]
        kv_off = slot[:, None] * (NUM_KV * HEAD_DIM) + kvh * HEAD_DIM + d[None, :]  # [BN, D]
        k = tl.load(k_ptr + kv_off, mask=nmask[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=nmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC) * qk_scale  # [GP, BN]
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
        m_i = m_new
    if NUM_PARTS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + seq * (NUM_KV * GROUP * HEAD_DIM) + heads[:, None] * HEAD_DIM + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        # partials: acc [S, H, P, D] (unnormalised), ml [S, H, P, 2] = (max in exp2 domain, sum)
        row = (seq * (NUM_KV * GROUP) + heads) * NUM_PARTS + part  # [GP]
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=gmask[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=gmask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=gmask)


@triton.jit
def _decode_reduce_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, NUM_PARTS: tl.constexpr, HEAD_DIM: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)  # seq * H + head
    p = tl.arange(0, NUM_PARTS)
    d = tl.arange(0, HEAD_DIM)
    m = tl.load(part_ml_ptr + (row * NUM_PARTS + p) * 2)  # [P]; -inf for empty partitions
    l = tl.load(part_ml_ptr + (row * NUM_PARTS + p) * 2 + 1)  # [P]
    m_max = tl.max(m, axis=0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))  # [P]
    acc = tl.load(part_acc_ptr + (row * NUM_PARTS + p)[:, None] * HEAD_DIM + d[None, :])  # [P, D]
    num = tl.sum(acc * w[:, None], axis=0)
    den = tl.sum(l * w, axis=0)
    tl.store(out_ptr + row * HEAD_DIM + d, (num / den).to(out_ptr.dtype.element_ty))


BLOCK_N_DECODE = 64
SPLIT_BELOW = 128  # sequences x KV heads under which keys are split (measured: splitting at 32 x 8 or
# 64 x 8 programs cost more in partial writes + merge than it gained)
TARGET_PROGRAMS = 512


def decode_num_parts(batch: int, num_kv_heads: int, max_context: int) -> int:
    """Key partitions per sequence (a power of 2): 1 once batch x KV heads fill the SMs, else enough
    partitions for ~TARGET_PROGRAMS programs, none shorter than one key tile."""
    if batch * num_kv_heads >= SPLIT_BELOW:
        return 1
    wanted = max(1, math.ceil(TARGET_PROGRAMS / (batch * num_kv_heads)))
    most = max(1, math.ceil(max_context / BLOCK_N_DECODE))
    return triton.next_power_of_2(min(wanted, most))


def _part_len(max_context: int, num_parts: int, block_n: int) -> int:
    """Keys per partition: a multiple of the key tile, num_parts of them cover max_context."""
    per = math.ceil(max_context / num_parts)
    return math.ceil(per / block_n) * block_n


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, num_parts: int = 1, *, block_n: int = BLOCK_N_DECODE, num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """q [B, H, D] (one row per sequence) over the layer's paged cache -> [B, H, D].

    block_tables [B, max_blocks] int32, seq_lens [B] int32 (>= 1; context including the new row).
    The keys a block table can address are split into `num_parts` equal partitions (see
    `decode_num_parts`); with more than one, a second kernel merges the partial softmaxes.
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv, _ = k_cache.shape
    group = num_heads // num_kv
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(head_dim)
    part = _part_len(block_tables.shape[1] * block_size, num_parts, block_n)
    if num_stages is None:  # measured (bench/fast_tools.py sweep): 3 stages help split keys at 1 sequence
        num_stages = 3 if num_parts > 1 else 2
    if num_parts > 1:
        part_acc = torch.empty(batch * num_heads * num_parts, head_dim, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(batch * num_heads * num_parts, 2, device=q.device, dtype=torch.float32)
    else:
        part_acc = part_ml = out
    _decode_kernel[(batch, num_kv, num_parts)](
        q, k_cache, v_cache, out, part_acc, part_ml, block_tables, seq_lens, scale, block_tables.shape[1],
        BLOCK_SIZE=block_size, NUM_KV=num_kv, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_N=block_n, PART=part, NUM_PARTS=num_parts, DOT_PREC=_dot_precision(q),
        num_warps=num_warps, num_stages=num_stages, **pdl_args(),
    )
    if num_parts > 1:
        _decode_reduce_kernel[(batch * num_heads,)](part_acc, part_ml, out, NUM_PARTS=num_parts,
                                                     HEAD_DIM=head_dim, num_warps=2, **pdl_args())
    return out


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr, query_start_ptr, scale, max_blocks,
    BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx = seq_len - q_len
        kvh = head // (NUM_HEADS // NUM_KV)
        m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = m < q_len
        d = tl.arange(0, HEAD_DIM)
        q_rows = (q_start + m).to(tl.int64)
        q_off = q_rows[:, None] * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM + d[None, :]
        q = tl.load(q_ptr + q_off, mask=mmask[:, None], other=0.0)  # [BM, D]
        q_pos = ctx + m  # [BM]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        qk_scale = scale * 1.4426950408889634
        end = tl.minimum(seq_len, ctx + (tile + 1) * BLOCK_M)
        for n0 in range(0, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < end
            blk = tl.load(tables_ptr + seq * max_blocks + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
            slot = blk * BLOCK_SIZE + n % BLOCK_SIZE
            kv_off = slot[:, None] * (NUM_KV * HEAD_DIM) + kvh * HEAD_DIM + d[None, :]
            k = tl.load(k_ptr + kv_off, mask=nmask[:, None], other=0.0)
            v = tl.load(v_ptr + kv_off, mask=nmask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC) * qk_scale  # [BM, BN]
            allowed = nmask[None, :] & (n[None, :] <= q_pos[:, None])
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=mmask[:, None])


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start: torch.Tensor, max_query_len: int,
) -> torch.Tensor:
    """q [N, H, D] (rows grouped by sequence; sequence s owns rows query_start[s]:query_start[s+1]) ->
    [N, H, D], causal over each sequence's earlier pages and its new rows (their K/V already stored)."""
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q)
    block_m = 64
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start, 1.0 / math.sqrt(head_dim),
        block_tables.shape[1], BLOCK_SIZE=block_size, NUM_HEADS=num_heads, NUM_KV=num_kv, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=64, DOT_PREC=_dot_precision(q), num_warps=4, num_stages=2,
    )
    return out
