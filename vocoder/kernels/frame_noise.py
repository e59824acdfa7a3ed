"""The counter-based Gaussian noise of `vocoder.noise.batch_frame_noise` in one launch.

The eager version builds each value from ~30 separate integer and float64 ops (the `_mix32` avalanche hash
four times, Box-Muller in float64): ~0.45 ms of host time per call on the H200, and the push that makes a
stream's first chunk calls it between the encoder's graph and the flow's (bench/results/
vocoder-first-chunk-host-h200/). This kernel computes the same function per element, in the same order and
precision (int64 hash, float64 Box-Muller rounded to float32 once), so it gives the same bits. Only imported
when Triton is present (see vocoder/kernels/__init__.py).
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

BLOCK = 1024
_TWO_PI = 2.0 * math.pi  # the eager code's `2.0 * math.pi * u2` multiplies by this product


@triton.jit
def _mix32(x):
    """`vocoder.noise._mix32` on int64 values below 2**32 (the multipliers keep products below 2**63)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x68E31DA5) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _frame_noise_kernel(keys_ptr, starts_ptr, out_ptr, total, length, MELS: tl.constexpr, TWO_PI: tl.constexpr,
                        BLOCK: tl.constexpr):
    # `length` is a run-time argument: a chunk's frame count varies from step to step, and a constexpr would
    # compile the kernel again for each new one (0.35-0.9 s each)
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # element of out [B, MELS, length]
    mask = e < total
    row = e // (MELS * length)
    rem = e % (MELS * length)
    mel_bin = rem // length
    key = tl.load(keys_ptr + row, mask=mask, other=0)
    frame = tl.load(starts_ptr + row, mask=mask, other=0) + rem % length
    counter = frame * (2 * MELS) + 2 * mel_bin  # unique per (frame, bin), as in the eager code
    hi = _mix32((counter >> 32) & 0xFFFFFFFF)
    lo = counter & 0xFFFFFFFF
    base = _mix32(key ^ hi)
    u1 = (_mix32(base ^ lo).to(tl.float64) + 0.5) / 4294967296.0  # (0, 1)
    u2 = (_mix32(base ^ (lo + 1)).to(tl.float64) + 0.5) / 4294967296.0
    normal = tl.sqrt(-2.0 * tl.log(u1)) * tl.cos(TWO_PI * u2)
    tl.store(out_ptr + e, normal.to(tl.float32), mask=mask)


def frame_noise_kernel(keys_starts: torch.Tensor, length: int, mels: int) -> torch.Tensor:
    """keys_starts int64 [2, B] on the device (row 0: each stream's hashed seed, `vocoder.noise.seed_key`;
    row 1: its first frame) -> float32 [B, mels, length], as `vocoder.noise.batch_frame_noise`."""
    assert keys_starts.dtype == torch.int64 and keys_starts.dim() == 2 and keys_starts.shape[0] == 2
    batch = keys_starts.shape[1]
    out = torch.empty(batch, mels, length, device=keys_starts.device, dtype=torch.float32)
    total = out.numel()
    if total:
        # Triton launches on the current device (CPU tensors: Triton's interpreter, the tests)
        with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext():
            _frame_noise_kernel[(triton.cdiv(total, BLOCK),)](keys_starts[0], keys_starts[1], out, total, length,
                                                              MELS=mels, TWO_PI=_TWO_PI, BLOCK=BLOCK, num_warps=4)
    return out
