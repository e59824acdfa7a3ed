"""Small host tensors to the device without waiting for it."""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A small host tensor on `device` without waiting for the GPU: through pinned memory, copied on the
    current stream (PyTorch's pinned-memory cache keeps the block until that copy has run). A copy from
    pageable memory waits for the stream to drain first, i.e. for the forward pass the caller follows or
    precedes: with CUDA graphs and asynchronous steps the host would then idle through every step."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
