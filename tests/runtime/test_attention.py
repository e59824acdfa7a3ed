"""AttentionMetadata layout (exact slots), paged attention vs plain causal attention, KV budget helpers."""
from __future__ import annotations

import pytest
import torch

from runtime.attention import (
    AttentionMetadata,
    AttentionMetadataError,
    causal_attention,
    paged_attention,
    write_kv,
)
from runtime.config import ModelConfig
from runtime.kv_cache import (
    FP8_KV_DTYPE,
    KVCacheConfigError,
    allocate_kv_cache,
    kv_bytes_per_block,
    kv_storage_dtype,
    num_blocks_for_budget,
    quantize_rows,
    read_rows,
    store_rows,
)

TINY = ModelConfig.preset("tiny")


def test_build_computes_slots_positions_and_logits_indices() -> None:
    # seq 0: 3 new rows at positions 4..6 (block 5 holds 0..3, block 2 holds 4..7);
    # seq 1: one decode row at position 8 (third block, id 0); seq 2: a fresh 2-row prompt in block 7.
    attn = AttentionMetadata.build([3, 1, 2], [7, 9, 2], [[5, 2], [9, 1, 0], [7]], block_size=4, device="cpu")
    assert attn.slot_mapping.tolist() == [2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 0 * 4 + 0, 7 * 4 + 0, 7 * 4 + 1]
    assert attn.logits_indices.tolist() == [2, 3, 5]
    assert attn.positions().tolist() == [4, 5, 6, 8, 0, 1]
    assert attn.num_rows == 6
    assert attn.decode_rows is not None and attn.decode_rows.tolist() == [3]
    assert attn.decode_key_slots is not None
    assert attn.decode_key_slots.tolist() == [[36, 37, 38, 39, 4, 5, 6, 7, 0]]
    assert [(c.row_start, c.query_len) for c in attn.chunks] == [(0, 3), (4, 2)]
    assert attn.chunks[0].key_slots.tolist() == [20, 21, 22, 23, 8, 9, 10]
    assert attn.chunks[0].mask is not None and attn.chunks[0].mask.sum(dim=1).tolist() == [5, 6, 7]
    assert attn.chunks[1].mask is None  # no earlier context: plain causal


def test_build_without_plain_tensors_keeps_what_the_fast_path_reads() -> None:
    args = ([3, 1, 2], [7, 9, 2], [[5, 2], [9, 1, 0], [7]])
    lean = AttentionMetadata.build(*args, block_size=4, device="cpu", plain_tensors=False)
    assert lean.slot_mapping.tolist() == [8, 9, 10, 0, 28, 29]
    assert lean.logits_indices.tolist() == [2, 3, 5]
    assert lean.positions().tolist() == [4, 5, 6, 8, 0, 1]
    assert lean.decode_rows is None and lean.decode_key_slots is None and lean.chunks == []


def test_decode_padding_is_masked() -> None:
    attn = AttentionMetadata.build([1, 1], [2, 6], [[3], [4, 8]], block_size=4, device="cpu")
    assert attn.decode_key_slots is not None and attn.decode_key_mask is not None
    assert attn.decode_key_mask.tolist() == [[True, True, False, False, False, False],
                                             [True, True, True, True, True, True]]
    assert attn.decode_key_slots[1].tolist() == [16, 17, 18, 19, 32, 33]


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "tables", "message"),
    [
        ([2], [1], [[0]], "need 1 <= query_len <= seq_len"),
        ([0], [3], [[0]], "need 1 <= query_len <= seq_len"),
        ([1], [5], [[0]], "5 positions need 2 blocks of 4, block table has 1"),
        ([1, 1], [1], [[0]], "must have one entry per sequence"),
        ([], [], [], "at least one sequence"),
        ([1], [1], [[-1]], "negative block id"),
    ],
)
def test_build_rejects_inconsistent_steps(
    query_lens: list[int], seq_lens: list[int], tables: list[list[int]], message: str
) -> None:
    with pytest.raises(AttentionMetadataError, match=message):
        AttentionMetadata.build(query_lens, seq_lens, tables, block_size=4, device="cpu")


