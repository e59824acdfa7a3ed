"""Device-side half of programmatic dependent launch (see runtime/kernels/__init__.py).

`pdl_args()` gives the launch keywords for the current mode; a kernel that takes `USE_PDL` calls
`pdl_enter(USE_PDL)` before its first read of anything an earlier kernel wrote. Before that wait it may
`l2_prefetch_once` bytes no earlier kernel of the step writes (its weights, earlier keys).
"""
from __future__ import annotations

import triton
import triton.language as tl

from runtime.kernels import pdl_mode


def pdl_args() -> dict:
    """`USE_PDL` and Triton's `launch_pdl` option for the mode in force."""
    on = pdl_mode() != "off"
    return {"USE_PDL": on, "launch_pdl": on}


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Wait until the previous kernel has finished and its writes are visible, then let the next kernel
    launch (it waits in turn, so ordering stays transitive). A no-op without PDL."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def l2_prefetch_once(ptr, nbytes):
    """Ask L2 for the `nbytes` (a multiple of 16; 0 asks nothing) at `ptr` (scalars), issued by the program's
    thread 0 alone: Hopper's bulk prefetch (`cp.async.bulk.prefetch.L2`, sm_90 PTX). A hint: nothing waits
    for it and no register or shared memory holds the bytes. The same prefetch issued by every thread, or one
    per weight row, made the step slower (docs/gpu.md, fortieth session)."""
    tl.inline_asm_elementwise(
        "{\n.reg .pred %pf, %po;\n.reg .u32 %tf;\nmov.u32 %tf, %tid.x;\nsetp.eq.u32 %po, %tf, 0;\n"
        "setp.ne.and.u32 %pf, $2, 0, %po;\n@%pf cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;\n}",
        "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def l2_prefetch_rows(w_ptr, pid, N, K, BLOCK_N: tl.constexpr, SLICE: tl.constexpr):
    """Program `pid` of a GEMV owns rows pid * BLOCK_N ... of a row-major [N, K] weight: one contiguous slice.
    Ask L2 for its first SLICE bytes (-1: all of it) with `l2_prefetch_once`."""
    w_bytes: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
    slice_bytes = (tl.minimum(N - pid * BLOCK_N, BLOCK_N) * K * w_bytes).to(tl.int32)
    if SLICE > 0:
        slice_bytes = tl.minimum(slice_bytes, SLICE)
    l2_prefetch_once(w_ptr + pid.to(tl.int64) * BLOCK_N * K, slice_bytes)
