"""bench/fast_tools.py's helpers for option overrides and tile sweeps (used by the FP8 and vocoder benches)."""
from __future__ import annotations

import pytest
import torch

from bench import fast_tools
from bench.fast_tools import overridden, rel_err, sweep_tiles


def test_overridden_sets_the_keys_for_the_block_and_restores_them_after_an_error() -> None:
    options = {"a": 1, "b": "x"}
    with pytest.raises(RuntimeError), overridden(options, a=2):
        assert options == {"a": 2, "b": "x"}
        raise RuntimeError("inside")
    assert options == {"a": 1, "b": "x"}


def test_sweep_checks_each_candidate_before_timing_it_and_reports_failures(monkeypatch) -> None:
    timed: list[tuple] = []
    monkeypatch.setattr(fast_tools, "graph_us_per_call", lambda fns: timed.append(fns[0]()) or 4.0)
    want = torch.tensor([1.0, -2.0])
    outputs = {"right": torch.tensor([1.0, -2.01]), "wrong": torch.tensor([1.0, 0.0]),
               "nan": torch.tensor([float("nan"), -2.0])}

    def fails() -> torch.Tensor:
        raise ValueError("does not build")

    def calls_for(tiles: tuple) -> list:
        return [fails if tiles[0] == "raises" else lambda: outputs[tiles[0]]]

    got = sweep_tiles([("right",), ("wrong",), ("nan",), ("raises",)], calls_for, want, nbytes=8000)
    assert got[0] == {"tiles": ("right",), "us": 4.0, "rel_err": 0.005, "gbps": 2.0}
    assert [sorted(g) for g in got[1:]] == [["error", "tiles"]] * 3
    assert got[1]["error"].startswith("AssertionError: 1.0") and got[3]["error"] == "ValueError: does not build"
    assert len(timed) == 1  # only the candidate that passed its check was timed
    assert rel_err(outputs["right"], want) == pytest.approx(0.005)
