"""bench/gemv_tune.py's interleaved rounds: the order, the options each step runs under, and their restoring."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch

from bench.gemv_tune import _interleaved, parse_settings
from runtime.kernels.gemv import OPTIONS


class _FakeBench:
    """Stands in for StepBench: records the fold mode in force at each step and returns it as the time."""

    def __init__(self) -> None:
        self.seen: list[object] = []

    def step(self, mode: str) -> tuple[float, tuple[torch.Tensor, ...]]:
        self.seen.append(OPTIONS["fold"])
        return float(len(self.seen)), (torch.tensor([float(len(self.seen))]),)


def test_rounds_alternate_their_order_and_the_options_in_force_come_back() -> None:
    before = dict(OPTIONS)
    bench = _FakeBench()
    settings = {"unfolded": {"fold": 0}, "fold2": {"fold": 2}}
    times, first = _interleaved(bench, "fp8_gemv", settings, rounds=3)
    assert bench.seen == [0, 2, 2, 0, 0, 2]
    assert times == {"unfolded": [1.0, 4.0, 5.0], "fold2": [2.0, 3.0, 6.0]}
    assert {k: v[0].item() for k, v in first.items()} == {"unfolded": 1.0, "fold2": 2.0}
    assert OPTIONS == before


def test_settings_parse_digits_as_modes_and_keep_words() -> None:
    assert parse_settings("fold=0;fold=table") == [{"fold": 0}, {"fold": "table"}]
    with pytest.raises(SystemExit, match="unknown GEMV option"):
        parse_settings("prefetch=1")


def test_table_rounds_put_each_table_in_force_and_restore_the_table() -> None:
    """`--confirm-rounds`: the start and the tuned tile tables alternate like option settings, each step runs
    under its own table's tile, and the table in force comes back as it was."""
    from bench.gemv_tune import _interleaved_tables
    from runtime.kernels.gemv import tiles

    key = (1, 6144, 4096)
    table = tiles()
    before = dict(table)
    seen: list[tuple[int, ...]] = []

    class Bench:
        def step(self, mode: str) -> tuple[float, tuple[torch.Tensor, ...]]:
            seen.append(table[key])
            return float(len(seen)), (torch.tensor([float(len(seen))]),)

    start, tuned = (16, 1024, 8, 2), (8, 1024, 8, 2)
    times, first = _interleaved_tables(Bench(), "fp8_gemv", {"start": {key: start}, "tuned": {key: tuned}}, 3)
    assert seen == [start, tuned, tuned, start, start, tuned]
    assert times == {"start": [1.0, 4.0, 5.0], "tuned": [2.0, 3.0, 6.0]}
    assert {k: v[0].item() for k, v in first.items()} == {"start": 1.0, "tuned": 2.0}
    assert tiles() is table and table == before
