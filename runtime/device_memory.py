"""A hard cap on the device memory one process's PyTorch allocator may hold.

On one card shared by the LLM and vocoder replicas (an RTX 4090: config/serve-4090.yaml), Ray's fractional
`num_gpus` divides scheduling, not memory. With a cap, a replica that needs more than its share gets a CUDA
out-of-memory error in its own process, at start-up or in the step that asked, instead of taking memory the
other replica counts on. `torch.cuda.set_per_process_memory_fraction` bounds the caching allocator only: the
CUDA context, library workspaces and loaded kernels come on top (1.77-2.40 GiB for two processes in the
24 GB configs' runs on the H200: docs/operations.md).
"""
from __future__ import annotations

import torch


def check_device(device: object, name: str) -> str:
    """The type ("cpu" or "cuda") of the device string `device`; ValueError naming the setting `name` for any
    other (mps, meta, a typo): the engine and the vocoder run on these two only."""
    try:
        kind = torch.device(device).type if isinstance(device, str) else None
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"{name} must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return kind


def indexed_cuda_device(device: str | torch.device) -> torch.device:
    """A CUDA device with its index filled in: the current one when `device` names none ("cuda")."""
    device = torch.device(device)
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _index_and_total(device: torch.device) -> tuple[int, int]:
    """A CUDA device's index (the current one when `device` names none) and its memory in bytes."""
    index = indexed_cuda_device(device).index
    return index, torch.cuda.get_device_properties(index).total_memory


def cap_device_memory(device: str | torch.device, cap_bytes: int | None) -> float | None:
    """Cap this process's allocator on `device` at `cap_bytes` (None: no cap) -> the fraction of the
    device's memory set, or None. Raises ValueError for a non-CUDA device or a cap the device cannot give."""
    if cap_bytes is None:
        return None
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"a device memory cap needs a CUDA device, got {str(device)!r}")
    if cap_bytes < 1:
        raise ValueError(f"the device memory cap must be >= 1 byte, got {cap_bytes}")
    index, total = _index_and_total(device)
    if cap_bytes > total:
        raise ValueError(f"the device memory cap ({cap_bytes} bytes) exceeds cuda:{index}'s memory ({total} bytes)")
    fraction = cap_bytes / total
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return fraction


def capped_free_bytes(device: torch.device, cap_bytes: int | None) -> int:
    """Device memory this process may still allocate: what the device has free, and under a cap, no more than
    the cap less what the allocator already holds."""
    free, _ = torch.cuda.mem_get_info(device)
    if cap_bytes is None:
        return free
    return max(0, min(free, cap_bytes - torch.cuda.memory_reserved(device)))


def memory_stats(device: str | torch.device) -> dict[str, int] | None:
    """This process's allocator on a CUDA `device`: bytes allocated and reserved now, the peak reserved since
    start, and the cap (0: none); and the device's used bytes by every process, CUDA contexts included
    (`device_used`: total less free). None on other devices."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index, total = _index_and_total(device)
    fraction = torch.cuda.get_per_process_memory_fraction(index)
    free, _ = torch.cuda.mem_get_info(index)
    return {"allocated": torch.cuda.memory_allocated(index), "reserved": torch.cuda.memory_reserved(index),
            "peak_reserved": torch.cuda.max_memory_reserved(index),
            "cap": 0 if fraction >= 1.0 else int(fraction * total), "device_used": total - free}
