"""The start-up check of the device's matrix products (runtime/matmul_check.py) and its use by the engine."""
from __future__ import annotations

import pytest
import torch

import runtime.engine
import runtime.fp8
from runtime.engine import EngineConfig, EngineCore, _model_matrices, load_model
from runtime.fp8 import quantize_weight
from runtime.fused import fuse_model_weights
from runtime.matmul_check import (
    CHECK_ROWS,
    MatmulCheckError,
    ProductCheck,
    check_products,
    distinct_matrices,
    verify_products,
)


@pytest.fixture(scope="module")
def tiny_model():
    model, _ = load_model(EngineConfig())
    return model


def test_one_matrix_per_distinct_product(tiny_model) -> None:
    # tiny: hidden 64, 2 query + 1 + 1 KV heads of 32 -> qkv [128, 64]; intermediate 128
    fused = fuse_model_weights(tiny_model)
    shapes = {name: tuple(w.shape) for name, w in _model_matrices(tiny_model, fused).items()}
    assert shapes == {"shared.0.qkv": (128, 64), "shared.0.o": (64, 64), "shared.0.gate_up": (256, 64),
                      "shared.0.down": (64, 128), "text_head": (151680, 64), "audio_head": (16512, 64)}
    plain = {name: tuple(w.shape) for name, w in _model_matrices(tiny_model, None).items()}
    assert plain == {"model.shared_block.layers.0.self_attn.q_proj": (64, 64),
                     "model.shared_block.layers.0.self_attn.k_proj": (32, 64),
                     "model.shared_block.layers.0.mlp.gate_proj": (128, 64),
                     "model.shared_block.layers.0.mlp.down_proj": (64, 128),
                     "text_lm_head": (151680, 64), "audio_lm_head": (16512, 64)}


def test_an_fp8_matrix_is_a_product_of_its_own() -> None:
    w = torch.randn(32, 16)
    found = distinct_matrices([("a", w), ("b", w.clone()), ("c", quantize_weight(w)), ("d", w.double())])
    assert list(found) == ["a", "c", "d"]


def test_right_products_pass_with_their_error(tiny_model) -> None:
    fused = fuse_model_weights(tiny_model)
    matrices = {"qkv": fused.shared[0].qkv, "down": fused.shared[0].down,
                "fp8_down": quantize_weight(fused.shared[0].down)}
    checks = verify_products(matrices, dtype=torch.float32)
    assert [(c.name, c.rows) for c in checks] == [(n, r) for n in matrices for r in CHECK_ROWS]
    assert [(c.out_features, c.in_features) for c in checks[:: len(CHECK_ROWS)]] == [(128, 64), (64, 128), (64, 128)]
    assert all(c.ok and c.nonfinite == 0 for c in checks)
    assert max(c.rel_err for c in checks) < 1e-5  # CPU: F.linear against the float32 product


def _broken_for(out_features: int, rows: int, value: float):
    """runtime.fp8.linear, except that products with `out_features` outputs at `rows` rows give `value`."""
    linear = runtime.fp8.linear

    def broken(x, w, **kwargs):
        y = linear(x, w, **kwargs)
        return torch.full_like(y, value) if (w.shape[0], x.shape[0]) == (out_features, rows) else y
    return broken


def test_a_wrong_product_is_named(monkeypatch, tiny_model) -> None:
    fused = fuse_model_weights(tiny_model)
    matrices = {"qkv": fused.shared[0].qkv, "gate_up": fused.shared[0].gate_up}
    monkeypatch.setattr(runtime.fp8, "linear", _broken_for(256, 513, float("nan")))
    checks = check_products(matrices, dtype=torch.float32)
    wrong = [c for c in checks if not c.ok]
    assert [(c.name, c.rows, c.nonfinite) for c in wrong] == [("gate_up", 513, 513 * 256)]
    with pytest.raises(MatmulCheckError, match=r"1 of 14 matrix products .* gate_up \[513 x 64\] @ \[64 x 256\]: "
                                                r"131328 non-finite outputs"):
        verify_products(matrices, dtype=torch.float32)


def test_finite_but_unrelated_values_are_wrong(monkeypatch, tiny_model) -> None:
    fused = fuse_model_weights(tiny_model)
    monkeypatch.setattr(runtime.fp8, "linear", _broken_for(64, 2, 0.0))  # e.g. a kernel that never ran
    checks = check_products({"down": fused.shared[0].down}, dtype=torch.float32)
    assert [(c.rows, c.ok, c.nonfinite, round(c.rel_err, 6)) for c in checks if c.rows == 2] == [(2, False, 0, 1.0)]
    assert all(c.ok for c in checks if c.rows != 2)


def test_a_biased_product_is_checked_with_its_bias(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(48, 32, generator=gen), 10 * torch.randn(48, generator=gen)
    checks = check_products({"w": w}, (4, 513), dtype=torch.float32, biases={"w": b})
    assert [(c.rows, c.bias, c.ok) for c in checks] == [(4, True, True), (513, True, True)]
    assert max(c.rel_err for c in checks) < 1e-5
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, bias=None: linear(x, w))  # bias dropped
    dropped = check_products({"w": w}, (4,), dtype=torch.float32, biases={"w": b})
    assert [(c.bias, c.nonfinite, c.ok) for c in dropped] == [(True, 0, False)] and dropped[0].rel_err > 0.25
    assert dropped[0].describe().startswith("w [4 x 32] @ [32 x 48] + bias: 0 non-finite outputs")


def test_the_engine_refuses_to_start_on_wrong_products(monkeypatch) -> None:
    monkeypatch.setattr(runtime.fp8, "linear", _broken_for(16512, 64, float("inf")))
    with pytest.raises(MatmulCheckError, match=r"audio_head \[64 x 64\] @ \[64 x 16512\]"):
        EngineCore.from_config(EngineConfig(fast_path=True, check_matmuls=True))


def test_the_check_runs_on_cuda_by_default_only(monkeypatch) -> None:
    calls = []
    checked = [ProductCheck("qkv", 2, 128, 64, 0, 0.0)]
    monkeypatch.setattr(runtime.engine, "verify_products", lambda *a, **k: calls.append(a) or checked)
    assert EngineCore.from_config(EngineConfig()).matmul_checks == []  # CPU, check_matmuls None
    assert calls == []
    assert EngineCore.from_config(EngineConfig(check_matmuls=True)).matmul_checks == checked
    assert len(calls) == 1 and len(calls[0][0]) == 6
