"""Attention over the paged KV cache without gathering pages into contiguous copies (Triton).

- `paged_decode_attention`: one query row per sequence. A program owns one (sequence, KV head, key
  partition) and all GQA query heads of that KV head (padded to 16 rows for the tensor cores); keys are
  addressed through the block table token by token. With several partitions (small batches, where
  sequences x KV heads would leave most SMs idle) a second kernel merges the partial softmaxes.
- `paged_decode_attention_rope`: the same kernel reading the QKV projection instead of q: it applies the
  q/k RMSNorm and RoPE itself and stores the new row's K/V (one launch per layer fewer than
  `qk_norm_rope_store` + `paged_decode_attention`).
- `paged_prefill_attention`: flash-style causal attention of each sequence's new rows over its earlier
  pages and itself (chunked prefill included): program = (query tile, sequence, query head).
Cache layout per layer: [num_blocks, block_size, KV, D]; slot = block_id * block_size + offset. An FP8
cache (runtime/kv_cache.py) holds e4m3 codes with a float32 scale per (slot, KV head) in `k_scale`, `v_scale`
[num_blocks, KV, block_size]: each key's score is its codes' dot product times its scale, and each value's
softmax weight is multiplied by its scale before the weighted sum; stored rows are quantized as they are
written.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from runtime.kernels import pdl_mode
from runtime.kernels.elementwise import fp8_quantize, rms_rope, scale_args, scale_offsets
from runtime.kernels.launch import l2_prefetch_once, pdl_args, pdl_enter


def _dot_precision(q: torch.Tensor) -> str:
    """float32 inputs multiply in full precision (checks against float32 references), not TF32."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_acc_ptr, part_ml_ptr, tables_ptr, seq_lens_ptr, scale, max_blocks,
    qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, eps, ks_ptr, vs_ptr,
    BLOCK_SIZE: tl.constexpr, NUM_KV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PART: tl.constexpr, NUM_PARTS: tl.constexpr,
    DOT_PREC: tl.constexpr, FUSE_ROPE: tl.constexpr, STORE_ONLY: tl.constexpr, USE_PDL: tl.constexpr,
    KV_FIRST: tl.constexpr = False, HEAD_MAJOR: tl.constexpr = False, QUANT: tl.constexpr = False,
    F16_DOT: tl.constexpr = False, L2_KV: tl.constexpr = False,
):
    if not L2_KV:
        pdl_enter(USE_PDL)
    if KV_FIRST:  # grid (KV heads, sequences, partitions): a sequence's KV heads are launched side by side
        kvh = tl.program_id(0)
        seq = tl.program_id(1).to(tl.int64)
    else:
        seq = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
    part = tl.program_id(2)
    # cache element offsets: [blocks, block_size, KV, D] (HEAD_MAJOR: [blocks, KV, block_size, D])
    TOK_STRIDE: tl.constexpr = HEAD_DIM if HEAD_MAJOR else NUM_KV * HEAD_DIM
    HEAD_STRIDE: tl.constexpr = BLOCK_SIZE * HEAD_DIM if HEAD_MAJOR else HEAD_DIM
    seq_len = tl.load(seq_lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    gmask = g < GROUP
    heads = kvh * GROUP + g  # [GP]
    if PART > 0:  # partitions of the block table's span (the keys past seq_len leave the last ones empty)
        part_len = PART
    else:  # the sequence's own keys spread over the partitions, in whole key tiles
        part_len = tl.cdiv(tl.cdiv(seq_len, NUM_PARTS), BLOCK_N) * BLOCK_N
    start = part * part_len
    end = tl.minimum(seq_len, start + part_len)
    if STORE_ONLY:  # the row's K/V store alone (FUSE_ROPE): no keys are read, nothing is written to out
        end = start
    if L2_KV:
        # the partition's first key's K and V rows asked into L2 before the PDL wait (OPTIONS["l2_kv"]): the
        # lengths and block tables are the step's inputs, and every key but the new one is from earlier steps
        has_keys = start < end
        blk0 = tl.load(tables_ptr + seq * max_blocks + start // BLOCK_SIZE, mask=has_keys, other=0).to(tl.int64)
        off0 = blk0 * (BLOCK_SIZE * NUM_KV * HEAD_DIM) + (start % BLOCK_SIZE) * TOK_STRIDE + kvh * HEAD_STRIDE
        row_bytes = tl.where(has_keys, HEAD_DIM * (k_ptr.dtype.element_ty.primitive_bitwidth // 8), 0).to(tl.int32)
        l2_prefetch_once(k_ptr + off0, row_bytes)
        l2_prefetch_once(v_ptr + off0, row_bytes)
        pdl_enter(USE_PDL)
    if FUSE_ROPE:
        # q/k RMSNorm + RoPE from the QKV projection's row (as `qk_norm_rope_store`): every partition
        # rotates its own query heads; the one holding the new key (position seq_len - 1) also stores the
        # row's K/V for this KV head, waits for its stores, and reads them back through the cache like any
        # other key. (Scoring the new key from registers instead, without the wait, was slower on the H200.)
        num_heads: tl.constexpr = NUM_KV * GROUP
        partner = (d + HEAD_DIM // 2) % HEAD_DIM
        row_ptr = qkv_ptr + seq * ((num_heads + 2 * NUM_KV) * HEAD_DIM)
        pos = tl.load(pos_ptr + seq)
        cos = tl.load(cos_ptr + pos * HEAD_DIM + d)[None, :]
        sin = tl.load(sin_ptr + pos * HEAD_DIM + d)[None, :]
        q_rows = row_ptr + heads[:, None] * HEAD_DIM
        q, _q_raw = rms_rope(q_rows + d[None, :], q_rows + partner[None, :], gmask[:, None],
                             tl.load(qw_ptr + d)[None, :], tl.load(qw_ptr + partner)[None, :], cos, sin, d, eps,
                             HEAD_DIM)  # [GP, D]
        if (seq_len - 1 >= start) & (seq_len - 1 < start + part_len):
            slot = tl.load(slot_ptr + seq).to(tl.int64)
            if slot >= 0:
                k_row = row_ptr + (num_heads + kvh) * HEAD_DIM
                k_new, _k_raw = rms_rope(
                    (k_row + d)[None, :], (k_row + partner)[None, :], d[None, :] < HEAD_DIM,
                    tl.load(kw_ptr + d)[None, :], tl.load(kw_ptr + partner)[None, :], cos, sin, d, eps, HEAD_DIM,
                )  # [1, D]
                v_new = tl.load(row_ptr + (num_heads + NUM_KV + kvh) * HEAD_DIM + d)[None, :]  # [1, D]
                new_off = ((slot // BLOCK_SIZE) * (BLOCK_SIZE * NUM_KV * HEAD_DIM) + (slot % BLOCK_SIZE) * TOK_STRIDE
                           + kvh * HEAD_STRIDE + d)[None, :]
                if QUANT:  # e4m3 codes + the row's scale for this KV head
                    k_new, k_s = fp8_quantize(k_new.to(tl.float32))
                    v_new, v_s = fp8_quantize(v_new.to(tl.float32))
                    s_off = scale_offsets(slot, kvh, NUM_KV, BLOCK_SIZE) + tl.arange(0, 1)
                    tl.store(ks_ptr + s_off, k_s)
                    tl.store(vs_ptr + s_off, v_s)
                tl.store(k_ptr + new_off, k_new.to(k_ptr.dtype.element_ty))
                tl.store(v_ptr + new_off, v_new.to(v_ptr.dtype.element_ty))
            tl.debug_barrier()  # the loop reads them back, stored by other threads of this program
    else:
        q = tl.load(q_ptr + seq * (NUM_KV * GROUP * HEAD_DIM) + heads[:, None] * HEAD_DIM + d[None, :],
                    mask=gmask[:, None], other=0.0)  # [GP, D]
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp2 domain
    q_dot = q
    if F16_DOT:  # FP8 codes widen to float16 exactly (one instruction per pair): both products in float16
        q_dot = q.to(tl.float16)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < end
        blk = tl.load(tables_ptr + seq * max_blocks + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        tok = blk * (BLOCK_SIZE * NUM_KV * HEAD_DIM) + (n % BLOCK_SIZE) * TOK_STRIDE  # [BN]
        kv_off = tok[:, None] + kvh * HEAD_STRIDE + d[None, :]  # [BN, D]
        k = tl.load(k_ptr + kv_off, mask=nmask[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=nmask[:, None], other=0.0)
        s = tl.dot(q_dot, tl.trans(k.to(q_dot.dtype)), input_precision=DOT_PREC) * qk_scale  # [GP, BN]
        if QUANT:
            s_off = scale_offsets(blk * BLOCK_SIZE + n % BLOCK_SIZE, kvh, NUM_KV, BLOCK_SIZE)
            k_s = tl.load(ks_ptr + s_off, mask=nmask, other=0.0)
            v_s = tl.load(vs_ptr + s_off, mask=nmask, other=0.0)
            s = s * k_s[None, :]
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if F16_DOT:
            # p x the values' scales relative to the tile's largest (float16 keeps small scales out of its
            # subnormals), the tile's sum scaled back in float32
            v_top = tl.max(v_s, axis=0)
            v_top = tl.where(v_top > 0, v_top, 1.0)
            pv = tl.dot((p * (v_s * (1.0 / v_top))[None, :]).to(tl.float16), v.to(tl.float16))
            acc = acc * alpha[:, None] + pv * v_top
        else:
            p_v = p * v_s[None, :] if QUANT else p
            acc = acc * alpha[:, None] + tl.dot(p_v.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
        m_i = m_new
    if STORE_ONLY:
        pass
    elif NUM_PARTS == 1:
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
# From SPLIT_BELOW to here keys are split in 2 (the fused RoPE kept, runtime/fast_forward.py): 16 sequences x
# 512 keys 16.0 against 21.2 us, 24 x 512 22.0 against 25.8 us; at 32 a tie, at 48 slower (2 or 4 partitions;
# bench/results/decode-attention-tune-h200/tune-split-h200.json).
SPLIT_TWO_BELOW = 256
# Measured choices a benchmark can switch while it captures (bench/decode_ab.py): "split_two" (above);
# "dynamic_parts": split keys spread each sequence's own context over its partitions, in whole key tiles
# (False, the kernel before the twenty-ninth session: the partitions cut the block table's span, which in a
# graph is max_model_len wide, so a shorter context left the last partitions empty and unbalanced the
# first: 2 partitions of a 1024-key table over 513 keys held 512 and 1). Interleaved in the captured whole
# step, 512-token context (bench/results/decode-partitions-h200/): with a 4096-key table (serving's
# max_model_len) 1 stream FP8 2.736 -> 2.688 ms, bf16 4.503 -> 4.442, 4 streams 5.437 -> 5.212, 8 streams
# 5.981 -> 5.456, 16 streams 5.671 -> 5.434, 24 streams 5.848 -> 5.653; with a 1024-key table 1-8 streams
# within 1.5% (faster or even), 16 / 24 streams 5.583 -> 5.417 / 5.754 -> 5.627.
# "max_parts": at most this many partitions per sequence: with dynamic partitions the table's width no longer
# spreads the keys, so more partitions only add empty programs and a longer merge (1 stream, 513 keys:
# 16 partitions FP8 2.648 / bf16 4.385 ms in a 1024-key table against 64 partitions 2.688 / 4.442 in a
# 4096-key one; 8 partitions lost at 4 streams, 5.392 against 5.195 ms). None: no cap.
# "split_two_below": programs under which keys split in 2.
# "launch": (key tile, warps, stages) for every grid whose keys are not split, in place of `decode_launch`'s
# choice (None: its choice).
# "l2_kv": under PDL with more than 2 key partitions, each program asks L2 for its first key's K and V rows
# before its wait (runtime/kernels/launch.py `l2_prefetch_once`). The captured one-stream FP8 step,
# 4096-key table: 2.613 ms against 2.631 / 2.628 without, and 2.588 / 2.595 with the GEMV's prefetch too
# against 2.601 / 2.602 with that alone; 8 streams bf16 5.505 / 5.477 against 5.531 / 5.523 (both
# prefetches' defaults on and off). Asking for the whole first key tile instead (one prefetch per key row)
# was slower: 2.666 against 2.625 (576-key table) and 2.650 against 2.603-2.606
# (bench/results/l2-prefetch-before-wait-h200/ runs 1 and 3). Above a few streams it does not pay
# (L2_KV_BELOW_BATCH; this prefetch alone on and off, 3 copies each, run 7): FP8 weights, 2 streams 3.011 /
# 3.010 / 3.013 against 3.013 / 3.018 / 3.021 ms, 4 streams 4.450 / 4.443 / 4.458 against 4.452 / 4.478 /
# 4.662, 8 streams 4.837 / 4.866 / 4.829 against 4.795 / 4.797 / 4.800 (slower in 4 of the 5 pairs of runs 5
# and 7); bf16 weights, 8 streams 5.507 / 5.510 / 5.505 against 5.511 / 5.521 / 5.502 (run 5: 5.505 / 5.477
# against 5.531 / 5.523); 16 streams (2 partitions) 0.1-0.4% slower in run 5.
# "fp8_mid": an FP8 cache's launches at 16-64 streams (FP8_SPLIT_TWO_PROGRAMS, FP8_WIDE_PROGRAMS below).
L2_KV_BELOW_BATCH = 8
OPTIONS: dict[str, bool | int | tuple[int, int, int] | None] = {
    "split_two": True, "max_parts": 16, "dynamic_parts": True, "split_two_below": SPLIT_TWO_BELOW, "launch": None,
    "l2_kv": True, "fp8_mid": True,
}
# For these grids (sequences x KV heads, keys not split) one-warp programs over 32-key tiles in 2 stages
# stream the cache faster than 4 warps over 64 keys: 96 sequences x 512 keys 53.1 against 69.8 us, 128 x 512
# 68.2 against 77.0 us, 128 x 2048 245 against 258 us, 256 x 512 133.7 against 146.8 us. Outside them they
# lose or tie (how many programs fit an SM decides; waves): 160 x 512 98.2 against 91.1, 192 x 512 116.9
# against 113.5, 64 x 512 39.5 against 40.1 (64 x 2048 3% slower), 48 and fewer slower
# (bench/results/decode-attention-tune-h200/). The same tile in 3 stages times the same but hangs the GPU
# (Triton 3.6 on the H200) when the q/k RoPE is fused and a sequence has at most 32 keys (one loop trip),
# e.g. a padding row: bench/decode_attention_lengths.py.
NARROW_PROGRAMS = ((768, 1024), (2048, 2048))  # inclusive ranges of sequences x KV heads
NARROW_LAUNCH = (32, 1, 2)  # key tile, warps, stages
# An FP8 cache (Hopper): the codes are widened to float16 in registers after a byte-wise shared-memory read,
# so the kernel is bound by instructions more than by bytes, and more, narrower programs win at every unsplit
# grid (bench/results/kv-fp8-h200/kv-fp8.json "attention_sweep", us per call, bf16 cache's default beside):
# 64 x 512 keys 43.7 against 56.1 with 4 warps (bf16 39.9), 128 x 512 59.2 (bf16 67.3), 64 x 2048 147.7
# (bf16 127.3; 128-key tiles in 4 warps 133.8 there but 88.4 at 128 x 512); split keys at 1 sequence 64-key
# tiles in 4 warps, 1 stage: 7.6 us (bf16 6.6).
FP8_LAUNCH, FP8_SPLIT_LAUNCH = (32, 1, 2), (64, 4, 1)
# An FP8 cache (Hopper) between 48 and 64 sequences x 8 KV heads: the one-warp programs above are bound by
# their own instruction latency with only ~4 of them on an SM, so keys split in 2 (twice the programs, half
# the keys each, FP8_LAUNCH, the q/k RoPE still fused) beat the unsplit grid with its merge kernel included
# (us per call, bench/results/kv-fp8-split-h200/): 48 x 512 keys 33.6 against 40.8, 64 x 512 36.7 against
# 43.7, 64 x 1024 63.3 against 76.9, 64 x 2048 118.1 against 134.5. At 32 sequences (27.8 against 25.1) and
# at 96-128 (65.1-71.4 against 52.5-59.7) it loses. OPTIONS["fp8_mid"] turns this and FP8_WIDE off.
FP8_SPLIT_TWO_PROGRAMS = ((384, 512),)  # inclusive ranges of sequences x KV heads
# ... and 4-warp programs over 128-key tiles (FP8_WIDE_LAUNCH) at 32 sequences x 8 KV heads over unsplit keys
# (32 x 512: 25.1 against 38.2 us with FP8_LAUNCH; they lose at 48 sequences, 44.1 against 40.8) and at 16
# with keys split in 2 (16 x 512: 17.5 against 22.0 with FP8_SPLIT_LAUNCH): FP8_WIDE_PROGRAMS by partitions.
FP8_WIDE_PROGRAMS = {1: ((256, 256),), 2: ((128, 128),)}
FP8_WIDE_LAUNCH = (128, 4, 2)


def _in(programs: int, ranges: tuple[tuple[int, int], ...]) -> bool:
    return any(lo <= programs <= hi for lo, hi in ranges)


def decode_num_parts(batch: int, num_kv_heads: int, max_context: int, *, fp8: bool = False,
                     device: torch.device | str | None = None) -> int:
    """Key partitions per sequence (a power of 2): 1 once batch x KV heads fill the SMs, 2 just below that
    (SPLIT_TWO_BELOW), else enough partitions for ~TARGET_PROGRAMS programs, none shorter than one key tile.
    `fp8`: the cache holds FP8 codes; on a Hopper `device` it is also split in 2 at FP8_SPLIT_TWO_PROGRAMS."""
    programs = batch * num_kv_heads
    most = max(1, math.ceil(max_context / BLOCK_N_DECODE))
    if OPTIONS["max_parts"] is not None:
        most = min(most, int(OPTIONS["max_parts"]))
    if (fp8 and OPTIONS["fp8_mid"] and device is not None and _is_hopper(torch.device(device))
            and _in(programs, FP8_SPLIT_TWO_PROGRAMS) and most >= 2):
        return 2
    if programs >= SPLIT_BELOW:
        return 2 if OPTIONS["split_two"] and programs < int(OPTIONS["split_two_below"]) and most >= 2 else 1
    wanted = max(1, math.ceil(TARGET_PROGRAMS / programs))
    return triton.next_power_of_2(min(wanted, most))


def decode_launch(batch: int, num_kv_heads: int, num_parts: int, narrow: bool = True,
                  fp8: bool = False) -> tuple[int, int, int]:
    """(key tile, warps, stages) of the decode kernel for this grid (measured choices; see NARROW_PROGRAMS and
    FP8_LAUNCH). `narrow`: the narrow launches may be used (Hopper, where they were measured and checked);
    `fp8`: the cache holds FP8 codes."""
    programs = batch * num_kv_heads
    if num_parts == 1 and OPTIONS["launch"] is not None:
        return OPTIONS["launch"]
    if narrow and fp8:
        if OPTIONS["fp8_mid"] and _in(programs, FP8_WIDE_PROGRAMS.get(num_parts, ())):
            return FP8_WIDE_LAUNCH
        if OPTIONS["fp8_mid"] and num_parts == 2 and _in(programs, FP8_SPLIT_TWO_PROGRAMS):
            return FP8_LAUNCH
        return FP8_LAUNCH if num_parts == 1 else FP8_SPLIT_LAUNCH
    if narrow and num_parts == 1 and _in(programs, NARROW_PROGRAMS):
        return NARROW_LAUNCH
    # 3 stages help split keys at 1 sequence (bench/fast_tools.py's sweep)
    return BLOCK_N_DECODE, 4, 3 if num_parts > 1 else 2


@functools.cache
def _is_hopper(device: torch.device) -> bool:
    """Compute capability 9.x: the narrow launch was measured (and its loop-trip check run) only there."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def l2_kv_launch(num_parts: int, batch: int) -> bool:
    """L2_KV for a decode launch of `batch` sequences: OPTIONS["l2_kv"], under PDL (the prefetch is there to
    run before the wait; PDL also implies Hopper, which it needs), with more than 2 key partitions and fewer
    than L2_KV_BELOW_BATCH sequences (see OPTIONS' note: faster or even at 1, 2 and 4 streams; at 8 slower
    with FP8 weights, even with bf16; at 16 slower). `batch` is the launch's rows: a captured step's bucket,
    so 5-7 streams (the 8-row graph) go without it."""
    return (bool(OPTIONS["l2_kv"]) and num_parts > 2 and batch < L2_KV_BELOW_BATCH
            and pdl_mode() != "off")


def _part_len(max_context: int, num_parts: int, block_n: int) -> int:
    """Keys per partition: a multiple of the key tile, num_parts of them cover max_context."""
    per = math.ceil(max_context / num_parts)
    return math.ceil(per / block_n) * block_n


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, num_parts: int = 1, *, block_n: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, kv_first: bool = False, head_major: bool = False,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, D] (one row per sequence) over the layer's paged cache -> [B, H, D].

    block_tables [B, max_blocks] int32, seq_lens [B] int32 (>= 1; context including the new row).
    The keys a block table can address are split into `num_parts` equal partitions (see
    `decode_num_parts`); with more than one, a second kernel merges the partial softmaxes.
    Launch options (measured by bench/decode_attention_tune.py): key tile `block_n`, `num_warps`,
    `num_stages` (None: `decode_launch`'s choice); `kv_first` launches a sequence's KV-head programs side by
    side; `head_major`: the caches are [num_blocks, KV, block_size, D] instead of [num_blocks, block_size,
    KV, D]. `k_scale`, `v_scale` [num_blocks, KV, block_size]: the caches hold FP8 codes (module docstring).
    """
    # the kernel addresses q's rows as [B, H * D] back to back (a slice of the QKV rows would be read wrongly)
    assert q.is_contiguous(), "q must be contiguous"
    return _decode(q, None, q.shape[1], k_cache, v_cache, block_tables, seq_lens, num_parts, block_n=block_n,
                   num_warps=num_warps, num_stages=num_stages, kv_first=kv_first, head_major=head_major,
                   k_scale=k_scale, v_scale=v_scale)


def paged_decode_attention_rope(
    qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos_table: torch.Tensor,
    sin_table: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, num_parts: int, num_heads: int,
    eps: float, *, store_only: bool = False, **launch,
) -> torch.Tensor | None:
    """`qk_norm_rope_store` and `paged_decode_attention` in one kernel: qkv [B, (H + 2KV) * D] (the QKV
    projection of one new row per sequence, at positions [B] = seq_lens - 1) -> attention output [B, H, D];
    the rows' K/V are stored at slot_mapping [B] (slot < 0: not stored) as `qk_norm_rope_store` stores them.
    `store_only`: the same kernel stores the K/V (bit-equal to what the whole kernel stores), attends to
    nothing and returns None. `launch`: the launch options of `paged_decode_attention` (benchmarks) and an FP8
    cache's `k_scale`, `v_scale`."""
    assert qkv.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    rope = (qkv, q_norm, k_norm, cos_table, sin_table, positions, slot_mapping, float(eps))
    out = _decode(None, rope, num_heads, k_cache, v_cache, block_tables, seq_lens, num_parts, store_only=store_only,
                  **launch)
    return None if store_only else out


def _decode(
    q: torch.Tensor | None, rope: tuple | None, num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_parts: int, *, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None, store_only: bool = False, kv_first: bool = False,
    head_major: bool = False, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the decode kernel on q [B, H, D], or (`rope`) on the QKV rows it normalises and rotates."""
    src = q if q is not None else rope[0]
    batch = src.shape[0]
    if head_major:
        _, num_kv, block_size, head_dim = k_cache.shape
    else:
        _, block_size, num_kv, head_dim = k_cache.shape
    group = num_heads // num_kv
    out = torch.empty(batch, num_heads, head_dim, device=src.device, dtype=src.dtype)
    scale = 1.0 / math.sqrt(head_dim)
    chosen = decode_launch(batch, num_kv, num_parts, narrow=_is_hopper(src.device), fp8=k_scale is not None)
    block_n = chosen[0] if block_n is None else block_n
    num_warps = chosen[1] if num_warps is None else num_warps
    num_stages = chosen[2] if num_stages is None else num_stages
    # PART 0: each sequence's partitions split its own keys (OPTIONS["dynamic_parts"]), else the table's span
    dynamic = OPTIONS["dynamic_parts"] and num_parts > 1
    part = 0 if dynamic else _part_len(block_tables.shape[1] * block_size, num_parts, block_n)
    if num_parts > 1:
        part_acc = torch.empty(batch * num_heads * num_parts, head_dim, device=src.device, dtype=torch.float32)
        part_ml = torch.empty(batch * num_heads * num_parts, 2, device=src.device, dtype=torch.float32)
    else:
        part_acc = part_ml = out
    # without `rope` its pointers are unused: any tensor stands in
    qkv, q_norm, k_norm, cos, sin, positions, slots, eps = rope if rope is not None else (src,) * 7 + (0.0,)
    _decode_kernel[(num_kv, batch, num_parts) if kv_first else (batch, num_kv, num_parts)](
        src, k_cache, v_cache, out, part_acc, part_ml, block_tables, seq_lens, scale, block_tables.shape[1],
        qkv, q_norm, k_norm, cos, sin, positions, slots, eps, *scale_args(k_scale, v_scale, k_cache),
        BLOCK_SIZE=block_size, NUM_KV=num_kv, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_N=block_n, PART=part, NUM_PARTS=num_parts, DOT_PREC=_dot_precision(src),
        FUSE_ROPE=rope is not None, STORE_ONLY=store_only, KV_FIRST=kv_first, HEAD_MAJOR=head_major,
        QUANT=k_scale is not None, F16_DOT=k_scale is not None and src.dtype != torch.float32, num_warps=num_warps, num_stages=num_stages,
        L2_KV=l2_kv_launch(num_parts, batch), **pdl_args(),
    )
    if num_parts > 1 and not store_only:
        _decode_reduce_kernel[(batch * num_heads,)](part_acc, part_ml, out, NUM_PARTS=num_parts,
                                                     HEAD_DIM=head_dim, num_warps=2, **pdl_args())
    return out


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr, query_start_ptr, scale, max_blocks, ks_ptr, vs_ptr,
    BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, QUANT: tl.constexpr = False,
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
            if QUANT:
                s_off = scale_offsets(slot, kvh, NUM_KV, BLOCK_SIZE)
                k_s = tl.load(ks_ptr + s_off, mask=nmask, other=0.0)
                v_s = tl.load(vs_ptr + s_off, mask=nmask, other=0.0)
                s = s * k_s[None, :]
            allowed = nmask[None, :] & (n[None, :] <= q_pos[:, None])
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            p_v = p * v_s[None, :] if QUANT else p
            acc = acc * alpha[:, None] + tl.dot(p_v.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=mmask[:, None])


def paged_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start: torch.Tensor, max_query_len: int, *,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [N, H, D] (rows grouped by sequence; sequence s owns rows query_start[s]:query_start[s+1]) ->
    [N, H, D], causal over each sequence's earlier pages and its new rows (their K/V already stored; FP8
    codes where `k_scale`, `v_scale` are given)."""
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q)
    block_m = 64
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start, 1.0 / math.sqrt(head_dim),
        block_tables.shape[1], *scale_args(k_scale, v_scale, k_cache), BLOCK_SIZE=block_size,
        NUM_HEADS=num_heads, NUM_KV=num_kv, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=64,
        DOT_PREC=_dot_precision(q), QUANT=k_scale is not None, num_warps=4, num_stages=2,
    )
    return out
