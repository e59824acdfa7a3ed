"""The paged forward equals the no-cache reference; embedding rule, RoPE theta and debug checks."""
from __future__ import annotations

import random

import pytest
import torch

from runtime.attention import AttentionMetadata
from runtime.config import MODALITY_PAD_ID, ModelConfig, Row
from runtime.kv_cache import KVCache, allocate_kv_cache
from runtime.layers import apply_rotary, rotary_cos_sin
from runtime.model import ModelCheckError, MossSpeechForCausalLM, build_model, split_rows

BLOCK_SIZE = 4
ATOL, RTOL = 2e-5, 1e-4
# Small layer counts keep the tests fast; the full 32 + 4 + 4 layout is covered by test_weights.py.
CONFIG = ModelConfig.preset("tiny").replace(num_shared_layers=2, num_modality_layers=2)


@pytest.fixture(scope="module")
def model() -> MossSpeechForCausalLM:
    return build_model(CONFIG, seed=0)


def make_rows(length: int, seed: int) -> list[Row]:
    """Rows mixing text rows (real and special ids) and audio rows (modality pad + code)."""
    rng = random.Random(seed)
    rows: list[Row] = []
    for _ in range(length):
        if rng.random() < 0.5:
            rows.append((MODALITY_PAD_ID, rng.randrange(16385)))
        else:
            rows.append((rng.choice([rng.randrange(256), 151644, 151646, rng.randrange(151680)]), 512))
    return rows


def noisy_cache(num_blocks: int) -> KVCache:
    """A cache whose unwritten slots hold large finite garbage, so a read outside a sequence's own
    written positions would change the logits."""
    cache = allocate_kv_cache(CONFIG, num_blocks, BLOCK_SIZE, "cpu", torch.float32)
    gen = torch.Generator().manual_seed(123)
    cache.k.normal_(0.0, 100.0, generator=gen)
    cache.v.normal_(0.0, 100.0, generator=gen)
    return cache


class Pool:
    """Hands out shuffled, non-contiguous block ids (test-side stand-in for a block manager)."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def grow(self, table: list[int], seq_len: int) -> None:
        while len(table) * BLOCK_SIZE < seq_len:
            table.append(self.free.pop())


def step(
    model: MossSpeechForCausalLM, cache: KVCache, work: list[tuple[list[Row], int, list[int]]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run one paged step; work = (all rows of the sequence so far, number of new rows, block table)."""
    new_rows = [row for rows, n, _ in work for row in rows[len(rows) - n :]]
    tokens, is_audio = split_rows(new_rows)
    attn = AttentionMetadata.build(
        [n for _, n, _ in work], [len(rows) for rows, _, _ in work], [t for _, _, t in work], BLOCK_SIZE, "cpu"
    )
    return model(tokens, is_audio, attn.positions(), cache, attn)


def assert_matches_reference(
    model: MossSpeechForCausalLM, rows: list[Row], text: torch.Tensor, audio: torch.Tensor
) -> None:
    ref_text, ref_audio = model.reference_forward(rows)
    torch.testing.assert_close(text, ref_text[-1], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(audio, ref_audio[-1], atol=ATOL, rtol=RTOL)


def test_prompt_in_one_chunk(model: MossSpeechForCausalLM) -> None:
    rows = make_rows(23, seed=1)
    cache, pool, table = noisy_cache(16), Pool(16, seed=1), []
    pool.grow(table, len(rows))
    noise_k = cache.k.clone()
    text, audio = step(model, cache, [(rows, len(rows), table)])
    # Every layer instance (shared, text tail, audio tail) wrote K at exactly the sequence's 23 slots.
    changed = (cache.k != noise_k).any(dim=-1).any(dim=-1).flatten(1)  # [L, num_slots]
    slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(len(rows))]
    assert changed.shape[0] == CONFIG.num_layer_instances == 6
    for layer in range(CONFIG.num_layer_instances):
        assert changed[layer].nonzero().flatten().tolist() == sorted(slots)
    assert text.shape == (1, CONFIG.vocab_size) and audio.shape == (1, CONFIG.audio_vocab_size)
    assert text.dtype == torch.float32 and audio.dtype == torch.float32
    assert_matches_reference(model, rows, text[0], audio[0])


