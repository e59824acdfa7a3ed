"""The vocoder's start-up product check (StreamingVocoder.check_products, runtime/matmul_check.py)."""
from __future__ import annotations

import pytest
import torch

import runtime.fp8
import vocoder.streaming
from runtime.matmul_check import CHECK_ROWS, MatmulCheckError
from vocoder import StreamingVocoder
from vocoder.streaming import build_for_serving


def test_each_distinct_flow_matrix_is_checked_at_each_row_count() -> None:
    checks = StreamingVocoder.from_preset("tiny").check_products()
    shapes = {(c.out_features, c.in_features) for c in checks}
    # tiny's flow: 10 distinct linear shapes (encoder blocks, projections, estimator MLPs and blocks); the
    # encoder's qkv has a bias and the estimator's, of the same shape, has none: that shape is checked both ways
    assert len(shapes) == 10 and len(checks) == 11 * len(CHECK_ROWS)
    assert {c.rows for c in checks} == set(CHECK_ROWS) and all(c.ok for c in checks)
    unbiased = {(c.name, c.out_features, c.in_features) for c in checks if not c.bias}
    assert unbiased == {("estimator.down_tf.0.qkv", 192, 64)}
    assert {(c.out_features, c.in_features) for c in checks if c.bias} == shapes


def test_a_wrong_product_stops_the_build_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    linear = runtime.fp8.linear

    def broken(x, w, **kwargs):  # the estimator blocks' qkv product (no bias) at 513 rows gives NaN
        y = linear(x, w, **kwargs)
        return torch.full_like(y, float("nan")) if (w.shape[0], x.shape[0]) == (192, 513) else y

    monkeypatch.setattr(runtime.fp8, "linear", broken)
    with pytest.raises(MatmulCheckError, match=r"1 of 77 matrix products .* estimator\.down_tf\.0\.qkv "
                                                r"\[513 x 64\] @ \[64 x 192\]: 98496 non-finite .* The vocoder will not"):
        build_for_serving("tiny", check_matmuls=True)


def test_a_wrong_biased_product_stops_the_build_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    linear = torch.nn.functional.linear

    def broken(x, w, bias=None):  # addmm of the encoder's qkv at 16 rows adds its bias a thousand times
        return linear(x, w, 1000 * bias) if bias is not None and (w.shape[0], x.shape[0]) == (192, 16) \
            else linear(x, w, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", broken)
    with pytest.raises(MatmulCheckError, match=r"1 of 77 matrix products .* encoder\.code_blocks\.0\.qkv "
                                                r"\[16 x 64\] @ \[64 x 192\] \+ bias: 0 non-finite outputs, relative error"):
        build_for_serving("tiny", check_matmuls=True)


def test_the_check_runs_on_cuda_by_default_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    monkeypatch.setattr(vocoder.streaming, "verify_products", lambda *a, **k: calls.append(k["who"]) or [])
    build_for_serving("tiny")  # CPU, check_matmuls None
    assert calls == []
    build_for_serving("tiny", check_matmuls=True)
    assert calls == ["The vocoder"]
