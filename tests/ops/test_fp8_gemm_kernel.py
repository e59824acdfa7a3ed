"""The weight-only FP8 products for 2-4 rows (runtime/kernels/fp8_gemv.py `gemv_rows`) and 17-64 rows
(runtime/kernels/fp8_gemm.py) under Triton's CPU interpreter, and which products take them (runtime/fp8.py
`linear`).

Triton 3.6's interpreter multiplies bf16 tiles wrongly in `tl.dot` (the products are off by orders of
magnitude, with float16 tiles they are right), so fp8_gemm runs here on float16 activations: the math is the
same, with the codes widened to float16 instead of bf16 (exact either way). bench/fp8_rows.py and
bench/fast_checks.py check the bf16 launches on the GPU against a float32 product.
"""
from __future__ import annotations

from runtime.kernels.fp8_gemm import TILES, weight_only_tiles
from runtime.kernels.fp8_gemv import ROWS_TILES, rows_tiles

SCRIPT = """
import torch
from runtime.fp8 import quantize_weight
from runtime.kernels.fp8_gemm import fp8_gemm
from runtime.kernels.fp8_gemv import gemv_rows

torch.manual_seed(0)
# (kernel, rows, N, K, activation dtype, tiles, largest error): fp8_gemm on float16 (see above): one tile with
# masked rows; rows over two tiles and masked channels; split K summed by the second kernel with masked rows
# and channels. gemv_rows (no tl.dot) on bf16: 2 rows; 3 rows in a 4-row tile (one masked), masked channels.
# Each: float32 sums in another order, then one rounding to the activation dtype (within its ulp).
F16, BF16 = torch.float16, torch.bfloat16
for kernel, m, n, k, dtype, tiles, most in (
        (fp8_gemm, 5, 96, 256, F16, (16, 32, 64, 4, 2, 1), 2 ** -10),
        (fp8_gemm, 40, 80, 256, F16, (32, 64, 128, 4, 2, 1), 2 ** -10),
        (fp8_gemm, 37, 72, 512, F16, (16, 64, 64, 4, 2, 4), 2 ** -10),
        (gemv_rows, 2, 96, 1024, BF16, (32, 256, 4), 2 ** -7),
        (gemv_rows, 3, 40, 1024, BF16, (16, 512, 4), 2 ** -7)):
    x = torch.randn(m, k).to(dtype)
    q = quantize_weight(torch.randn(n, k) * 0.05)
    got = kernel(x, q.weight, q.scale, tiles)
    want = x.float() @ (q.weight.float() * q.scale[:, None]).t()
    assert got.shape == (m, n) and got.dtype == dtype
    err = ((got.float() - want).abs() / (want.abs() + 1e-2)).max().item()
    assert err < most, (kernel.__name__, m, err)
    print(m, n, "ok")
"""


def test_weight_only_fp8_products_equal_the_dequantized_product(triton_interpreter) -> None:
    assert triton_interpreter(SCRIPT).split() == ["5", "96", "ok", "40", "80", "ok", "37", "72", "ok",
                                                  "2", "96", "ok", "3", "40", "ok"]


def test_rows_pick_the_tables_bucket_and_others_stay_on_scaled_mm() -> None:
    o = (4096, 4096)
    assert weight_only_tiles(17, *o) == weight_only_tiles(32, *o) == TILES[(32, *o)]
    assert weight_only_tiles(33, *o) == weight_only_tiles(64, *o) == TILES[(64, *o)]
    assert weight_only_tiles(65, *o) is None  # more rows: torch._scaled_mm
    assert weight_only_tiles(48, 6144, 4096) is None  # qkv at 33-64 rows: not in the table
    assert weight_only_tiles(24, 151680, 4096) is None  # the text head: not swept
    # every entry's tiles divide K evenly into its splits and tiles
    assert all(k % (split * bk) == 0 and bm == bucket for (bucket, _, k), (bm, _, bk, _, _, split) in TILES.items())


def test_two_to_four_rows_pick_the_multi_row_gemv_where_its_table_says() -> None:
    assert rows_tiles(2, 24576, 4096) == ROWS_TILES[(2, 24576, 4096)]
    assert rows_tiles(3, 4096, 4096) == rows_tiles(4, 4096, 4096) == ROWS_TILES[(4, 4096, 4096)]
    assert rows_tiles(3, 24576, 4096) is None  # gate/up at 3-4 rows: the tensor-core kernel
    assert rows_tiles(1, 4096, 4096) is None and rows_tiles(5, 4096, 4096) is None
    assert all(k % bk == 0 for (_, _, k), (_, bk, _) in ROWS_TILES.items())
