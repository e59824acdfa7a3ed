"""bench/dataflow_mlp.py and bench/tma_rows.py's tile-major weights: the layouts the kernels address, the
counters the dataflow bench expects after a launch, and its trace summary. (The kernels need a Hopper GPU;
tests/ops/test_triton_compile.py checks their PTX, and the benches check their products on the GPU.)"""
import pytest
import torch

pytest.importorskip("triton")

from bench import dataflow_mlp, tma_rows


def test_tile_major_makes_every_box_one_contiguous_run():
    """The kernels' box coordinates: box (band r, K tile t) of the copy starts at row (r * K / bk + t) * band."""
    w = torch.arange(256 * 512, dtype=torch.float32).view(256, 512)
    for tiled, band, bk in ((dataflow_mlp.tile_major(w, 128), 64, 128), (tma_rows.tile_major(w, 128, 64), 128, 64)):
        assert tiled.shape == (256 * 512 // bk, bk)
        for r in range(256 // band):
            for t in range(512 // bk):
                row = (r * (512 // bk) + t) * band
                assert torch.equal(tiled[row:row + band], w[r * band:(r + 1) * band, t * bk:(t + 1) * bk])
    assert torch.equal(torch.sort(dataflow_mlp.tile_major(w, 64).flatten()).values, w.flatten())


def test_counters_after_one_launch():
    """Units taken: every unit plus one empty grab per program; each K group of down counts its h tiles, each
    output tile its SPLIT parts, each h tile its gate/up K parts (none counted without a K split)."""
    assert dataflow_mlp.total_units(6, 1) == 192 + 32 * 6
    assert dataflow_mlp.total_units(3, 2) == 384 + 32 * 3
    assert dataflow_mlp.counter_words(6) == 1 + 6 + 32 + 192
    blk = object.__new__(dataflow_mlp.Block)
    blk.split, blk.ksplit_a, blk.grid = 6, 2, 132
    want = blk.expected_counters()
    assert len(want) == dataflow_mlp.counter_words(6)
    assert want[0] == 384 + 192 + 132
    assert want[1:7] == [32] * 6 and want[7:39] == [6] * 32 and want[39:] == [2] * 192
    blk.ksplit_a = 1
    assert blk.expected_counters()[39:] == [0] * 192


def test_trace_summary_reads_the_unit_timeline():
    """Units 0-1 are gate/up's, 2-3 down's; times in ns from the first start."""
    trace = torch.tensor([[0, 1000, 1000, 11000], [1, 1000, 1000, 13000],
                          [0, 11000, 12000, 21000], [1, 13000, 13000, 18000]], dtype=torch.int64)
    got = dataflow_mlp.trace_summary(trace, 2)
    assert got["span_us"] == 20.0 and got["a_end_us"] == 12.0 and got["first_b_start_us"] == 10.0
    assert got["a_unit_us_p10_p50_p90_max"][3] == 12.0 and got["b_unit_us_p10_p50_p90_max"][3] == 10.0
    assert got["b_wait_us_sum"] == 1.0 and got["b_wait_us_p10_p50_p90_max"][3] == 1.0
    assert got["program_last_end_us_p10_p50_p90_max"][3] == 20.0 and got["units_per_program_max"] == 2
