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
