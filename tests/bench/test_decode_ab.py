"""bench/decode_ab.py: variant parsing and the ceiling variant's kernel-free stand-ins."""
from __future__ import annotations

import pytest
import torch

from bench.decode_ab import parse_variant, skipping_ops
from runtime.kernels import elementwise


def test_parse_variant_keeps_ops_skip_as_text_and_converts_known_options() -> None:
    weights, batch, options = parse_variant("bf16/64/ops_skip=add_rmsnorm+silu_mul,pdl_max_rows=64,fused_rope=0")
    assert (weights, batch) == ("bf16", 64)
    assert options == {"ops_skip": "add_rmsnorm+silu_mul", "pdl_max_rows": 64, "fused_rope": False}


def test_skipped_ops_hand_back_their_inputs_without_computing() -> None:
    ops = skipping_ops(["add_rmsnorm", "silu_mul"])
    x, res = torch.arange(8.0).reshape(2, 4), torch.ones(2, 4)
    h, r = ops.add_rmsnorm(x, None, torch.full((4,), 3.0), 1e-6)
    assert h is x and r is x  # the first layer: x is also the residual stream
    h, r = ops.add_rmsnorm(x, res, torch.full((4,), 3.0), 1e-6)
    assert h is x and r is res
    gate_up = torch.arange(12.0).reshape(2, 6)
    assert torch.equal(ops.silu_mul(gate_up), torch.tensor([[0.0, 1.0, 2.0], [6.0, 7.0, 8.0]]))
    # the ops not named are the kernels themselves
    assert skipping_ops(["silu_mul"]).add_rmsnorm is elementwise.add_rmsnorm


def test_skipping_an_unknown_op_is_refused() -> None:
    with pytest.raises(ValueError, match="'decode_attention' is not one of"):
        skipping_ops(["decode_attention"])
