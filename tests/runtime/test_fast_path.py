"""The fast path (fused weights, fused ops, graph-runner padding) computes what the plain model does.

Runs on CPU with the PyTorch ops backend; the Triton kernels and CUDA graphs are checked against the
same references on the GPU by bench/gpu_check.py.
"""
from __future__ import annotations

import random

import pytest
import torch

from runtime.attention import AttentionMetadata
from runtime.config import MODALITY_PAD_ID, ModelConfig, Row
from runtime.cuda_graph import DecodeGraphRunner, PrefillGraphRunner
from runtime.fast_forward import FastForward, StepInputs
from runtime.fast_ops import TorchOps
from runtime.fp8 import FP8_MAX, Fp8Weight, quantize_weight
from runtime.fused import fuse_model_weights, quantize_model_in_place, with_fp8
from runtime.kv_cache import FP8_KV_DTYPE, KVCache, allocate_kv_cache
from runtime.model import MossSpeechForCausalLM, build_model, split_rows

BLOCK_SIZE = 4
CONFIG = ModelConfig.preset("tiny").replace(num_shared_layers=2, num_modality_layers=2)


def make_rows(length: int, seed: int) -> list[Row]:
    rng = random.Random(seed)
    return [
        (MODALITY_PAD_ID, rng.randrange(16384)) if rng.random() < 0.5 else (rng.randrange(151643), 512)
        for _ in range(length)
    ]


@pytest.fixture(scope="module")
def model() -> MossSpeechForCausalLM:
    return build_model(CONFIG, seed=0)


def test_fusion_keeps_names_values_and_memory(model: MossSpeechForCausalLM) -> None:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    weights = fuse_model_weights(model)
    after = model.state_dict()
    assert list(after) == list(before)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    attn = model.model.shared_block.layers[1].self_attn
    qkv = weights.shared[1].qkv
    assert isinstance(qkv, torch.Tensor) and qkv.shape == (4 * 16 + 2 * 2 * 16, 64)
    # the q/k/v parameters are views of the fused buffer: one storage, no copy
    assert attn.q_proj.weight.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    assert attn.v_proj.weight.data_ptr() == qkv[4 * 16 + 2 * 16 :].data_ptr()
    # fusing again is free and returns the same buffers
    again = fuse_model_weights(model)
    assert again.shared[1].qkv.data_ptr() == qkv.data_ptr()
    assert again.text[0].gate_up.data_ptr() == weights.text[0].gate_up.data_ptr()


def _plain_step(model: MossSpeechForCausalLM, cache: KVCache, work: list[tuple[list[Row], int, list[int]]]):
    new_rows = [r for rows, n, _ in work for r in rows[len(rows) - n :]]
    tokens, is_audio = split_rows(new_rows)
    attn = AttentionMetadata.build([n for _, n, _ in work], [len(r) for r, _, _ in work],
                                   [t for _, _, t in work], BLOCK_SIZE, "cpu")
    return tokens, is_audio, attn.positions("cpu"), attn


def _two_sequence_steps() -> list[list[tuple[list[Row], int, list[int]]]]:
    """Three steps of two sequences (rows, new rows, block table): both prompts, a chunked prefill over
    earlier pages beside a decode row, a pure decode step."""
    a, b = make_rows(11, 1), make_rows(6, 2)
    table_a, table_b = [7, 3, 12, 5], [20, 9]
    return [
        [(a[:7], 7, table_a), (b[:5], 5, table_b)],
        [(a, 4, table_a), (b[:6], 1, table_b)],
        [(a + b[:1], 1, table_a), (b + a[:1], 1, table_b)],
    ]


