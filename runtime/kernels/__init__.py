"""Triton kernels for the GPU fast path (norms, RoPE + KV store, paged attention, FP8 GEMV).

`import triton` is guarded: on a machine without Triton (the CPU CI) this package still imports,
`HAS_TRITON` is False and the fast path uses its pure-PyTorch ops instead (runtime/fast_ops.py).
"""
from __future__ import annotations

try:  # pragma: no cover - depends on the machine
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU CI has no triton
    HAS_TRITON = False

__all__ = ["HAS_TRITON"]
