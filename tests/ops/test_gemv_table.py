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


def test_prologue_launch_reads_the_norm_row_whole_per_weight_type() -> None:
    """"auto": bf16 weights read the row whole with the first tile's load ahead of it, FP8 weights the row
    whole alone; the other modes as named; only the RMSNorm prologue over a power-of-two K up to
    MAX_WHOLE_K reads whole, everything else loops."""
    assert gemv.OPTIONS["prologue"] == "auto"
    assert gemv.prologue_launch(gemv.RMSNORM, 4096, 2) == {"WHOLE_K": 4096, "FIRST_W": True}
    assert gemv.prologue_launch(gemv.RMSNORM, 4096, 1) == {"WHOLE_K": 4096, "FIRST_W": False}
    assert gemv.prologue_launch(gemv.RMSNORM, 4096, 4) == {"WHOLE_K": 4096, "FIRST_W": True}  # float32 checks
    for prologue in (gemv.NONE, gemv.SILU_MUL):
        assert gemv.prologue_launch(prologue, 4096, 2) == {"WHOLE_K": 0, "FIRST_W": False}
    assert gemv.prologue_launch(gemv.RMSNORM, 12288, 2) == {"WHOLE_K": 0, "FIRST_W": False}  # not a power of two
    assert gemv.prologue_launch(gemv.RMSNORM, 2 * gemv.MAX_WHOLE_K, 1) == {"WHOLE_K": 0, "FIRST_W": False}
    assert gemv.prologue_launch(gemv.RMSNORM, gemv.MAX_WHOLE_K, 1) == {"WHOLE_K": gemv.MAX_WHOLE_K, "FIRST_W": False}
    expected = {"loop": (0, False), "whole": (4096, False), "whole_w": (4096, True)}
    for mode, (whole_k, first_w) in expected.items():
        gemv.OPTIONS["prologue"] = mode
        for elem in (1, 2):
            assert gemv.prologue_launch(gemv.RMSNORM, 4096, elem) == {"WHOLE_K": whole_k, "FIRST_W": first_w}
    gemv.OPTIONS["prologue"] = "whole_x"
    with pytest.raises(ValueError, match="prologue"):
        gemv.prologue_launch(gemv.RMSNORM, 4096, 2)