def test_fast_step_matches_plain_step_prefill_chunk_and_decode(model: MossSpeechForCausalLM) -> None:
    fast = FastForward(fuse_model_weights(model), TorchOps())
    plain_cache = allocate_kv_cache(CONFIG, 32, BLOCK_SIZE, "cpu", torch.float32)
    fast_cache = allocate_kv_cache(CONFIG, 32, BLOCK_SIZE, "cpu", torch.float32)
    for work in _two_sequence_steps():
        tokens, is_audio, positions, attn = _plain_step(model, plain_cache, work)
        want_t, want_a = model(tokens, is_audio, positions, plain_cache, attn)
        got_t, got_a = fast(StepInputs.from_metadata(tokens, is_audio, positions, attn), fast_cache)
        assert got_t.shape == want_t.shape == (2, CONFIG.vocab_size) and got_t.dtype == torch.float32
        torch.testing.assert_close(got_t, want_t, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(got_a, want_a, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(fast_cache.k, plain_cache.k, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fast_cache.v, plain_cache.v, atol=1e-6, rtol=1e-5)


def test_fast_step_on_fp8_caches_stores_the_plain_steps_codes_and_scales(model: MossSpeechForCausalLM) -> None:
    """The three steps (prefill chunks, a chunk beside a decode row, decode) on FP8 caches: the PyTorch ops
    quantize as the plain path does (runtime/kv_cache.py), so they store its codes, and its scales up to the
    last float32 bits the rows themselves differ by (the fused QKV product rounds in another order: a few
    units in the last place, how many depends on the CPU's matmul kernels; 2 on one of our machines, so the
    bound is 1e-6, ~8 units); the logits agree as on float32 caches."""
    fast = FastForward(fuse_model_weights(model), TorchOps())
    plain_cache, fast_cache = (allocate_kv_cache(CONFIG, 32, BLOCK_SIZE, "cpu", FP8_KV_DTYPE) for _ in range(2))
    for work in _two_sequence_steps():
        tokens, is_audio, positions, attn = _plain_step(model, plain_cache, work)
        want = model(tokens, is_audio, positions, plain_cache, attn)
        got = fast(StepInputs.from_metadata(tokens, is_audio, positions, attn), fast_cache)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4)
    assert torch.equal(fast_cache.k.view(torch.uint8), plain_cache.k.view(torch.uint8))
    assert torch.equal(fast_cache.v.view(torch.uint8), plain_cache.v.view(torch.uint8))
    torch.testing.assert_close(fast_cache.k_scale, plain_cache.k_scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(fast_cache.v_scale, plain_cache.v_scale, rtol=1e-6, atol=0)
    assert int((plain_cache.k_scale > 0).sum()) == CONFIG.num_layer_instances * CONFIG.num_key_value_heads * 19


def test_bfloat16_step_returns_bfloat16_logits_unless_float_logits() -> None:
    """Steps through the cuBLAS-style heads return the activation dtype (the sampler widens them); with
    `float_logits` the same values come back widened inside the step (two prompts, fresh caches)."""
    bf16_model = build_model(CONFIG, seed=0, dtype=torch.bfloat16)
    weights = fuse_model_weights(bf16_model)
    low, wide = FastForward(weights, TorchOps()), FastForward(weights, TorchOps(), float_logits=True)
    work = _two_sequence_steps()[0]
    caches = [allocate_kv_cache(CONFIG, 32, BLOCK_SIZE, "cpu", torch.bfloat16) for _ in range(2)]
    tokens, is_audio, positions, attn = _plain_step(bf16_model, caches[0], work)
    step = StepInputs.from_metadata(tokens, is_audio, positions, attn)
    got, want = low(step, caches[0]), wide(step, caches[1])
    for g, w, vocab in zip(got, want, (CONFIG.vocab_size, CONFIG.audio_vocab_size), strict=True):
        assert g.dtype == torch.bfloat16 and w.dtype == torch.float32 and g.shape == w.shape == (2, vocab)
        assert torch.equal(g.float(), w)


def _greedy(step_fn, prompt: list[Row], steps: int) -> list[Row]:
    rows = list(prompt)
    text, audio = step_fn(rows, len(rows))
    for i in range(steps):
        a = int(audio[0].argmax())
        rows.append((MODALITY_PAD_ID, a) if i % 2 == 0 else (int(text[0].argmax()), a))
        text, audio = step_fn(rows, 1)
    return rows[len(prompt) :]


def test_graph_runner_greedy_tokens_equal_plain_path(model: MossSpeechForCausalLM) -> None:
    """Greedy decode through the padded decode runner (bucket 4 for 1 sequence) == the plain model."""
    prompt, table = make_rows(9, 5), [4, 1, 6, 2, 8, 3]
    plain_cache = allocate_kv_cache(CONFIG, 10, BLOCK_SIZE, "cpu", torch.float32)
    fast_cache = allocate_kv_cache(CONFIG, 10, BLOCK_SIZE, "cpu", torch.float32)
    fast = FastForward(fuse_model_weights(model), TorchOps())
    runner = DecodeGraphRunner(fast, fast_cache, max_model_len=24, buckets=(4, 8))
    assert not runner.use_graphs and runner.bucket_for(1) == 4 and runner.bucket_for(5) == 8

    def plain(rows: list[Row], n: int):
        tokens, is_audio, positions, attn = _plain_step(model, plain_cache, [(rows, n, table)])
        return model(tokens, is_audio, positions, plain_cache, attn)

    def fast_step(rows: list[Row], n: int):
        tokens, is_audio, positions, attn = _plain_step(model, fast_cache, [(rows, n, table)])
        if n > 1:
            return fast(StepInputs.from_metadata(tokens, is_audio, positions, attn), fast_cache)
        text, audio = runner.run(tokens, is_audio, positions, attn.slot_mapping,
                                 torch.tensor([table[: attn.seq_lens[0] // BLOCK_SIZE + 1]], dtype=torch.int32),
                                 torch.tensor(attn.seq_lens, dtype=torch.int32))
        assert text.shape == (1, CONFIG.vocab_size) and audio.shape == (1, CONFIG.audio_vocab_size)
        return text, audio

    want = _greedy(plain, prompt, 12)
    got = _greedy(fast_step, prompt, 12)
    assert got == want
    assert len(got) == 12 and all(r[0] == MODALITY_PAD_ID for r in got[::2])
    # padding rows (slot -1, reading block 0) never wrote into the cache: blocks outside the table stay 0
    for unused in (0, 5, 7, 9):
        assert not fast_cache.k[:, unused].any() and not fast_cache.v[:, unused].any()
    torch.testing.assert_close(fast_cache.k, plain_cache.k, atol=1e-5, rtol=1e-4)


def test_graph_runner_host_inputs_equal_device_inputs(model: MossSpeechForCausalLM) -> None:
    """`run_host` (a step's inputs written into the host mirror of one input buffer) gives the logits, the
    cache writes and the static inputs `run` (device tensors per input) gives, padding rows included, also
    after a larger batch left other values in the rows a smaller one pads."""
    fast = FastForward(fuse_model_weights(model), TorchOps())
    caches = [allocate_kv_cache(CONFIG, 12, BLOCK_SIZE, "cpu", torch.float32) for _ in range(2)]
    for cache in caches:
        cache.k.normal_(generator=torch.Generator().manual_seed(3))
        cache.v.normal_(generator=torch.Generator().manual_seed(4))
    runners = [DecodeGraphRunner(fast, cache, max_model_len=24, buckets=(4, 8)) for cache in caches]
    steps = [  # (tokens, is_audio, positions, block tables, seq lens) per step
        ([5, 9, 2, 7, 1], [False, True, True, False, True], [6, 3, 9, 4, 2],
         [[3, 1], [4], [6, 2, 8], [5, 7], [9]], [7, 4, 10, 5, 3]),
        ([11, 4], [True, False], [7, 10], [[3, 1], [6, 2, 8]], [8, 11]),
    ]
    for tokens, is_audio, positions, tables, lens in steps:
        slots = [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for t, p in zip(tables, positions)]
        width = max(len(t) for t in tables)
        got = runners[0].run_host(tokens, is_audio, positions, slots, tables, lens)
        want = runners[1].run(torch.tensor(tokens), torch.tensor(is_audio), torch.tensor(positions),
                              torch.tensor(slots), torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                                                dtype=torch.int32),
                              torch.tensor(lens, dtype=torch.int32))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=0, rtol=0)
        bucket = runners[0].bucket_for(len(lens))
        for name in ("tokens", "is_audio", "positions", "slot_mapping", "seq_lens"):
            assert torch.equal(getattr(runners[0], name)[:bucket], getattr(runners[1], name)[:bucket]), name
        assert torch.equal(runners[0].block_tables[:bucket], runners[1].block_tables[:bucket])
        assert runners[0].slot_mapping[len(lens):].eq(-1).all() and runners[0].seq_lens[len(lens):].eq(1).all()
    torch.testing.assert_close(caches[0].k, caches[1].k, atol=0, rtol=0)
    torch.testing.assert_close(caches[0].v, caches[1].v, atol=0, rtol=0)


def test_prefill_runner_pads_to_bucket_and_matches_plain(model: MossSpeechForCausalLM) -> None:
    """A prompt (7 rows -> bucket 8, one padding row) then a chunk over its pages (4 rows -> bucket 4,
    no padding): last-row logits and the cache equal the plain model's; padding wrote nothing."""
    rows, table = make_rows(11, 9), [3, 6, 1]
    plain_cache = allocate_kv_cache(CONFIG, 8, BLOCK_SIZE, "cpu", torch.float32)
    fast_cache = allocate_kv_cache(CONFIG, 8, BLOCK_SIZE, "cpu", torch.float32)
    runner = PrefillGraphRunner(FastForward(fuse_model_weights(model), TorchOps()), fast_cache, max_model_len=16,
                                buckets=(4, 8))
    for end, n in ((7, 7), (11, 4)):
        tokens, is_audio, positions, attn = _plain_step(model, plain_cache, [(rows[:end], n, table)])
        want_t, want_a = model(tokens, is_audio, positions, plain_cache, attn)
        got_t, got_a = runner.run(tokens, is_audio, positions, attn.slot_mapping,
                                  torch.tensor(table, dtype=torch.int32), end)
        assert got_t.shape == (1, CONFIG.vocab_size) and got_a.shape == (1, CONFIG.audio_vocab_size)
        torch.testing.assert_close(got_t, want_t, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(got_a, want_a, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(fast_cache.k, plain_cache.k, atol=1e-5, rtol=1e-4)
    for unused in (0, 2, 4, 5, 7):
        assert not fast_cache.k[:, unused].any() and not fast_cache.v[:, unused].any()


def test_prefill_buckets_stop_at_the_largest_chunk_and_capture_within_the_block_table(
        model: MossSpeechForCausalLM) -> None:
    """A bucket is captured as one sequence of its rows: beyond max_model_len its kernel read past the block
    table (max_model_len 512 with the default buckets up to 2048), and beyond the step budget it was never
    replayed but sized the graph pool. The largest chunk becomes the top bucket where it falls between two."""
    cache = allocate_kv_cache(CONFIG, 8, BLOCK_SIZE, "cpu", torch.float32)
    fast = FastForward(fuse_model_weights(model), TorchOps())
    assert PrefillGraphRunner(fast, cache, max_model_len=600).buckets[-3:] == [448, 512, 600]
    assert PrefillGraphRunner(fast, cache, max_model_len=4096, max_chunk_rows=512).buckets[-2:] == [448, 512]
    assert PrefillGraphRunner(fast, cache, max_model_len=4096, max_chunk_rows=1000, buckets=(64, 384)).buckets == [
        64, 384]
    runner = PrefillGraphRunner(fast, cache, max_model_len=72, buckets=(32, 64, 128))
    assert runner.buckets == [32, 64, 72] and runner.max_blocks == 18
    for bucket in runner.buckets:  # what `capture` runs for each bucket (the eager call off CUDA)
        runner.slot_mapping.fill_(-1)
        runner._fill(bucket, bucket, bucket)
        text, _ = runner.forward(runner._step(bucket), cache)
        assert text.shape[0] == 2 and bool(torch.isfinite(text).all())


def test_default_prefill_buckets_bound_the_padding(model: MossSpeechForCausalLM) -> None:
    """Every chunk of 1..2048 rows runs in the smallest default bucket that holds it, padded by at most
    63 rows or a quarter of its rows: 384 rows (a 512-token prompt past a 128-token cached prefix) no
    longer run as 512."""
    cache = allocate_kv_cache(CONFIG, 8, BLOCK_SIZE, "cpu", torch.float32)
    runner = PrefillGraphRunner(FastForward(fuse_model_weights(model), TorchOps()), cache, max_model_len=4096)
    assert runner.max_rows == 2048 and not runner.use_graphs
    assert [runner.bucket_for(n) for n in (1, 64, 65, 384, 385, 513, 1025, 2047, 2048)] == [
        64, 64, 128, 384, 448, 640, 1280, 2048, 2048]
    for n in range(1, 2049):
        bucket = runner.bucket_for(n)
        assert bucket >= n and bucket - n <= max(63, n // 4)
        assert not any(n <= b < bucket for b in runner.buckets)
    for bad in (0, 2049):
        with pytest.raises(ValueError, match="outside 1..2048"):
            runner.bucket_for(bad)


def test_quantize_weight_per_channel() -> None:
    w = torch.tensor([[1.0, -2.0, 0.5, 0.0], [0.001, 0.002, -0.004, 0.003]])
    q = quantize_weight(w)
    assert isinstance(q, Fp8Weight) and q.weight.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(q.scale, torch.tensor([2.0 / FP8_MAX, 0.004 / FP8_MAX]))
    assert float(q.weight.float().abs().amax(dim=1).min()) == FP8_MAX  # each row uses the full range
    torch.testing.assert_close(q.dequantize(torch.float32), w, atol=0.0, rtol=0.07)


def test_fp8_scopes_and_bytes(model: MossSpeechForCausalLM) -> None:
    weights = fuse_model_weights(model)
    shared_only = with_fp8(weights, "shared")
    assert isinstance(shared_only.shared[0].down, Fp8Weight) and isinstance(shared_only.text[0].down, torch.Tensor)
    every = with_fp8(weights, "all")
    assert isinstance(every.text_head, Fp8Weight) and isinstance(every.audio[1].qkv, Fp8Weight)
    # float32 tiny: 4 bytes -> 1 byte per element plus a float32 scale per output row
    rows = sum(w.shape[0] for layer in (*weights.shared, *weights.text, *weights.audio)
               for w in layer.matrices().values()) + CONFIG.vocab_size + CONFIG.audio_vocab_size
    assert every.matrix_bytes() == weights.matrix_bytes() // 4 + 4 * rows
    with pytest.raises(ValueError, match="fp8 scope"):
        with_fp8(weights, "heads")


def test_pdl_row_limit_is_sixteen_rows_for_fp8_layers_and_thirty_two_otherwise(model: MossSpeechForCausalLM) -> None:
    weights = fuse_model_weights(model)
    assert FastForward(weights, TorchOps()).pdl_max_rows == 32
    assert FastForward(with_fp8(weights, "shared"), TorchOps()).pdl_max_rows == 16  # beyond: cuBLAS's FP8 products
    assert FastForward(with_fp8(weights, "all"), TorchOps(), pdl_max_rows=8).pdl_max_rows == 8


def test_quantize_model_in_place_releases_bf16_and_matches_with_fp8() -> None:
    reference = FastForward(with_fp8(fuse_model_weights(build_model(CONFIG, seed=3)), "layers"), TorchOps())
    model = build_model(CONFIG, seed=3)
    fast = FastForward(quantize_model_in_place(model, "layers"), TorchOps())
    layer = model.model.text_block.layers[0]
    assert layer.self_attn.q_proj.weight.numel() == 0 and layer.mlp.down_proj.weight.numel() == 0
    assert model.text_lm_head.weight.shape == (CONFIG.vocab_size, 64)  # heads stay bf16 with "layers"
    assert isinstance(fast.weights.audio[1].gate_up, Fp8Weight)
    rows = make_rows(6, 4)
    cache_a = allocate_kv_cache(CONFIG, 4, BLOCK_SIZE, "cpu", torch.float32)
    cache_b = allocate_kv_cache(CONFIG, 4, BLOCK_SIZE, "cpu", torch.float32)
    tokens, is_audio, positions, attn = _plain_step(model, cache_a, [(rows, 6, [2, 0])])
    step = StepInputs.from_metadata(tokens, is_audio, positions, attn)
    for got, want in zip(fast(step, cache_a), reference(step, cache_b), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(("scope", "device"), [("layers", None), ("all", "cpu")])
def test_quantization_fuses_one_layer_at_a_time(monkeypatch: pytest.MonkeyPatch, scope: str, device: str | None) -> None:
    """Each layer's q/k/v and gate/up are fused only when that layer is quantized, and its bf16 matrices are
    released before the next layer is fused: the host holds one layer's fused copies at a time, not the whole
    model's (a staged checkpoint stays in its file mappings until then)."""
    import runtime.fused as fused_mod

    model = build_model(CONFIG, seed=3)
    layers = [layer for block in (model.model.shared_block, model.model.text_block, model.model.audio_block)
              for layer in block.layers]

    def fused_layers() -> list[int]:
        return [layer.layer_idx for layer in layers
                if fused_mod._already_fused([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                                             layer.self_attn.v_proj.weight])
                and layer.self_attn.q_proj.weight.numel() > 0]

    seen = []
    quantize = fused_mod.quantize_weight
    monkeypatch.setattr(fused_mod, "quantize_weight", lambda w: seen.append(tuple(fused_layers())) or quantize(w))
    quantize_model_in_place(model, scope, device)
    # qkv, o, gate_up and down of the layer being quantized; then both heads, every layer released by then
    heads = [()] * 2 if scope == "all" else []
    assert seen == [(layer.layer_idx,) for layer in layers for _ in range(4)] + heads
    assert fused_layers() == []


@pytest.mark.parametrize("scope", ["shared", "all"])
def test_staged_quantization_moves_everything_but_the_matrices_it_quantizes(scope: str) -> None:
    """With a target device, quantize_model_in_place first moves every tensor that stays in its dtype (here to
    the meta device, so the selection is visible): exactly the linears of `scope` wait on the host, to go to
    the device one matrix at a time. Then, staged onto the same device, the result equals the unstaged one."""
    from runtime.fused import _move_all_but_quantized

    model = build_model(CONFIG, seed=3)
    blocks = ("shared",) if scope == "shared" else ("shared", "text", "audio")
    _move_all_but_quantized(model, scope, blocks, torch.device("meta"))
    on_host = {name for name, p in model.named_parameters() if p.device.type == "cpu"}
    want = {f"model.{block}_block.layers.{i}.{part}.weight" for block in blocks for i in range(2)
            for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    if scope == "all":
        want |= {"text_lm_head.weight", "audio_lm_head.weight"}
    assert on_host == want
    assert all(b.device.type == "meta" for b in model.buffers())

    plain = quantize_model_in_place(build_model(CONFIG, seed=3), scope)
    staged_model = build_model(CONFIG, seed=3)
    staged = quantize_model_in_place(staged_model, scope, "cpu")
    for a, b in zip((*plain.shared, *plain.text, *plain.audio), (*staged.shared, *staged.text, *staged.audio),
                    strict=True):
        for name, w in a.matrices().items():
            v = b.matrices()[name]
            assert type(v) is type(w)
            if isinstance(w, Fp8Weight):
                assert torch.equal(v.weight.view(torch.uint8), w.weight.view(torch.uint8)) and torch.equal(v.scale, w.scale)
            else:
                assert torch.equal(v, w)
    assert staged_model.model.shared_block.layers[0].self_attn.q_proj.weight.numel() == 0


def test_engine_stages_fp8_checkpoints_on_gpus_only() -> None:
    from runtime.engine import EngineConfig, _stages_fp8

    assert _stages_fp8(EngineConfig(device="cuda", fast_path=True, fp8_scope="all"))
    assert _stages_fp8(EngineConfig(device="cuda:1", fast_path=True, fp8_scope="shared"))
    assert not _stages_fp8(EngineConfig(device="cuda", fast_path=True))
    assert not _stages_fp8(EngineConfig(device="cpu", fast_path=True, fp8_scope="all"))


@pytest.mark.parametrize(("fp8_scope", "on_host"), [("all", True), (None, False)])
def test_engine_stages_fp8_presets_through_host_memory(monkeypatch: pytest.MonkeyPatch, fp8_scope: str | None,
                                                       on_host: bool) -> None:
    """A preset with FP8 on a GPU is drawn on the GPU but kept on the host, as a checkpoint is, so that the
    engine quantizes it onto the device one matrix at a time; bf16 presets stay where they are drawn."""
    from runtime import engine as engine_mod

    calls = []
    monkeypatch.setattr(engine_mod, "cap_device_memory", lambda device, cap: calls.append(("cap", device, cap)))
    monkeypatch.setattr(engine_mod, "build_model", lambda cfg, **kw: calls.append(("build", kw)) or "model")
    config = engine_mod.EngineConfig(model="tiny", device="cuda", fast_path=True, fp8_scope=fp8_scope,
                                     memory_cap_bytes=2**30)
    model, _ = engine_mod.load_model(config)
    assert model == "model"
    assert calls == [("cap", "cuda", 2**30),
                     ("build", {"seed": config.weights_seed, "device": "cuda", "dtype": config.torch_dtype,
                                "debug_checks": config.debug_checks, "on_host": on_host})]


@pytest.mark.parametrize(("device", "fp8_scope", "where", "mapped"),
                         [("cuda", "all", "cpu", True), ("cuda", None, "cuda", False), ("cpu", "all", "cpu", False)])
def test_engine_maps_a_checkpoint_it_stages_for_fp8(monkeypatch: pytest.MonkeyPatch, device: str,
                                                    fp8_scope: str | None, where: str, mapped: bool) -> None:
    """A checkpoint staged for FP8 on a GPU loads onto the host as views of its files (page cache, not the
    process's memory); every other load copies onto its device."""
    from runtime import engine as engine_mod
    from runtime import weights as weights_mod

    calls = []
    monkeypatch.setattr(engine_mod, "cap_device_memory", lambda device, cap: None)
    monkeypatch.setattr(weights_mod, "load_pretrained", lambda path, **kw: calls.append((path, kw)) or ("m", "t"))
    config = engine_mod.EngineConfig(model="/ckpt", device=device, fast_path=True, fp8_scope=fp8_scope)
    assert engine_mod.load_model(config) == ("m", "t")
    assert calls == [("/ckpt", {"device": where, "dtype": config.torch_dtype, "debug_checks": config.debug_checks,
                                "mapped": mapped})]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the numbers are drawn on a GPU")
def test_build_model_on_host_keeps_the_numbers_drawn_on_the_gpu() -> None:
    drawn = build_model(CONFIG, seed=5, device="cuda", dtype=torch.bfloat16)
    hosted = build_model(CONFIG, seed=5, device="cuda", dtype=torch.bfloat16, on_host=True)
    for (name, a), (_, b) in zip(drawn.named_parameters(), hosted.named_parameters(), strict=True):
        assert b.device.type == "cpu" and torch.equal(a.cpu(), b), name


def test_engine_fp8_option() -> None:
    from runtime.engine import EngineConfig, EngineCore
    from runtime.request import GenerationRequest
    from runtime.sampling import RequestSampler, SamplingParams, is_stop_row, sample_next_rows
    from runtime.tokenizer import Tokenizer

    with pytest.raises(ValueError, match="fast_path"):
        EngineConfig(fp8_scope="all")
    with pytest.raises(ValueError, match="fp8_scope"):
        EngineConfig(fast_path=True, fp8_scope="everything")
    model = build_model(CONFIG, seed=0)
    config = EngineConfig(block_size=BLOCK_SIZE, fast_path=True, fp8_scope="all", kv_cache_bytes=1 << 20)
    core = EngineCore(model, Tokenizer.tiny(), config)
    assert model.text_lm_head.weight.numel() == 0 and isinstance(core.runner.fast.weights.text_head, Fp8Weight)
    greedy = SamplingParams(temperature=0.0)
    seq = core.add_request(GenerationRequest("q", tuple(make_rows(7, 8)), greedy, greedy, max_new_tokens=4))
    while core.has_work:
        core.step()
    # Reference: the plain model with every FP8 matrix replaced by its dequantized value, no cache.
    reference = build_model(CONFIG, seed=0)
    linears = [m for m in reference.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 7 * CONFIG.num_layer_instances + 2  # q, k, v, o, gate, up, down + both heads
    for linear in linears:
        linear.weight.data = quantize_weight(linear.weight.data).dequantize(torch.float32)
    prompt = make_rows(7, 8)
    sampler = RequestSampler(prompt, greedy, greedy, min_new_tokens=0, seed=0)
    rows = list(prompt)
    for _ in range(4):
        text_logits, audio_logits = reference.reference_forward(rows)
        rows += sample_next_rows(text_logits[-1:], audio_logits[-1:], [sampler])
        if is_stop_row(rows[-1]):
            break
    assert seq.rows[len(prompt):] == rows[len(prompt):] and len(rows) > len(prompt)


def test_pdl_launch_mode_is_scoped_and_validated() -> None:
    from runtime.kernels import pdl_launches, pdl_mode

    assert pdl_mode() == "off"
    with pdl_launches("wait"):
        assert pdl_mode() == "wait"
        with pdl_launches("off"):
            assert pdl_mode() == "off"
        assert pdl_mode() == "wait"
    assert pdl_mode() == "off"
    with pytest.raises(RuntimeError, match="boom"), pdl_launches("wait"):
        raise RuntimeError("boom")
    assert pdl_mode() == "off"  # restored after an error inside the block
    with pytest.raises(ValueError, match="PDL mode must be one of"), pdl_launches("prefetch"):
        pass


def test_pdl_covers_decode_steps_up_to_pdl_max_rows_and_prefill_up_to_its_own_limit(
    model: MossSpeechForCausalLM, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from runtime import fast_forward
    from runtime.kernels import pdl_mode

    fast = FastForward(fuse_model_weights(model), TorchOps())
    assert fast.pdl_max_rows == 32 and fast_forward.PDL_PREFILL_MAX_ROWS == 64
    fast.pdl = "wait"  # as resolved on a GPU that supports it (TorchOps resolves "off")
    seen: list[str] = []
    monkeypatch.setattr(fast, "_forward", lambda step, kv_cache, text: seen.append(pdl_mode()))
    for rows, query_len in ((1, 1), (32, 1), (33, 1), (64, 1), (64, 64), (65, 65), (65, 13)):
        fast(SimpleNamespace(tokens=torch.zeros(rows), max_query_len=query_len), None)  # type: ignore[arg-type]
    assert seen == ["wait", "wait", "off", "off", "wait", "off", "off"]
    assert pdl_mode() == "off"


def test_launch_options_are_validated_and_inert_off_cuda(model: MossSpeechForCausalLM) -> None:
    weights = fuse_model_weights(model)
    with pytest.raises(ValueError, match="pdl must be one of"):
        FastForward(weights, TorchOps(), pdl="early")
    fast = FastForward(weights, TorchOps(), pdl="wait", parallel_tails=True)
    assert fast.pdl == "off" and fast.tail_stream is None  # PyTorch ops, CPU: neither applies
    cache = allocate_kv_cache(CONFIG, 8, BLOCK_SIZE, "cpu", torch.float32)
    rows = make_rows(5, 7)
    tokens, is_audio, positions, attn = _plain_step(model, cache, [(rows, 5, [0, 1])])
    step = StepInputs.from_metadata(tokens, is_audio, positions, attn)
    text, audio = fast(step, cache)
    want_text, want_audio = model(tokens, is_audio, positions, allocate_kv_cache(CONFIG, 8, BLOCK_SIZE, "cpu",
                                                                                 torch.float32), attn)
    assert text.shape == (1, CONFIG.vocab_size) and audio.shape == (1, CONFIG.audio_vocab_size)
    torch.testing.assert_close(text, want_text, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(audio, want_audio, rtol=1e-4, atol=1e-4)


class _CountingOps(TorchOps):
    """TorchOps that counts which attention ops a step calls."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def decode_attention_rope(self, *args: object, store_only: bool = False) -> torch.Tensor | None:  # type: ignore[override]
        self._count("decode_attention_rope(store_only)" if store_only else "decode_attention_rope")
        return TorchOps.decode_attention_rope(*args, store_only=store_only)

    def qk_norm_rope_store(self, *args: object) -> torch.Tensor:  # type: ignore[override]
        self._count("qk_norm_rope_store")
        return TorchOps.qk_norm_rope_store(*args)

    def decode_attention(self, *args: object) -> torch.Tensor:  # type: ignore[override]
        self._count("decode_attention")
        return TorchOps.decode_attention(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize(("fused_rope", "num_parts", "fused"),
                         [(True, 1, True), (True, 2, True), (True, 4, False), (False, 1, False)])
def test_decode_steps_fuse_rope_into_attention_only_up_to_two_key_partitions(
    model: MossSpeechForCausalLM, fused_rope: bool, num_parts: int, fused: bool,
) -> None:
    """A prefill step, then a decode step: the decode step runs one fused op per layer (2 shared layers and
    2 per tail: 6) when it splits keys in at most 2 partitions; otherwise, and in the prefill, the rotation
    and the attention run as two ops. Same logits and cache either way."""
    a, b = make_rows(9, 3), make_rows(5, 4)
    results = []
    for ops in (TorchOps(), _CountingOps()):
        cache = allocate_kv_cache(CONFIG, 32, BLOCK_SIZE, "cpu", torch.float32)
        fast = FastForward(fuse_model_weights(model), ops, fused_rope=fused_rope)
        for work in ([(a[:8], 8, [1, 2, 3]), (b[:4], 4, [4, 5])], [(a, 1, [1, 2, 3]), (b, 1, [4, 5])]):
            tokens, is_audio, positions, attn = _plain_step(model, cache, work)
            parts = num_parts if max(attn.query_lens) == 1 else 1
            out = fast(StepInputs.from_metadata(tokens, is_audio, positions, attn, num_parts=parts), cache)
        results.append((out, cache.k, cache.v))
    layers = CONFIG.num_shared_layers + 2 * CONFIG.num_modality_layers
    assert layers == 6
    want = {"decode_attention_rope": layers, "qk_norm_rope_store": layers} if fused else {
        "qk_norm_rope_store": 2 * layers, "decode_attention": layers}
    assert ops.calls == want
    for x, y in zip(results[0][0] + results[0][1:], results[1][0] + results[1][1:], strict=True):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


def test_l2_prefetch_launch_choices() -> None:
    """The L2 prefetches before the PDL wait (docs/gpu.md, fortieth session) are launched only under PDL:
    the GEMV's 2048 bytes per program for FP8 weights (none for bf16, where nothing was measured), the decode
    attention's first key with more than 2 key partitions and fewer than 8 sequences (not faster at 8
    streams with FP8 weights, nor at 16 with 2 partitions). A size that is not a multiple of 16 bytes is refused at launch, not sent to the GPU."""
    pytest.importorskip("triton")
    from runtime.kernels import gemv, pdl_launches
    from runtime.kernels import paged_attention as attn

    assert gemv.l2_slice_launch(1) == {} and attn.l2_kv_launch(16, 1) is False  # PDL off (the default)
    with pdl_launches("wait"):
        assert gemv.l2_slice_launch(1) == {"L2_SLICE": 2048}
        assert gemv.l2_slice_launch(2) == {}
        assert [attn.l2_kv_launch(p, 1) for p in (1, 2, 4, 8, 16)] == [False, False, True, True, True]
        assert [attn.l2_kv_launch(16, b) for b in (1, 4, 7, 8, 15)] == [True, True, True, False, False]
        before = dict(gemv.OPTIONS), dict(attn.OPTIONS)
        try:
            gemv.OPTIONS["l2_slice"], attn.OPTIONS["l2_kv"] = -1, False
            assert gemv.l2_slice_launch(2) == {"L2_SLICE": -1} and attn.l2_kv_launch(16, 1) is False
            gemv.OPTIONS["l2_slice"] = 0
            assert gemv.l2_slice_launch(1) == {}
            for bad in (100, -2, "all", True):
                gemv.OPTIONS["l2_slice"] = bad
                with pytest.raises(ValueError, match="l2_slice"):
                    gemv.l2_slice_launch(1)
        finally:
            gemv.OPTIONS.update(before[0])
            attn.OPTIONS.update(before[1])


def test_l2_prefetch_choices_reach_the_kernel_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrappers hand `l2_slice_launch` / `l2_kv_launch`'s choices to the kernels: the one-row GEMV and
    the FP8 2-4-row GEMV launch with L2_SLICE=2048 on FP8 weights under PDL (never on bf16 weights, never
    without PDL), the decode attention with L2_KV above 2 key partitions under PDL for fewer than 8
    sequences (batch is the wrapper's first dimension, not the table's width). The kernels are replaced
    by recorders of their launch keywords, so this runs on the CPU."""
    pytest.importorskip("triton")
    from runtime.kernels import fp8_gemv, pdl_launches
    from runtime.kernels import gemv as gemv_mod
    from runtime.kernels import paged_attention as attn

    launches: list[tuple[str, dict]] = []

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: tuple[int, ...]):
            return lambda *args, **kwargs: launches.append((self.name, kwargs))

    for module, kernel in ((gemv_mod, "_gemv_kernel"), (fp8_gemv, "_gemv_rows_kernel"),
                           (attn, "_decode_kernel"), (attn, "_decode_reduce_kernel")):
        monkeypatch.setattr(module, kernel, Recorder(kernel))
    k_dim, n_dim, block_size, kv_heads, head_dim = 1024, 64, 16, 2, 64
    x = torch.zeros(1, k_dim, dtype=torch.bfloat16)
    w_fp8 = torch.zeros(n_dim, k_dim, dtype=torch.float8_e4m3fn)
    w_bf16 = torch.zeros(n_dim, k_dim, dtype=torch.bfloat16)
    scale = torch.ones(n_dim)
    q = torch.zeros(1, 2 * kv_heads, head_dim, dtype=torch.bfloat16)
    cache = torch.zeros(8, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    tables, seq_lens = torch.arange(8, dtype=torch.int32)[None], torch.tensor([100], dtype=torch.int32)
    q8, tables8, seq_lens8 = q.expand(8, -1, -1).contiguous(), tables.expand(8, -1).contiguous(), seq_lens.repeat(8)

    def launch_all() -> list[tuple[str, object, object]]:
        launches.clear()
        gemv_mod.gemv(x, w_fp8, scale=scale)
        gemv_mod.gemv(x, w_bf16)
        fp8_gemv.gemv_rows(torch.zeros(3, k_dim, dtype=torch.bfloat16), w_fp8, scale, (8, 256, 4))
        for parts in (1, 2, 4, 8):
            attn.paged_decode_attention(q, cache, cache, tables, seq_lens, num_parts=parts)
        attn.paged_decode_attention(q8, cache, cache, tables8, seq_lens8, num_parts=8)
        return [(name, kw.get("L2_SLICE"), kw.get("L2_KV")) for name, kw in launches
                if name != "_decode_reduce_kernel"]

    without_pdl = launch_all()
    assert without_pdl == [("_gemv_kernel", None, None), ("_gemv_kernel", None, None),
                           ("_gemv_rows_kernel", None, None)] + [("_decode_kernel", None, False)] * 5
    with pdl_launches("wait"):
        assert launch_all() == [
            ("_gemv_kernel", 2048, None), ("_gemv_kernel", None, None), ("_gemv_rows_kernel", 2048, None),
            ("_decode_kernel", None, False), ("_decode_kernel", None, False), ("_decode_kernel", None, True),
            ("_decode_kernel", None, True), ("_decode_kernel", None, False)]
        assert all(kw["USE_PDL"] and kw["launch_pdl"] for _, kw in launches)


def test_decode_attention_launch_shape_by_grid() -> None:
    """The decode kernel's launch shape: one-warp, 32-key, 2-stage programs for 96-128 and 256 sequences x
    8 KV heads (the grids where it was measured faster) with unsplit keys on Hopper (3 stages hang the GPU
    with the fused RoPE at one loop trip: bench/results/decode-attention-tune-h200/); the wide shape below
    that, whenever keys are split, and elsewhere."""
    pytest.importorskip("triton")
    from runtime.kernels.paged_attention import decode_launch, decode_num_parts

    assert decode_launch(128, 8, 1) == (32, 1, 2)
    assert decode_launch(96, 8, 1) == (32, 1, 2)
    assert decode_launch(256, 8, 1) == (32, 1, 2)
    assert decode_launch(192, 4, 1) == (32, 1, 2)  # 768 programs
    assert decode_launch(95, 8, 1) == (64, 4, 2)
    assert decode_launch(129, 8, 1) == (64, 4, 2)
    assert decode_launch(160, 8, 1) == (64, 4, 2)
    assert decode_launch(192, 8, 1) == (64, 4, 2)
    assert decode_launch(512, 8, 1) == (64, 4, 2)
    assert decode_launch(64, 8, 1) == (64, 4, 2)
    assert decode_launch(128, 8, 2) == (64, 4, 3)
    assert decode_launch(128, 8, 1, narrow=False) == (64, 4, 2)  # off Hopper: not measured there
    assert decode_launch(1, 8, decode_num_parts(1, 8, 512)) == (64, 4, 3)
    assert decode_num_parts(96, 8, 4096) == 1 and decode_num_parts(1, 8, 512) == 8
    # at most 16 partitions (OPTIONS["max_parts"]): with dynamic partitions more only add empty ones
    assert [decode_num_parts(b, 8, 4096) for b in (1, 2, 4, 8)] == [16, 16, 16, 8]
    assert [decode_num_parts(b, 8, 1024) for b in (1, 2, 4, 8)] == [16, 16, 16, 8]
    # 128-255 programs: 2 partitions (measured faster at 16 and 24 streams), unless one key tile holds all
    assert [decode_num_parts(b, 8, 512) for b in (8, 15, 16, 24, 31, 32, 64)] == [8, 8, 2, 2, 2, 1, 1]
    assert decode_num_parts(16, 8, 64) == 1
    assert decode_launch(16, 8, decode_num_parts(16, 8, 512)) == (64, 4, 3)


def test_decode_attention_launch_over_an_fp8_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """An FP8 cache on Hopper: one-warp 32-key programs over unsplit keys, except 4-warp 128-key ones at 32
    sequences x 8 KV heads and at 16 (keys split in 2 there), and keys split in 2 (one-warp 32-key programs)
    at 48-64 sequences, where they were measured faster (bench/results/kv-fp8-split-h200/); off Hopper, or
    with OPTIONS["fp8_mid"] off, the earlier choices."""
    pytest.importorskip("triton")
    from runtime.kernels import paged_attention as pa

    assert [pa.decode_launch(b, 8, 1, fp8=True) for b in (16, 32, 48, 64, 96, 128)] == [
        (32, 1, 2), (128, 4, 2), (32, 1, 2), (32, 1, 2), (32, 1, 2), (32, 1, 2)]
    assert [pa.decode_launch(b, 8, 2, fp8=True) for b in (8, 16, 24, 32, 48, 64)] == [
        (64, 4, 1), (128, 4, 2), (64, 4, 1), (64, 4, 1), (32, 1, 2), (32, 1, 2)]
    assert pa.decode_launch(1, 8, 16, fp8=True) == (64, 4, 1)
    assert pa.decode_launch(32, 8, 1, fp8=True, narrow=False) == (64, 4, 2)
    assert pa.decode_launch(64, 8, 2, fp8=True, narrow=False) == (64, 4, 3)
    # the partitions: only for an FP8 cache, only on Hopper
    assert [pa.decode_num_parts(b, 8, 512, fp8=True, device="cpu") for b in (32, 48, 64)] == [1, 1, 1]
    monkeypatch.setattr(pa, "_is_hopper", lambda device: True)
    assert [pa.decode_num_parts(b, 8, 512, fp8=True, device="cuda") for b in (16, 24, 32, 48, 64, 96, 128)] == [
        2, 2, 1, 2, 2, 1, 1]
    assert [pa.decode_num_parts(b, 8, 512, device="cuda") for b in (48, 64)] == [1, 1]
    assert pa.decode_num_parts(64, 8, 64, fp8=True, device="cuda") == 1  # one key tile holds every key
    # the kernel reads q's rows back to back: a strided slice of the QKV rows is refused, not misread
    qkv = torch.zeros(2, (32 + 16) * 128, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="contiguous"):
        pa.paged_decode_attention(qkv[:, : 32 * 128].view(2, 32, 128), cache, cache,
                                  torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32))
    monkeypatch.setitem(pa.OPTIONS, "fp8_mid", False)
    assert pa.decode_num_parts(64, 8, 512, fp8=True, device="cuda") == 1
    assert pa.decode_launch(32, 8, 1, fp8=True) == (32, 1, 2)
    assert pa.decode_launch(16, 8, 2, fp8=True) == pa.decode_launch(64, 8, 2, fp8=True) == (64, 4, 1)


def test_fast_forward_asks_for_fp8_partitions_with_its_device() -> None:
    """FastForward passes the cache kind and its device to the ops' partition choice (CPU: no split)."""
    fast = FastForward(fuse_model_weights(build_model(ModelConfig.preset("tiny"), seed=0)), TorchOps())
    seen = []
    fast.ops = type("Ops", (), {"decode_num_parts": staticmethod(lambda *a, **kw: seen.append((a, kw)) or 3)})()
    assert fast.decode_num_parts(64, 512, fp8=True) == 3
    assert seen == [((64, fast.config.num_key_value_heads, 512), {"fp8": True, "device": torch.device("cpu")})]
    # the decode graph runner asks with its cache's kind, as the step is built
    for dtype, fp8 in ((torch.bfloat16, False), (FP8_KV_DTYPE, True)):
        seen.clear()
        cache = allocate_kv_cache(fast.config, 8, 4, torch.device("cpu"), dtype)
        step = DecodeGraphRunner(fast, cache, max_model_len=24, buckets=(4,))._step(4)
        assert step.num_parts == 3
        assert seen == [((4, fast.config.num_key_value_heads, 24), {"fp8": fp8, "device": torch.device("cpu")})]


def test_triton_ops_fall_back_to_two_ops_for_the_fused_decode_attention() -> None:
    """A fused decode op whose parts fall back runs as this backend's two ops: with both on PyTorch, the same
    numbers as TorchOps (on CPU)."""
    pytest.importorskip("triton")
    from runtime.fast_ops import TritonOps, rope_then_attend
    from runtime.kernels.paged_attention import paged_decode_attention_rope

    assert TritonOps().decode_attention_rope is paged_decode_attention_rope
    for fallback in (["decode_attention"], ["qk_norm_rope_store"], ["decode_attention_rope"]):
        ops = TritonOps(fallback=fallback)
        assert ops.decode_attention_rope.func is rope_then_attend and ops.decode_attention_rope.args == (ops,)
    ops = TritonOps(fallback=["decode_attention", "qk_norm_rope_store"])
    gen = torch.Generator().manual_seed(5)
    heads, kv, dim, bs = 4, 2, 8, 4
    qkv = torch.randn(2, (heads + 2 * kv) * dim, generator=gen)
    qn, kn = torch.rand(dim, generator=gen) + 0.5, torch.rand(dim, generator=gen) + 0.5
    from runtime.fast_ops import rope_tables

    cos, sin = rope_tables(64, dim, 1e4, torch.float32, "cpu")
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    seq_lens = torch.tensor([9, 3], dtype=torch.int32)
    pos = seq_lens.long() - 1
    slots = torch.tensor([1 * bs + 0, 3 * bs + 2])
    outs = []
    for backend in (ops, TorchOps()):
        cache_gen = torch.Generator().manual_seed(6)
        kc, vc = (torch.randn(6, bs, kv, dim, generator=cache_gen) for _ in range(2))
        o = backend.decode_attention_rope(qkv, qn, kn, cos, sin, pos, slots, kc, vc, tables, seq_lens, 1, heads, 1e-6)
        outs.append((o, kc, vc))
    assert outs[0][0].shape == (2, heads, dim) and bool(torch.isfinite(outs[0][0]).all())
    for x, y in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


def _weights_read(fast: FastForward, monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Spy on every matrix the fast path multiplies by (the linears and both heads go through `_linear`)."""
    read: list[object] = []
    linear = fast._linear

    def spy(x: torch.Tensor, w: object) -> torch.Tensor:
        read.append(w)
        return linear(x, w)

    monkeypatch.setattr(fast, "_linear", spy)
    return read


def test_audio_only_step_stores_the_same_cache_and_skips_the_text_head(
    model: MossSpeechForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`text=False`: no text logits and none of the matrices that only feed them, yet the same audio logits
    and, bit for bit, the same K/V in every layer, the text tail's last one included."""
    weights = fuse_model_weights(model)
    fast = FastForward(weights, TorchOps())
    read = _weights_read(fast, monkeypatch)
    whole_cache = allocate_kv_cache(CONFIG, 32, BLOCK_SIZE, "cpu", torch.float32)
    audio_cache = allocate_kv_cache(CONFIG, 32, BLOCK_SIZE, "cpu", torch.float32)
    last = weights.text[-1]
    skipped = [last.o, last.gate_up, last.down, weights.text_head]
    hidden, inter = CONFIG.hidden_size, CONFIG.intermediate_size  # float32 matrices: 4 bytes per value
    assert weights.audio_only_matrix_bytes() == weights.matrix_bytes() - 4 * (
        hidden * hidden + 2 * inter * hidden + hidden * inter + CONFIG.vocab_size * hidden)
    for work in _two_sequence_steps():
        tokens, is_audio, positions, attn = _plain_step(model, whole_cache, work)
        step = StepInputs.from_metadata(tokens, is_audio, positions, attn)
        read.clear()
        want_t, want_a = fast(step, whole_cache)
        assert all(any(w is s for w in read) for s in skipped) and len(read) == 4 * CONFIG.num_layer_instances + 2
        read.clear()
        got_t, got_a = fast(step, audio_cache, text=False)
        assert got_t is None and want_t.shape == (2, CONFIG.vocab_size)
        assert not any(w is s for w in read for s in skipped)
        assert len(read) == 4 * CONFIG.num_layer_instances + 2 - len(skipped)
        assert torch.equal(got_a, want_a)
        assert torch.equal(audio_cache.k, whole_cache.k) and torch.equal(audio_cache.v, whole_cache.v)
    # the last text layer did store its K/V (the comparison above is not between two empty caches)
    slot = 20 * BLOCK_SIZE + 1  # sequence b, position 1
    assert audio_cache.k[last.layer_idx].view(-1, CONFIG.num_key_value_heads, CONFIG.head_dim)[slot].abs().sum() > 0


def test_decode_runner_audio_only_steps(model: MossSpeechForCausalLM) -> None:
    """`run(text=False)` returns no text logits and the same audio logits and cache as a whole step, with
    or without the audio-only graphs."""
    fast = FastForward(fuse_model_weights(model), TorchOps())
    prompt, table = make_rows(9, 5), [4, 1, 6]
    results = []
    for audio_only, text in ((True, True), (True, False), (False, False)):
        cache = allocate_kv_cache(CONFIG, 10, BLOCK_SIZE, "cpu", torch.float32)
        runner = DecodeGraphRunner(fast, cache, max_model_len=24, buckets=(4,), audio_only=audio_only)
        tokens, is_audio, positions, attn = _plain_step(model, cache, [(prompt, len(prompt), table)])
        fast(StepInputs.from_metadata(tokens, is_audio, positions, attn), cache)
        tokens, is_audio, positions, attn = _plain_step(model, cache, [(prompt + [(MODALITY_PAD_ID, 7)], 1, table)])
        text_logits, audio_logits = runner.run(
            tokens, is_audio, positions, attn.slot_mapping, torch.tensor([table], dtype=torch.int32),
            torch.tensor(attn.seq_lens, dtype=torch.int32), text=text)
        assert (text_logits is None) == (not text)
        results.append((audio_logits.clone(), cache.k.clone(), cache.v.clone()))
    for got in results[1:]:
        assert all(torch.equal(g, w) for g, w in zip(got, results[0], strict=True))


@pytest.mark.parametrize(("num_parts", "fused"), [(1, True), (2, True), (4, False)])
def test_audio_only_decode_step_stores_the_last_text_layer_without_attending(
    model: MossSpeechForCausalLM, num_parts: int, fused: bool
) -> None:
    """In an audio-only decode step the last text layer runs its K/V store alone: through the fused kernel's
    store-only mode when the step fuses RoPE into attention, else through the unfused store; no attention."""
    a, b = make_rows(9, 3), make_rows(5, 4)
    ops = _CountingOps()
    cache = allocate_kv_cache(CONFIG, 32, BLOCK_SIZE, "cpu", torch.float32)
    fast = FastForward(fuse_model_weights(model), ops)
    fast(StepInputs.from_metadata(*_plain_step(model, cache, [(a[:8], 8, [1, 2, 3]), (b[:4], 4, [4, 5])])), cache)
    ops.calls.clear()
    tokens, is_audio, positions, attn = _plain_step(model, cache, [(a, 1, [1, 2, 3]), (b, 1, [4, 5])])
    fast(StepInputs.from_metadata(tokens, is_audio, positions, attn, num_parts=num_parts), cache, text=False)
    layers = CONFIG.num_shared_layers + 2 * CONFIG.num_modality_layers
    want = ({"decode_attention_rope": layers - 1, "decode_attention_rope(store_only)": 1} if fused
            else {"qk_norm_rope_store": layers, "decode_attention": layers - 1})
    assert ops.calls == want


@pytest.mark.parametrize(("dynamic", "parts", "want_part"), [(True, 8, 0), (False, 8, 192), (True, 1, 1536),
                                                               (False, 1, 1536)])
def test_decode_launch_partitions_each_sequence_or_the_table(monkeypatch, dynamic: bool, parts: int,
                                                             want_part: int) -> None:
    """The launcher's key partitions: with OPTIONS["dynamic_parts"] a split launch passes PART 0 (the kernel
    spreads each sequence's own keys over its partitions, runtime/kernels/paged_attention.py), else the block
    table's span (96 blocks of 16 keys) cut in `parts` whole 64-key tiles; unsplit, one partition spans the
    table either way. The merge kernel runs for split launches only. (The kernels themselves run on the GPU:
    bench/decode_attention_lengths.py and bench/fast_checks.py check them there.)"""
    pytest.importorskip("triton")
    from runtime.kernels import paged_attention as pa

    launches: list[tuple[str, tuple, dict]] = []

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: tuple):
            return lambda *args, **kwargs: launches.append((self.name, grid, kwargs))

    monkeypatch.setattr(pa, "_decode_kernel", Recorder("decode"))
    monkeypatch.setattr(pa, "_decode_reduce_kernel", Recorder("merge"))
    monkeypatch.setitem(pa.OPTIONS, "dynamic_parts", dynamic)
    q = torch.zeros(3, 32, 128, dtype=torch.bfloat16)
    cache = torch.zeros(8, 16, 8, 128, dtype=torch.bfloat16)
    tables = torch.zeros(3, 96, dtype=torch.int32)
    pa.paged_decode_attention(q, cache, cache, tables, torch.tensor([5, 513, 1500], dtype=torch.int32), parts)
    assert [name for name, _, _ in launches] == (["decode", "merge"] if parts > 1 else ["decode"])
    _, grid, kwargs = launches[0]
    assert grid == (3, 8, parts) and kwargs["NUM_PARTS"] == parts and kwargs["BLOCK_N"] == 64
    assert kwargs["PART"] == want_part

