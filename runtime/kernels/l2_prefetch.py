"""Asynchronous L2 prefetch of a byte range (Hopper+), for decode steps whose memory bus idles.

A one-stream decode step reads every weight once, and between the big matrix products it runs small
kernels (RoPE + KV store, the paged attention and its merge) during which DRAM is nearly idle. A kernel
from this module, launched on a side branch of the step's graph, asks the memory system to bring the
next matrix (or its first rows) into L2 meanwhile, so the product that follows reads part of its weights
from L2. The kernel only issues requests: it takes a handful of SM slots for a few microseconds and
changes no value (prefetch is a performance hint; results are bit-identical with and without).

Modes:
- "bulk": `cp.async.bulk.prefetch.L2.global [addr], size` (sm_90+, PTX 8.0): one instruction per CHUNK
  bytes, served by the copy engine of the SM without registers.
- "line": `prefetch.global.L2::evict_last [addr]` once per 128-byte line, from many lanes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels import L2_PREFETCH_MODES as MODES

LINE = 128  # bytes per L2 line request in "line" mode
BULK_CHUNK = 16384  # bytes per bulk request
BULK_LANES = 32
LINE_LANES = 256
PROGRAMS = 8  # programs per prefetch launch unless the caller says


@triton.jit
def _bulk_kernel(base, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lanes = tl.arange(0, LANES)
    for start in range(pid * LANES * CHUNK, nbytes, nprog * LANES * CHUNK):
        off = start + lanes * CHUNK  # [LANES] byte offsets
        size = tl.minimum(nbytes - off, CHUNK)  # <= 0 past the end: no request
        addr = base + off.to(tl.int64)
        tl.inline_asm_elementwise(
            asm="{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
            constraints="=r,l,r", args=[addr, size], dtype=tl.int32, is_pure=False, pack=1,
        )


@triton.jit
def _line_kernel(base, nbytes, LINE_BYTES: tl.constexpr, LANES: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lanes = tl.arange(0, LANES)
    for start in range(pid * LANES * LINE_BYTES, nbytes, nprog * LANES * LINE_BYTES):
        off = start + lanes * LINE_BYTES
        addr = base + off.to(tl.int64)
        tl.inline_asm_elementwise(
            asm="{ .reg .pred p; setp.lt.s32 p, $2, $3; @p prefetch.global.L2::evict_last [$1]; mov.b32 $0, 0; }",
            constraints="=r,l,r,r", args=[addr, off, nbytes + tl.zeros_like(off)], dtype=tl.int32,
            is_pure=False, pack=1,
        )


def prefetch_l2(t: torch.Tensor, nbytes: int | None = None, *, mode: str = "bulk", programs: int | None = None) -> None:
    """Ask for the first `nbytes` (default: all) of contiguous tensor `t` to be brought into L2."""
    if mode not in MODES:
        raise ValueError(f"L2 prefetch mode must be one of {MODES}, got {mode!r}")
    assert t.is_cuda and t.is_contiguous()
    total = t.numel() * t.element_size()
    n = total if nbytes is None else min(int(nbytes), total)
    n -= n % 16  # bulk sizes are multiples of 16 bytes
    if n <= 0:
        return
    assert n < 2**31 and t.data_ptr() % 16 == 0
    programs = PROGRAMS if programs is None else programs
    if mode == "bulk":
        _bulk_kernel[(programs,)](t.data_ptr(), n, CHUNK=BULK_CHUNK, LANES=BULK_LANES, num_warps=1)
    else:
        _line_kernel[(programs,)](t.data_ptr(), n, LINE_BYTES=LINE, LANES=LINE_LANES, num_warps=8)
