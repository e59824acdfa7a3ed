"""bench/kv_fp8.py's A/B switch: a paged_attention option is off only inside the block, and a name the module
does not have is refused (a typo must not time the default twice)."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from bench.kv_fp8 import option_off, parse_args
from runtime.kernels import paged_attention as pa


def test_option_off_is_scoped_and_restores_the_value() -> None:
    assert pa.OPTIONS["fp8_mid"] is True
    with option_off("fp8_mid"):
        assert pa.OPTIONS["fp8_mid"] is False
        assert pa.decode_launch(32, 8, 1, fp8=True) == pa.FP8_LAUNCH
    assert pa.OPTIONS["fp8_mid"] is True
    assert pa.decode_launch(32, 8, 1, fp8=True) == pa.FP8_WIDE_LAUNCH
    with pytest.raises(RuntimeError), option_off("fp8_mid"):  # restored on the way out of an error too
        raise RuntimeError("boom")
    assert pa.OPTIONS["fp8_mid"] is True
    with option_off(None):
        assert pa.OPTIONS["fp8_mid"] is True


def test_an_unknown_option_is_refused() -> None:
    with pytest.raises(ValueError, match="fp8_mdi"), option_off("fp8_mdi"):
        pass


def test_the_sweep_and_ab_arguments_parse() -> None:
    args = parse_args(["--sweep-parts", "auto,2", "--sweep-launches", "16:1:2,64:1:2", "--ab-option", "fp8_mid"])
    assert (args.sweep_parts, args.sweep_launches, args.ab_option) == ("auto,2", "16:1:2,64:1:2", "fp8_mid")