def test_prompt_in_several_chunks(model: MossSpeechForCausalLM) -> None:
    rows = make_rows(30, seed=2)
    cache, pool, table = noisy_cache(16), Pool(16, seed=2), []
    done = 0
    for chunk in (7, 1, 9, 13):  # chunk boundaries inside and across blocks
        done += chunk
        pool.grow(table, done)
        text, audio = step(model, cache, [(rows[:done], chunk, table)])
        assert_matches_reference(model, rows[:done], text[0], audio[0])


def greedy_row(text_logits: torch.Tensor, audio_logits: torch.Tensor, index: int) -> Row:
    """Greedy next row; every other step is forced into an audio row so both tables are exercised."""
    audio = int(audio_logits.argmax())
    if index % 2 == 0:
        return (MODALITY_PAD_ID, audio)
    return (int(text_logits.argmax()), audio)


def test_decode_steps_match_reference_and_greedy_tokens_agree(model: MossSpeechForCausalLM) -> None:
    prompt = make_rows(9, seed=3)
    cache, pool, table = noisy_cache(16), Pool(16, seed=3), []
    pool.grow(table, len(prompt))
    text, audio = step(model, cache, [(prompt, len(prompt), table)])
    paged_rows = list(prompt)
    for i in range(8):
        paged_rows.append(greedy_row(text[0], audio[0], i))
        pool.grow(table, len(paged_rows))
        text, audio = step(model, cache, [(paged_rows, 1, table)])
        assert_matches_reference(model, paged_rows, text[0], audio[0])
    # The same greedy loop on the reference alone produces the identical row sequence.
    ref_rows = list(prompt)
    for i in range(8):
        ref_text, ref_audio = model.reference_forward(ref_rows)
        ref_rows.append(greedy_row(ref_text[-1], ref_audio[-1], i))
    assert ref_rows == paged_rows
    assert any(r[0] == MODALITY_PAD_ID for r in paged_rows[9:]) and any(r[0] != MODALITY_PAD_ID for r in paged_rows[9:])


def test_mixed_batch_with_shuffled_blocks(model: MossSpeechForCausalLM) -> None:
    seqs = [make_rows(n, seed=10 + n) for n in (21, 30, 5, 13)]
    cache, pool = noisy_cache(48), Pool(48, seed=4)
    tables: list[list[int]] = [[] for _ in seqs]
    done = [0, 0, 0, 0]
    # (new rows per sequence) per step: whole prompts, partial chunks and decodes in the same batch.
    plan = [(21, 7, 5, 0), (1, 23, 1, 6), (1, 0, 1, 7), (1, 1, 1, 1)]
    for step_rows in plan:
        work, members = [], []
        for i, n in enumerate(step_rows):
            if n == 0:
                continue
            if done[i] + n > len(seqs[i]):
                seqs[i].append((int(seqs[i][-1][0]) % 200, 77))  # a decode row beyond the prompt
            done[i] += n
            pool.grow(tables[i], done[i])
            work.append((seqs[i][: done[i]], n, tables[i]))
            members.append(i)
        text, audio = step(model, cache, work)
        assert text.shape == (len(members), CONFIG.vocab_size)
        for j, i in enumerate(members):
            assert_matches_reference(model, seqs[i][: done[i]], text[j], audio[j])
    flat = [b for t in tables for b in t]
    assert len(flat) == len(set(flat)) and flat != sorted(flat)


