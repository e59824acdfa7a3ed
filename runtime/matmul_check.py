"""A start-up check that the device's matrix products give right answers for this model's matrices.

Found on the H200 (docs/operations.md, bench/results/matmul-mps-h200/): under NVIDIA MPS with
`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` 60-80 the process sees 78-104 SMs and PyTorch's bf16 products through
cuBLAS and cuBLASLt return garbage (NaN, or values unrelated to the inputs) for many of the engine's shapes
(at 75 %: most), with no error raised; at 25, 50 and 90 % and without MPS they are right. The engine then served every request's first
mixed prefill step with NaN logits. So before serving, each distinct matrix of the model is multiplied by
random activations at a few row counts through the engine's own `linear` and compared with a float32
product; a wrong answer stops the engine with a message that names the product, instead of serving noise.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime import fp8
from runtime.fp8 import Fp8Weight, Weight

# Row counts checked: a few decode batches and mixed / prefill steps (an uneven one among them). With FP8
# weights each FP8 path runs: 2 and 16 the GEMV, 24 and 64 the weight-only product (o, down) and the padded
# torch._scaled_mm, 128 and more torch._scaled_mm (runtime/fp8.py `linear`).
CHECK_ROWS = (2, 16, 24, 64, 128, 513, 1024)
# Relative error (max |y - ref| / max |ref|) above which a product is wrong. Rounding stays far below it
# (bf16 ~3e-3, FP8 weights and activations ~3e-2 on random data); a product that did not run gives ~1 or NaN.
TOLERANCE = 0.25
_REF_CHUNK = 8192  # output channels per float32 reference block (no whole float32 copy of a head)


class MatmulCheckError(RuntimeError):
    """The device computed a product of this model's matrices wrongly."""


@dataclass(frozen=True)
class ProductCheck:
    """One product's outcome: `name` [out, in] times `rows` activation rows."""

    name: str
    rows: int
    out_features: int
    in_features: int
    nonfinite: int  # outputs that are NaN or infinite
    rel_err: float  # over the finite outputs
    bias: bool = False  # the product with the layer's bias added in the same call (addmm)

    @property
    def ok(self) -> bool:
        return self.nonfinite == 0 and self.rel_err <= TOLERANCE

    def describe(self) -> str:
        plus = " + bias" if self.bias else ""
        return (f"{self.name} [{self.rows} x {self.in_features}] @ [{self.in_features} x {self.out_features}]{plus}: "
                f"{self.nonfinite} non-finite outputs, relative error {self.rel_err:.3g}")


def _blocks(w: Weight) -> Iterator[tuple[int, torch.Tensor]]:
    """(first output channel, float32 rows of w) a block of output channels at a time."""
    matrix = w.weight if isinstance(w, Fp8Weight) else w
    for start in range(0, matrix.shape[0], _REF_CHUNK):
        block = matrix[start : start + _REF_CHUNK].float()
        if isinstance(w, Fp8Weight):
            block = block * w.scale[start : start + _REF_CHUNK, None]
        yield start, block


def check_products(
    matrices: Mapping[str, Weight], rows: Sequence[int] = CHECK_ROWS, *, dtype: torch.dtype = torch.bfloat16,
    seed: int = 0, biases: Mapping[str, torch.Tensor] | None = None,
) -> list[ProductCheck]:
    """Each matrix times normal(0, 1) activations of each row count, through `runtime.fp8.linear` (the
    fast path's product), against float32 (compared a block of output channels at a time, so no float32
    copy of a whole head or of its product exists). `biases`: for the matrices it names, the product is
    `F.linear` with that bias, as an `nn.Linear` with a bias runs it (one addmm, which cuBLASLt may serve
    with other kernels than the plain product), and the reference adds the bias."""
    biases = biases or {}
    out: list[ProductCheck] = []
    for name, w in matrices.items():
        n, k = w.shape
        device = (w.weight if isinstance(w, Fp8Weight) else w).device
        gen = torch.Generator(device=device).manual_seed(seed)
        bias = biases.get(name)
        assert bias is None or isinstance(w, torch.Tensor), f"{name}: a biased product takes a plain matrix"
        for m in rows:
            x = torch.randn(m, k, generator=gen, device=device).to(dtype)
            y = fp8.linear(x, w) if bias is None else F.linear(x, w, bias)  # [m, n]
            x32 = x.float()
            nonfinite, err, scale = 0, 0.0, 0.0
            for start, block in _blocks(w):
                ref = x32 @ block.T  # [m, chunk]
                if bias is not None:
                    ref += bias[start : start + block.shape[0]].float()
                part = y[:, start : start + block.shape[0]].float()
                bad = ~torch.isfinite(part)
                nonfinite += int(bad.sum().item())
                err = max(err, float((part - ref).abs().masked_fill(bad, 0).max().item()))
                scale = max(scale, float(ref.abs().max().item()))
            out.append(ProductCheck(name, m, n, k, nonfinite, err / max(scale, 1e-30), bias is not None))
    return out


def distinct_matrices(named: Iterable[tuple[str, Weight]]) -> dict[str, Weight]:
    """The first matrix of each (shape, kind) among `named`: one per product the device has to get right."""
    seen: dict[tuple[object, ...], str] = {}
    out: dict[str, Weight] = {}
    for name, w in named:
        key = (tuple(w.shape), isinstance(w, Fp8Weight), (w.weight if isinstance(w, Fp8Weight) else w).dtype)
        if key not in seen:
            seen[key] = name
            out[name] = w
    return out


def verify_products(matrices: Mapping[str, Weight], rows: Sequence[int] = CHECK_ROWS, *,
                    dtype: torch.dtype = torch.bfloat16, who: str = "The engine",
                    biases: Mapping[str, torch.Tensor] | None = None) -> list[ProductCheck]:
    """`check_products`; raises MatmulCheckError naming every wrong product (returns the checks if all are
    right). `who`: what refuses to serve, for the message."""
    checks = check_products(matrices, rows, dtype=dtype, biases=biases)
    wrong = [c for c in checks if not c.ok]
    if wrong:
        lines = "; ".join(c.describe() for c in wrong[:8])
        more = f" (and {len(wrong) - 8} more)" if len(wrong) > 8 else ""
        raise MatmulCheckError(
            f"{len(wrong)} of {len(checks)} matrix products on this device were wrong: {lines}{more}. "
            f"{who} will not serve with them. Under NVIDIA MPS, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE 60-80 did "
            "this on an H200 (docs/operations.md); choose another share of the SMs or run without MPS.")
    return checks