def test_paged_attention_equals_causal_attention_over_mixed_batch() -> None:
    """Three sequences written in two steps (prefill chunks, then a mixed chunk/decode step) into
    scattered blocks of a cache full of garbage; every row's output equals plain causal attention."""
    torch.manual_seed(0)
    config = TINY.replace(num_shared_layers=1, num_modality_layers=1)
    heads, kv_heads, dim, block = config.num_attention_heads, config.num_key_value_heads, config.head_dim, 4
    cache = allocate_kv_cache(config, 20, block, "cpu", torch.float32)
    cache.k.normal_(0, 50.0)
    cache.v.normal_(0, 50.0)
    layer = 2  # the audio tail's layer: instances 0 and 1 must stay untouched
    before_other = cache.k[:2].clone()
    lengths = [11, 6, 9]
    tables = [[13, 2, 17], [5, 0], [19, 8, 11]]
    q_all = [torch.randn(n, heads, dim) for n in lengths]
    k_all = [torch.randn(n, kv_heads, dim) for n in lengths]
    v_all = [torch.randn(n, kv_heads, dim) for n in lengths]
    done = [0, 0, 0]
    for step in ([7, 5, 9], [4, 1, 0]):
        members = [i for i, n in enumerate(step) if n]
        attn = AttentionMetadata.build(
            [step[i] for i in members], [done[i] + step[i] for i in members], [tables[i] for i in members],
            block, "cpu",
        )
        q = torch.cat([q_all[i][done[i] : done[i] + step[i]] for i in members])  # [N, H, D]
        k = torch.cat([k_all[i][done[i] : done[i] + step[i]] for i in members])  # [N, KV, D]
        v = torch.cat([v_all[i][done[i] : done[i] + step[i]] for i in members])
        write_kv(cache, layer, k, v, attn.slot_mapping)
        out = paged_attention(q, cache, layer, attn)
        row = 0
        for i in members:
            end = done[i] + step[i]
            expected = causal_attention(q_all[i][:end], k_all[i][:end], v_all[i][:end])[done[i] :]
            torch.testing.assert_close(out[row : row + step[i]], expected, atol=1e-5, rtol=1e-5)
            row += step[i]
            done[i] = end
    assert torch.equal(cache.k[:2], before_other)
    assert torch.equal(cache.k[layer].view(-1, kv_heads, dim)[13 * block + 3], k_all[0][3])


def test_causal_attention_gqa_groups_query_heads_onto_kv_heads() -> None:
    torch.manual_seed(1)
    q = torch.randn(3, 4, 8)
    k = torch.randn(3, 2, 8)
    v = torch.randn(3, 2, 8)
    out = causal_attention(q, k, v)
    # Row 0 sees only key 0: output equals v[0] of the head's KV group (heads 0,1 -> kv 0; 2,3 -> kv 1).
    assert torch.allclose(out[0], torch.stack([v[0, 0], v[0, 0], v[0, 1], v[0, 1]]))


def test_kv_budget_helpers() -> None:
    full = ModelConfig.preset("full")
    # 40 layer instances x K,V x 8 heads x 128 dims x 2 bytes = 160 KiB per token in bf16.
    assert kv_bytes_per_block(full, 1, torch.bfloat16) == 160 * 1024
    assert kv_bytes_per_block(full, 16, torch.bfloat16) == 16 * 160 * 1024
    assert kv_bytes_per_block(full, 16, torch.float32) == 32 * 160 * 1024
    assert num_blocks_for_budget(full, 16, torch.bfloat16, 10 * 16 * 160 * 1024 + 5) == 10
    assert num_blocks_for_budget(full, 16, torch.bfloat16, 100) == 0
    with pytest.raises(KVCacheConfigError, match="budget must be >= 0"):
        num_blocks_for_budget(full, 16, torch.bfloat16, -1)
    cache = allocate_kv_cache(TINY, 3, 8, "cpu", torch.float32)
    assert cache.k.shape == (40, 3, 8, 2, 16) and cache.v.shape == (40, 3, 8, 2, 16)
    assert cache.num_blocks == 3 and cache.block_size == 8
    assert cache.k.numel() * 4 * 2 == 3 * kv_bytes_per_block(TINY, 8, torch.float32)
    with pytest.raises(KVCacheConfigError, match="num_blocks must be >= 1"):
        allocate_kv_cache(TINY, 0, 8, "cpu", torch.float32)


def test_fp8_rows_store_codes_and_one_scale_per_position_and_head() -> None:
    """scale = max|row| x float32(1/448), codes = row / scale rounded to e4m3; a zero row keeps scale 0 and
    codes 0; read back, code x scale rounds to the rows' values where e4m3 holds them (bf16 target)."""
    rows = torch.tensor([[[2.0, -1.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]],
                         [[-3.0, 0.1, 1.5, 0.75], [8.0, 8.0, -8.0, 1.0]]])  # [N=2, KV=2, D=4]
    codes, scale = quantize_rows(rows)
    step = torch.tensor(1.0 / 448.0, dtype=torch.float32)
    assert torch.equal(scale, torch.stack([torch.tensor([2.0, 0.0]), torch.tensor([3.0, 8.0])]) * step)
    assert codes.dtype == FP8_KV_DTYPE
    assert codes[0, 0].float().tolist() == [448.0, -224.0, 112.0, 0.0]
    assert codes[0, 1].float().tolist() == [0.0] * 4 and scale[0, 1] == 0
    assert codes[1, 1].float().tolist() == [448.0, 448.0, -448.0, 56.0]
    cache = torch.zeros(3, 4, 2, 4, dtype=FP8_KV_DTYPE)  # [blocks, block_size, KV, D]
    scales = torch.full((3, 2, 4), -1.0)  # [blocks, KV, block_size]; -1 marks what was not written
    store_rows(cache, scales, torch.tensor([9, 2]), rows)  # slot 9 = block 2, offset 1; slot 2 = block 0, offset 2
    assert scales[2, :, 1].tolist() == scale[0].tolist() and scales[0, :, 2].tolist() == scale[1].tolist()
    assert int((scales == -1).sum()) == 3 * 2 * 4 - 4
    back = read_rows(cache, scales, torch.tensor([[9], [2]]), torch.bfloat16)  # [2, 1, KV, D]
    assert back.shape == (2, 1, 2, 4) and back.dtype == torch.bfloat16
    assert back[0, 0].tolist() == [[2.0, -1.0, 0.5, 0.0], [0.0] * 4]
    assert back[1, 0, 1].tolist() == [8.0, 8.0, -8.0, 1.0]
    assert back[1, 0, 0].tolist() == [-3.0, 0.1005859375, 1.5, 0.75]  # 0.1: code 15, 15 x 3/448 = 0.100446 in bf16
    assert torch.equal(read_rows(cache, None, torch.tensor([9]), torch.float32), cache.view(-1, 2, 4)[[9]].float())


