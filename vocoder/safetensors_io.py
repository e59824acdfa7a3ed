"""Reading the codec's safetensors files: into memory of their own, errors naming the file."""

from __future__ import annotations

from pathlib import Path

import torch


def read_safetensors(path: str | Path, what: str, *, floats_only: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file at `path` (`what` names it in errors: "voice file", ...).

    Each tensor is copied as it is read (peak: the file's size plus one tensor): safetensors' own CPU loaders
    hand back views of the file's mapping, which follow the file when it is rewritten and fault once it is
    truncated. A file that is not safetensors (a renamed pickle, a directory, a truncated download) is a
    ValueError naming it, and so, with `floats_only`, is a tensor that is not floating point (an integer
    tensor would be cast without a word)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            tensors = {key: f.get_tensor(key).clone() for key in f.keys()}  # noqa: SIM118 - not a mapping
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{what} {path} cannot be read as safetensors: {exc}") from None
    if floats_only:
        wrong = sorted(f"{k} ({t.dtype})" for k, t in tensors.items() if not t.is_floating_point())
        if wrong:
            raise ValueError(f"{what} {path} holds tensors that are not floating point: {', '.join(wrong[:5])}"
                             + (f" and {len(wrong) - 5} more" if len(wrong) > 5 else ""))
    return tensors
