"""The one-launch noise kernel (vocoder/kernels/frame_noise.py) under Triton's CPU interpreter.

On CUDA `vocoder.noise.batch_frame_noise` makes its noise with this kernel; it must give the eager ops' bits,
or a stream's audio would depend on the device path. Cases: large seeds (the key's high word), frames past
2**32 / 160 (the counter's high word), one frame, no frames, and no streams.
"""
from __future__ import annotations

import torch

from vocoder import noise

SCRIPT = """
import torch
from vocoder import noise
from vocoder.config import NUM_MELS
from vocoder.kernels.frame_noise import frame_noise_kernel
cases = [([0, 7, 2**40 + 5, 2**63 - 1], [0, 3, 27_000_000, 123_456_789_012], 37), ([12345], [40], 1),
         ([3, 4], [0, 0], 0), ([], [], 5)]
for seeds, starts, length in cases:
    want = noise.batch_frame_noise(seeds, starts, length)
    keys_starts = torch.tensor([[noise.seed_key(s) for s in seeds], starts], dtype=torch.int64)
    got = frame_noise_kernel(keys_starts, length, NUM_MELS)
    assert got.shape == want.shape == (len(seeds), NUM_MELS, length) and got.dtype == torch.float32
    print(length, torch.equal(got.view(torch.int32), want.view(torch.int32)))
"""


def test_kernel_gives_the_eager_noise_bits(triton_interpreter) -> None:
    assert triton_interpreter(SCRIPT).split() == ["37", "True", "1", "True", "0", "True", "5", "True"]


def test_seed_key_is_the_eager_hash_of_the_seed() -> None:
    for seed in (0, 1, 0xFFFFFFFF, 2**32, 2**40 + 5, 2**63 - 1):
        t = torch.tensor([seed], dtype=torch.int64)
        want = noise._mix32(noise._mix32(t & noise._MASK32) ^ (t >> 32))
        assert noise.seed_key(seed) == int(want)