def test_paged_attention_over_an_fp8_cache_is_attention_over_its_decoded_rows() -> None:
    """The mixed two-step batch of the bf16 test, into an FP8 cache: each row's output equals plain causal
    attention over the K/V as the cache decodes them (codes x scales)."""
    torch.manual_seed(2)
    config = TINY.replace(num_shared_layers=1, num_modality_layers=1)
    heads, kv_heads, dim, block = config.num_attention_heads, config.num_key_value_heads, config.head_dim, 4
    cache = allocate_kv_cache(config, 12, block, "cpu", FP8_KV_DTYPE)
    assert cache.k_scale is not None and cache.k_scale.shape == (3, 12, kv_heads, block)
    assert set(cache.scales(1)) == {"k_scale", "v_scale"} and cache.scales(1)["v_scale"].shape == (12, kv_heads, block)
    lengths, tables = [9, 5], [[3, 10, 6], [7, 1]]
    q_all = [torch.randn(n, heads, dim) for n in lengths]
    k_all = [torch.randn(n, kv_heads, dim) * 4 for n in lengths]
    v_all = [torch.randn(n, kv_heads, dim) for n in lengths]
    done = [0, 0]
    for step in ([6, 5], [3, 0]):
        members = [i for i, n in enumerate(step) if n]
        attn = AttentionMetadata.build([step[i] for i in members], [done[i] + step[i] for i in members],
                                       [tables[i] for i in members], block, "cpu")
        q = torch.cat([q_all[i][done[i] : done[i] + step[i]] for i in members])
        write_kv(cache, 1, torch.cat([k_all[i][done[i] : done[i] + step[i]] for i in members]),
                 torch.cat([v_all[i][done[i] : done[i] + step[i]] for i in members]), attn.slot_mapping)
        out = paged_attention(q, cache, 1, attn)
        row = 0
        for i in members:
            end = done[i] + step[i]
            slots = torch.tensor([tables[i][p // block] * block + p % block for p in range(end)])
            k = read_rows(cache.k[1], cache.k_scale[1], slots, torch.float32)
            v = read_rows(cache.v[1], cache.v_scale[1], slots, torch.float32)
            assert 0 < float((k - k_all[i][:end]).abs().max()) <= 0.0625 * float(k_all[i][:end].abs().max())
            expected = causal_attention(q_all[i][:end], k, v)[done[i] :]
            torch.testing.assert_close(out[row : row + step[i]], expected, atol=1e-5, rtol=1e-5)
            row += step[i]
            done[i] = end
    assert float(cache.k_scale[0].abs().sum()) == 0 and float(cache.k[0].float().abs().sum()) == 0  # layer 0 untouched


def test_fp8_cache_costs_codes_plus_scales_and_is_named_by_kv_cache_dtype() -> None:
    full = ModelConfig.preset("full")
    # 40 layer instances x K,V x 8 heads x (128 one-byte codes + a 4-byte scale) = 84480 bytes per token
    assert kv_bytes_per_block(full, 1, FP8_KV_DTYPE) == 84480
    assert kv_bytes_per_block(full, 16, FP8_KV_DTYPE) == 16 * 84480
    assert num_blocks_for_budget(full, 16, FP8_KV_DTYPE, 24 * 2**30) == 24 * 2**30 // (16 * 84480) == 19065
    cache = allocate_kv_cache(TINY, 3, 8, "cpu", FP8_KV_DTYPE)
    assert cache.k.element_size() == 1
    assert (cache.k.numel() + cache.v.numel()) + 4 * (cache.k_scale.numel() + cache.v_scale.numel()) == (
        3 * kv_bytes_per_block(TINY, 8, FP8_KV_DTYPE))
    assert allocate_kv_cache(TINY, 3, 8, "cpu", torch.bfloat16).scales(0) == {}
    assert kv_storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_storage_dtype("fp8", torch.float32) == FP8_KV_DTYPE
    with pytest.raises(KVCacheConfigError, match=r"kv_cache_dtype must be one of \('auto', 'fp8'\), got 'int8'"):
        kv_storage_dtype("int8", torch.bfloat16)
