"""Counter-based Gaussian noise: the value for (seed, frame, bin) never depends on batch or chunking."""

from __future__ import annotations

import functools
import math

import torch

from runtime.transfer import to_device
from vocoder.config import NUM_MELS
from vocoder.kernels import HAS_TRITON

_MASK32 = 0xFFFFFFFF
# Multipliers kept below 2**31 so that a 32-bit value times one of them fits in a signed int64.
_MUL_A = 0x7FEB352D
_MUL_B = 0x68E31DA5
_MAX_SEED = 2**63 - 1
# "kernel": on CUDA with Triton, make the noise in one kernel launch (vocoder/kernels/frame_noise.py) instead
# of the eager ops below; the same bits. A switch for benchmarks' A/Bs.
OPTIONS = {"kernel": True}


def _mix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """Integer avalanche hash on 32-bit values: int64 tensors or Python ints."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _MASK32
    return x ^ (x >> 16)


@functools.lru_cache(maxsize=4096)
def seed_key(seed: int) -> int:
    """The 32-bit key a stream's noise is hashed with (the eager code's `key`; `_mix32` on Python ints).
    Cached: a stream's key is asked for at every step it joins."""
    return int(_mix32(_mix32(seed & _MASK32) ^ (seed >> 32)))


def check_seed(seed: int) -> int:
    """Return `seed` if it is an int in [0, 2**63); else raise ValueError."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")
    return seed


def frame_noise(
    seed: int, start: int, stop: int, *, device: torch.device | str = "cpu", kernel: bool = True
) -> torch.Tensor:
    """Standard normal noise for mel frames [start, stop) of a stream: float32 [NUM_MELS, stop - start].

    Frame t's values are a pure function of (seed, t), so streams never share or consume RNG state.
    """
    if not 0 <= start <= stop:
        raise ValueError(f"bad frame range [{start}, {stop})")
    return batch_frame_noise([seed], [start], stop - start, device=device, kernel=kernel)[0]


def batch_frame_noise(
    seeds: list[int], starts: list[int], length: int, *, device: torch.device | str = "cpu", kernel: bool = True
) -> torch.Tensor:
    """Row b holds frames [starts[b], starts[b] + length) of stream seeds[b]: float32 [B, NUM_MELS, length].
    `kernel` False: the eager ops even where the one-launch kernel could run (a vocoder built with
    `triton_kernels=False`); the same values either way."""
    for seed in seeds:
        check_seed(seed)
    if len(seeds) != len(starts) or length < 0 or any(s < 0 for s in starts):
        raise ValueError("need one non-negative start per seed and a non-negative length")
    dev = torch.device(device)
    # each stream's hashed seed and first frame, in one pinned copy (no wait for the device)
    keys_starts = to_device(torch.tensor([[seed_key(s) for s in seeds], list(starts)], dtype=torch.int64), dev)
    if kernel and dev.type == "cuda" and HAS_TRITON and OPTIONS["kernel"]:
        from vocoder.kernels.frame_noise import frame_noise_kernel

        return frame_noise_kernel(keys_starts, length, NUM_MELS)  # one launch, the same bits
    key = keys_starts[0][:, None, None]  # [B, 1, 1]
    frames = keys_starts[1][:, None] + torch.arange(length, device=dev)  # [B, T]
    bins = torch.arange(NUM_MELS, dtype=torch.int64, device=dev)  # [M]
    counter = frames[:, None, :] * (2 * NUM_MELS) + 2 * bins[None, :, None]  # [B, M, T], unique per (t, bin)
    hi = _mix32((counter >> 32) & _MASK32)
    lo = counter & _MASK32  # even, so lo + 1 stays below 2**32
    base = _mix32(key ^ hi)
    u1 = (_mix32(base ^ lo).double() + 0.5) / 2**32  # (0, 1)
    u2 = (_mix32(base ^ (lo + 1)).double() + 0.5) / 2**32
    normal = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)  # Box-Muller
    return normal.float()
