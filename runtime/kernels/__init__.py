"""Triton kernels for the GPU fast path (norms, RoPE + KV store, paged attention, FP8 GEMV).

`import triton` is guarded: on a machine without Triton (the CPU CI) this package still imports,
`HAS_TRITON` is False and the fast path uses its pure-PyTorch ops instead (runtime/fast_ops.py).

Programmatic dependent launch (PDL, Hopper and newer): inside `pdl_launches(mode)` the decode kernels are
launched so that each may start while the kernel before it is still running. Every such kernel waits for
its predecessor (`griddepcontrol.wait`) before it reads anything a predecessor wrote or writes anything,
so results are identical; what overlaps is a kernel's launch and scheduling with its predecessor's last
wave. Modes: "off" (ordinary launches) and "wait" (each kernel waits at its start, then lets its
successor launch). A third mode that also prefetched the GEMV's weight rows into L2 before the wait was
slower on the H200 (docs/gpu.md) and was removed, as was one that let the successor launch before the wait
(bench/results/pdl-early-h200/). What is kept is smaller: one L2 prefetch per program, from one thread,
before the wait, in the FP8 GEMVs of 1-4 rows and the split-key decode attention
(runtime/kernels/launch.py `l2_prefetch_once`). The mode is per thread (an engine thread and a vocoder
thread of one process do not see each other's), and the vocoder's kernels use the same helpers.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

try:  # pragma: no cover - depends on the machine
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU CI has no triton
    HAS_TRITON = False

PDL_MODES = ("off", "wait")
_pdl = threading.local()


def pdl_mode() -> str:
    """The launch mode kernels launched from this thread use now (see the module docstring)."""
    return getattr(_pdl, "mode", "off")


@contextmanager
def pdl_launches(mode: str) -> Iterator[None]:
    """Launch the fast-path kernels in `mode` (one of PDL_MODES) inside the block."""
    if mode not in PDL_MODES:
        raise ValueError(f"PDL mode must be one of {PDL_MODES}, got {mode!r}")
    before = pdl_mode()
    _pdl.mode = mode
    try:
        yield
    finally:
        _pdl.mode = before


def resolve_pdl(mode: str, device: object, kernels_on: bool) -> str:
    """A launch option as given ("off" | "wait" | "auto") -> the mode to use: "off" unless `kernels_on` (the
    caller runs the Triton kernels); "auto" = "wait" where `device` is a CUDA device that supports PDL."""
    if mode not in (*PDL_MODES, "auto"):
        raise ValueError(f"pdl must be one of {(*PDL_MODES, 'auto')}, got {mode!r}")
    if not kernels_on:
        return "off"
    if mode == "auto":
        import torch

        device = torch.device(device)  # type: ignore[arg-type]
        on_cuda = device.type == "cuda"
        return "wait" if on_cuda and pdl_supported(torch.cuda.get_device_capability(device)) else "off"
    return mode


def pdl_supported(device_capability: tuple[int, int]) -> bool:
    """PDL needs compute capability 9.0+ and a Triton that has the griddepcontrol intrinsics."""
    if not HAS_TRITON or device_capability[0] < 9:
        return False
    import triton.language as tl

    return hasattr(tl.extra, "cuda") and hasattr(tl.extra.cuda, "gdc_wait")


__all__ = ["HAS_TRITON", "PDL_MODES", "pdl_launches", "pdl_mode", "pdl_supported", "resolve_pdl"]
