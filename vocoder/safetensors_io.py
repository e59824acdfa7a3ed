"""Reading the codec's safetensors files: whole, into memory of their own, errors naming the file."""

from __future__ import annotations

from pathlib import Path

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def read_safetensors(path: str | Path, what: str, *, floats_only: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file at `path` (`what` names it in errors: "voice file", ...).

    The tensors are copies: safetensors' own CPU loaders hand back views of the file's mapping, which follow
    the file when it is rewritten and fault once it is truncated. A file that is not safetensors (a renamed
    pickle, a directory, a truncated download) is a ValueError naming it, and so, with `floats_only`, is a
    tensor that is not float32, float16 or bfloat16 (an integer tensor would be cast without a word)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = Path(path)
    try:
        tensors = load(path.read_bytes())
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{what} {path} cannot be read as safetensors: {exc}") from None
    if floats_only:
        wrong = sorted(f"{k} ({t.dtype})" for k, t in tensors.items() if t.dtype not in FLOAT_DTYPES)
        if wrong:
            raise ValueError(f"{what} {path} holds tensors that are not floating point: {', '.join(wrong[:5])}"
                             + (f" and {len(wrong) - 5} more" if len(wrong) > 5 else ""))
    return tensors
