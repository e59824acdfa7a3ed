"""Device-side half of programmatic dependent launch (see runtime/kernels/__init__.py).

`pdl_args()` gives the launch keywords for the current mode; a kernel that takes `USE_PDL` calls
`pdl_enter(USE_PDL)` before its first read of anything an earlier kernel wrote.
"""
from __future__ import annotations

import triton
import triton.language as tl

from runtime.kernels import pdl_mode


def pdl_args() -> dict:
    """`USE_PDL` (0 "off", 1 "wait", 2 "early") and Triton's `launch_pdl` option for the mode in force."""
    mode = pdl_mode()
    return {"USE_PDL": {"off": 0, "wait": 1, "early": 2}[mode], "launch_pdl": mode != "off"}


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Wait until the previous kernel has finished and its writes are visible, and let the next kernel
    launch: after the wait (USE_PDL 1 or True) or before it (2). Either way the next kernel waits in turn
    for this one to finish, which it does only after its own wait, so ordering stays transitive. A no-op
    without PDL."""
    if USE_PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
