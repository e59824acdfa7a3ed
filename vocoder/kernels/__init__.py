"""Triton kernels of the vocoder (fused anti-aliased activation of BigVGAN).

`import triton` is guarded: without Triton (the CPU CI) this package imports, `HAS_TRITON` is False and
callers keep the `bigvgan` package's PyTorch modules.
"""

from __future__ import annotations

try:  # pragma: no cover - depends on the machine
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU CI has no triton
    HAS_TRITON = False

__all__ = ["HAS_TRITON"]