def test_text_row_embeds_text_table_and_audio_row_embeds_audio_table(model: MossSpeechForCausalLM) -> None:
    rows = [(5, 900), (MODALITY_PAD_ID, 900), (151646, 3), (MODALITY_PAD_ID, 16384)]
    tokens, is_audio = split_rows(rows)
    assert tokens.tolist() == [5, 900, 151646, 16384]
    assert is_audio.tolist() == [False, True, False, True]
    emb = model.model.embed(tokens, is_audio)
    text_table, audio_table = model.model.embed_tokens.weight, model.model.audio_embed.weight
    expected = torch.stack([text_table[5], audio_table[900], text_table[151646], audio_table[16384]])
    assert torch.equal(emb, expected)
    # The audio id of a text row is ignored as input.
    a_text, a_audio = model.reference_forward([(5, 900), (7, 1)])
    b_text, b_audio = model.reference_forward([(5, 11), (7, 2)])
    assert torch.equal(a_text, b_text) and torch.equal(a_audio, b_audio)


def test_rope_theta_comes_from_config() -> None:
    rows = make_rows(6, seed=5)
    small = CONFIG.replace(num_shared_layers=1, num_modality_layers=1)
    a = build_model(small, seed=7)
    b = build_model(small.replace(rope_theta=10000.0), seed=7)
    a_text, _ = a.reference_forward(rows)
    b_text, _ = b.reference_forward(rows)
    assert torch.equal(a_text[0], b_text[0])  # position 0: rotation by angle 0 for any theta
    assert not torch.allclose(a_text[1:], b_text[1:], atol=1e-4)


def test_rotary_frequencies_use_theta() -> None:
    cos, sin = rotary_cos_sin(torch.tensor([0, 1, 3]), head_dim=4, theta=100.0, dtype=torch.float32)
    inv_freq = torch.tensor([1.0, 0.1])  # 1 / 100 ** (0/4), 1 / 100 ** (2/4)
    angles = torch.tensor([0.0, 1.0, 3.0])[:, None] * inv_freq  # [3, 2]
    torch.testing.assert_close(cos, torch.cat([angles.cos(), angles.cos()], dim=1))
    torch.testing.assert_close(sin, torch.cat([angles.sin(), angles.sin()], dim=1))
    # rotate_half convention: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) per frequency pair.
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]]).expand(3, 1, 4)  # [N, heads, D]
    out = apply_rotary(x, cos, sin)
    a = angles[2]
    expected = torch.tensor([1 * a[0].cos() - 3 * a[0].sin(), 2 * a[1].cos() - 4 * a[1].sin(),
                             3 * a[0].cos() + 1 * a[0].sin(), 4 * a[1].cos() + 2 * a[1].sin()])
    torch.testing.assert_close(out[2, 0], expected)
    torch.testing.assert_close(out[0, 0], x[0, 0])


def test_weights_are_deterministic_per_seed() -> None:
    small = CONFIG.replace(num_shared_layers=1, num_modality_layers=1)
    a, b, c = build_model(small, seed=1), build_model(small, seed=1), build_model(small, seed=2)
    key = "model.shared_block.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a.state_dict()[key], b.state_dict()[key])
    assert not torch.equal(a.state_dict()[key], c.state_dict()[key])
    assert torch.equal(a.state_dict()["model.text_norm.weight"], torch.ones(CONFIG.hidden_size))


def test_debug_checks_catch_nan_weights() -> None:
    small = CONFIG.replace(num_shared_layers=1, num_modality_layers=1)
    model = build_model(small, seed=0, debug_checks=True)
    rows = make_rows(4, seed=6)
    model.reference_forward(rows)  # finite: passes
    with torch.no_grad():
        model.audio_lm_head.weight[3, 0] = float("nan")
    with pytest.raises(ModelCheckError, match="audio logits contain 4 non-finite"):
        model.reference_forward(rows)


def test_debug_checks_reject_out_of_range_ids() -> None:
    small = CONFIG.replace(num_shared_layers=1, num_modality_layers=1)
    model = build_model(small, seed=0, debug_checks=True)
    with pytest.raises(ValueError, match="audio token ids must lie in"):
        model.reference_forward([(MODALITY_PAD_ID, 16512)])
