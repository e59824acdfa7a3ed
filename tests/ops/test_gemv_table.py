"""The one-row GEMV's launch table (runtime/kernels/gemv.py): what `gemv_tile` hands the kernel per fold mode."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from runtime.kernels import gemv


@pytest.fixture(autouse=True)
def _restore_options():
    before = dict(gemv.OPTIONS)
    yield
    gemv.OPTIONS.clear()
    gemv.OPTIONS.update(before)


@pytest.mark.parametrize("table", [gemv.TILES, gemv.TILES_FOLD], ids=["unfolded", "folded"])
def test_every_entry_tiles_its_matrix_exactly(table: dict) -> None:
    for (elem_bytes, n, k), entry in table.items():
        block_n, block_k, warps = entry[:3]
        assert elem_bytes in (1, 2) and k % block_k == 0 and warps in (4, 8)
        assert block_n & (block_n - 1) == 0 and block_k & (block_k - 1) == 0
        assert len(entry) == (4 if table is gemv.TILES_FOLD else 3)
        if table is gemv.TILES_FOLD:
            assert entry[3] in (1, 2)


def test_table_mode_takes_each_matrix_fold_and_a_forced_mode_overrides_it() -> None:
    key = (1, 4096, 12288)  # FP8 down projection
    block_n, block_k, warps, fold = gemv.TILES_FOLD[key]
    assert gemv.OPTIONS["fold"] == "table"
    assert gemv.gemv_tile(*key) == (block_n, block_k, warps, fold)
    for forced in (1, 2):
        gemv.OPTIONS["fold"] = forced
        assert gemv.gemv_tile(*key) == (block_n, block_k, warps, forced)
    gemv.OPTIONS["fold"] = 0
    assert gemv.gemv_tile(*key) == (*gemv.TILES[key], 0)


def test_matrices_outside_the_table_get_a_tile_of_their_kind() -> None:
    assert gemv.gemv_tile(2, 8192, 4096) == (32, 512, 4, 1)  # N >= K: a projection
    assert gemv.gemv_tile(2, 3072, 4096) == (16, 1024, 8, 1)  # K > N: as a down projection
    gemv.OPTIONS["fold"] = 0
    assert gemv.gemv_tile(2, 200000, 4096) == (16, 512, 4, 0)  # a head, unfolded
    assert gemv.gemv_tile(1, 8192, 4096) == (8, 512, 4, 0)
    assert gemv.gemv_tile(1, 3072, 4096) == (8, 1024, 4, 0)
    gemv.OPTIONS["fold"] = "sometimes"
    with pytest.raises(AssertionError):
        gemv.gemv_tile(2, 3072, 4096)
