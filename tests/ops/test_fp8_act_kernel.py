"""The FP8 activation quantization (runtime/kernels/fp8_act.py) under Triton's CPU interpreter: the same scales
and quotients as the eager ops it replaces (runtime/fp8.py `quantize_activations` with OPTIONS["act_quant"] =
"torch"), padding rows included.

The interpreter's e4m3 rounding is not the GPU's (it rounds ties away from zero, 42.0 -> 44 instead of 40, and
loses a carry into the next power of two, -125.44 -> -64 instead of -128), so here the kernel stores its
quotients in float32 (`codes_dtype`); the rounding to e4m3 is the hardware's cvt.rn.satfinite, which
tests/ops/test_triton_compile.py finds in the PTX and bench/fp8_rows.py compares code for code on the GPU
("act_quant_bit_equal").
"""
from __future__ import annotations

SCRIPT = """
import torch
from runtime import fp8
from runtime.kernels.fp8_act import quantize_rows

fp8.OPTIONS["act_quant"] = "torch"
torch.manual_seed(0)
for m, k, rows, dtype in ((5, 4096, 16, torch.bfloat16), (3, 12288, 16, torch.bfloat16),
                          (16, 300, 16, torch.float32)):
    x = (torch.randn(m, k) * 3).to(dtype)
    x[0, 1] = -0.0
    x[2] = 0.0  # a zero row: the scale's floor
    codes, scales = fp8.quantize_activations(x, rows)
    xf = torch.nn.functional.pad(x.float(), (0, 0, 0, rows - m))
    quotients, got_scales = quantize_rows(x, rows, codes_dtype=torch.float32)
    assert quotients.shape == (rows, k) and got_scales.shape == (rows, 1)
    assert torch.equal(got_scales, scales)
    assert torch.equal(quotients, xf / scales)  # IEEE division, as PyTorch's
    assert torch.equal(quotients.to(torch.float8_e4m3fn).view(torch.uint8), codes.view(torch.uint8))
    assert got_scales[2].item() == (torch.tensor(1e-12) * torch.tensor(1 / 448)).item()
    assert str(quotients[0, 1].item()) == "-0.0"
    print(m, k, rows, "equal", int(quotients[m:].count_nonzero()))
"""


def test_fp8_activation_scales_and_quotients_equal_the_eager_ops(triton_interpreter) -> None:
    assert triton_interpreter(SCRIPT).split() == ["5", "4096", "16", "equal", "0", "3", "12288", "16", "equal", "0",
                                                  "16", "300", "16", "equal", "0"]
