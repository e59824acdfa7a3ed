"""bench/boundary_ceiling.py: the step's byte phases and their layout. (The reader kernel loops to runtime
bounds, which Triton's CPU interpreter here cannot run; the bench checks its sums on the GPU before timing.)"""
from bench.boundary_ceiling import phase_table, step_phases


def test_step_phases_hold_the_steps_bytes():
    phases = step_phases(64, 512)
    assert len(phases) == 40 * 8 + 2
    by_name: dict[str, int] = {}
    for name, nbytes in phases:
        by_name[name] = by_name.get(name, 0) + nbytes
    assert by_name["attention"] == 40 * 64 * 513 * 8 * 128 * 2 * 2
    assert by_name["qkv"] == 40 * (6144 * 4096 * 2 + 64 * 4096 * 2)
    assert by_name["down"] == 40 * (4096 * 12288 * 2 + 64 * 12288 * 2)
    assert by_name["text_head"] == 151680 * 4096 * 2
    assert by_name["audio_head"] == 16512 * 4096 * 2
    weights = sum(by_name[n] for n in ("qkv", "o", "gate_up", "down", "text_head", "audio_head"))
    assert weights - 40 * 64 * (3 * 4096 + 12288) * 2 == 16_812_867_584  # the engine bench's weight_matrix_bytes_bf16


def test_phase_table_lays_phases_end_to_end_in_whole_chunks():
    starts, chunks = phase_table([("a", 256), ("b", 257), ("c", 1)], block=64)  # 128 bytes a chunk
    assert chunks == [2, 3, 1]
    assert starts == [0, 128, 320]

