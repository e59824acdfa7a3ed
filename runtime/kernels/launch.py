"""Device-side half of programmatic dependent launch (see runtime/kernels/__init__.py).

`pdl_args()` gives the launch keywords for the current mode; a kernel that takes `USE_PDL` calls
`pdl_enter(USE_PDL)` before its first read of anything an earlier kernel wrote.
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
