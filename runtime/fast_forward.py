"""The fast forward pass: fused weights, fused per-layer ops, attention straight on the paged cache.

Same function as `MossSpeechForCausalLM.forward` (runtime/model.py), restructured for speed:
- QKV and gate/up are single matrices (runtime/fused.py); FP8 matrices are accepted (runtime/fp8.py).
- The residual stream is carried beside the layer output so each residual add is fused into the next
  RMSNorm (`add_rmsnorm`); q/k norm, RoPE and the K/V store are one op (`qk_norm_rope_store`).
- Every input is a tensor of static shape (`StepInputs`), so a decode step can be captured in a CUDA
  graph (runtime/cuda_graph.py); the only Python-level branch is decode (one row per sequence) vs prefill.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from runtime.attention import AttentionMetadata
from runtime.fast_ops import TorchOps, TritonOps, default_ops, rope_tables
from runtime.fp8 import GEMV_MAX_ROWS, Fp8Weight, linear
from runtime.fused import FusedWeights, LayerWeights
from runtime.kernels import pdl_launches, resolve_pdl
from runtime.kv_cache import KVCache
from runtime.transfer import to_device

# decode steps with at most this many key partitions fuse the q/k RoPE into the attention kernel
FUSED_ROPE_MAX_PARTS = 2


def padded_block_tables(block_tables: list[list[int]]) -> torch.Tensor:
    """Block tables of unequal length as one host tensor [S, W] int32, zero-padded to the longest."""
    width = max(len(t) for t in block_tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)


@dataclass
class StepInputs:
    """One step's flat batch as tensors; rows are grouped by sequence (see docs/contracts.md)."""

    tokens: torch.Tensor  # [N] selected token per row
    is_audio: torch.Tensor  # [N] bool
    positions: torch.Tensor  # [N]
    slot_mapping: torch.Tensor  # [N] int64; < 0 = padding row (K/V not stored)
    block_tables: torch.Tensor  # [S, W] int32, padded with 0
    seq_lens: torch.Tensor  # [S] int32, context including the new rows
    query_start: torch.Tensor  # [S + 1] int32, first row of each sequence
    logits_indices: torch.Tensor  # [S] int64, last new row of each sequence
    max_query_len: int  # 1 = decode step (one row per sequence)
    num_parts: int = 1  # decode only: key partitions per sequence

    @classmethod
    def from_metadata(
        cls, tokens: torch.Tensor, is_audio: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
        *, num_parts: int = 1,
    ) -> StepInputs:
        """Build from the plain path's metadata (same step, same cache)."""
        device = attn.slot_mapping.device
        tables = padded_block_tables(attn.block_tables)
        starts = [0]
        for q in attn.query_lens:
            starts.append(starts[-1] + q)
        return cls(
            tokens=tokens, is_audio=is_audio, positions=positions,
            slot_mapping=attn.slot_mapping.long(),
            block_tables=to_device(tables, device),
            seq_lens=to_device(torch.tensor(attn.seq_lens, dtype=torch.int32), device),
            query_start=to_device(torch.tensor(starts, dtype=torch.int32), device),
            logits_indices=attn.logits_indices.long(),
            max_query_len=max(attn.query_lens),
            num_parts=num_parts,
        )


ONE_ROW_MODES = ("cublas", "gemv", "mixed", "mixed2")
# Prefill steps of up to this many rows launch the Triton kernels with PDL (where `pdl` allows it); the
# limit decode steps had until the thirtieth session, which narrowed theirs (`pdl_max_rows`) and did not
# measure prefill chunks again.
PDL_PREFILL_MAX_ROWS = 64


class FastForward:
    """Callable `(step, kv_cache) -> (text_logits [S, Vt], audio_logits [S, Va])`: float32 like the model from
    the one-row GEMV heads, else in the activation dtype unless `float_logits` (the same values: the model
    rounds its logits to that dtype before widening them; the sampler widens them itself,
    runtime/sampling.py). `text=False`: text logits None, see __call__."""

    def __init__(
        self, weights: FusedWeights, ops: TorchOps | TritonOps | None = None, *, fp8_small_batch: str = "triton",
        one_row: str | None = None, pdl: str = "auto", pdl_max_rows: int | None = None,
        parallel_tails: bool | None = None,
        fused_rope: bool = True, float_logits: bool = False,
    ) -> None:
        """`one_row`: how one-row (1-stream decode) steps multiply (CUDA + Triton only; see ONE_ROW_MODES):
        "cublas" = cuBLAS + separate fused ops; "gemv" = the Triton GEMV with norms / residual / SiLU
        fused in front for all four layer matrices and the heads (runtime/kernels/gemv.py); "mixed" =
        cuBLAS for QKV and gate/up, the Triton GEMV for o and down (SiLU fused); "mixed2" = cuBLAS for
        gate/up only (QKV through the GEMV with the RMSNorm fused in front). Default: "gemv", the fastest
        for FP8 and, since the GEMV folds its accumulator (runtime/kernels/gemv.py), for bf16 as well:
        4.50 vs `mixed2` 4.56 ms in the engine run (4.48 vs 4.55 in its repeat), 4.568 vs 4.668 ms in an
        interleaved A/B with an earlier table (bench/results/engine-h200.json, gemv-fold-h200/; docs/gpu.md).
        `pdl`: how the Triton kernels of decode steps of at most `pdl_max_rows` rows (prefill steps: at most
        PDL_PREFILL_MAX_ROWS) are launched (one of
        runtime.kernels.PDL_MODES, or "auto": "wait" where the GPU and Triton support programmatic
        dependent launch, else "off"); results are identical in every mode. Measured on the H200 (4 runs):
        2-3% faster steps of 1-32 rows, even or faster at 64, 1-2% slower at 128 (docs/gpu.md). Since the
        thirtieth session up to 32 rows: in the six engine runs of the twenty-ninth and thirtieth sessions
        (bench/engine.py; the last three in interleaved rounds) the 64-row step with PDL was 0.3%, 3.0%, 1.0%,
        1.0% and 1.3% slower than without and once even (-0.2%), at 32 rows 0.3% faster to even, at 128 rows
        1.3-4.5% slower (bench/results/decode-logits-h200/). (Single-graph A/Bs, bench/decode_ab.py, put 64 even and 128 up
        to 2.6% faster: why the engine's many-bucket runners differ was not found.) `pdl_max_rows` None: 32, or
        16 (GEMV_MAX_ROWS) when the layers' matrices are FP8: their products of more rows run on cuBLAS and the
        weight-only kernel, and those steps were faster without PDL (thirty-fourth session, interleaved rounds:
        24 rows 5.335 against 5.583 ms, 32 rows 5.465 against 5.885; 8 and 16 rows, all Triton GEMVs, 4.494 /
        4.697 with PDL against 4.595 / 4.726 without; bench/results/fp8-rows-h200/decode-ab-fp8-pdl.json).
        `parallel_tails` (CUDA only; default on there): in decode steps the audio tail and head run on a
        second stream, concurrently with the text tail and head (they share nothing but their input), so the
        two chains of small kernels fill each other's gaps; the step (and a CUDA graph captured from it)
        joins them before it returns. Measured on the H200 (4 runs): one-stream steps 3-4% faster, 64-128
        streams 0-2%. Prefill steps stay on one stream: they are compute-bound (512 rows: -0.8% to +2.6%
        over 3 runs), and the second stream's activations in the prefill graphs cost 0.5 GiB of the 24 GB
        profile's memory (bench/profile_24gb.py, docs/gpu.md).
        `fused_rope`: decode steps whose attention splits keys in at most FUSED_ROPE_MAX_PARTS partitions
        (batch x KV heads >= 128, i.e. 16+ streams here) run the q/k norm, RoPE and K/V store inside the
        attention kernel (`decode_attention_rope`, one launch per layer fewer); off, or with more partitions:
        the two ops one after the other. Same math and roundings; only the float32 sum in each head's norm
        may run in another order, so a last bit of q or k can differ (bench/fast_checks.py). Measured on the H200
        (bench/results/decode-rope-h200/, two runs): 128 streams 8.98 -> 8.89 and 8.98 -> 8.73 ms, 64 streams
        6.70 -> 6.68 and 6.71 -> 6.65; at one stream, where each of 16 key partitions repeats the query's
        rotation and the one holding the new key waits for its store, 4.51 -> 4.62 / 4.69 ms (bf16) and
        2.73 -> 2.84 / 2.86 ms (FP8), hence the rule; with 2 partitions (16-31 streams) the fused kernel is
        what was measured faster (bench/results/decode-attention-tune-h200/).
        `float_logits`: heads other than the one-row GEMV widen their logits to float32 inside the step (a
        copy of [S, V] float32 written after each head) instead of returning them in the activation dtype; the
        sampler makes a float32 copy of them either way (it clones float32 logits), so off, that copy is
        done once instead of twice."""
        self.weights = weights
        cfg = weights.config
        self.config = cfg
        device, dtype = weights.embed_text.device, weights.embed_text.dtype
        self.ops = ops if ops is not None else default_ops(device)
        self.fp8_small_batch = fp8_small_batch
        if one_row is None:
            one_row = "gemv"
        if one_row not in ONE_ROW_MODES:
            raise ValueError(f"one_row must be one of {ONE_ROW_MODES}, got {one_row!r}")
        # the GEMV kernel streams K in tiles of up to 4096 (true of the real shape, not of `tiny`)
        gemv_fits = all(k % 4096 == 0 for k in (cfg.hidden_size, cfg.intermediate_size,
                                                  cfg.num_attention_heads * cfg.head_dim))
        self.one_row = one_row if isinstance(self.ops, TritonOps) and gemv_fits else "cublas"
        self.pdl = resolve_pdl(pdl, device, isinstance(self.ops, TritonOps))
        if pdl_max_rows is None:  # see the docstring's `pdl`
            fp8_layers = isinstance(weights.shared[0].qkv, Fp8Weight)
            pdl_max_rows = GEMV_MAX_ROWS if fp8_layers else 32
        self.pdl_max_rows = pdl_max_rows
        self.fused_rope = fused_rope
        self.float_logits = float_logits
        on_cuda = torch.device(device).type == "cuda"
        self.tail_stream = torch.cuda.Stream(device) if on_cuda and parallel_tails is not False else None
        self.cos, self.sin = rope_tables(cfg.max_position_embeddings, cfg.head_dim, cfg.rope_theta, dtype, device)

    def decode_num_parts(self, batch: int, max_context: int, fp8: bool = False) -> int:
        """Key partitions the decode attention uses for this batch size and longest context (`fp8`: over a
        cache of FP8 codes)."""
        return self.ops.decode_num_parts(batch, self.config.num_key_value_heads, max_context, fp8=fp8,
                                         device=self.cos.device)

    def _linear(self, x: torch.Tensor, w: object) -> torch.Tensor:
        return linear(x, w, small_batch_kernel=self.fp8_small_batch)  # type: ignore[arg-type]

    def embed(self, tokens: torch.Tensor, is_audio: torch.Tensor) -> torch.Tensor:
        """[N] -> [N, hidden]: text table for text rows, audio table for audio rows (static shapes)."""
        return self.ops.embed(tokens, is_audio, self.weights.embed_text, self.weights.embed_audio)

    def _layer(
        self, layer: LayerWeights, x: torch.Tensor, residual: torch.Tensor | None, step: StepInputs,
        kv_cache: KVCache, *, kv_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer; returns (mlp output, residual before it): the layer output is their sum.
        `kv_only`: stop once the rows' K/V are in the cache (no attention; nothing after would be read) and
        return the input unchanged; the K/V stores are the kernels the whole layer runs, so they are bit-equal."""
        cfg, ops = self.config, self.ops
        n = x.shape[0]
        if self.one_row != "cublas" and n == 1:
            return self._layer_one_row(layer, x, residual, step, kv_cache, kv_only=kv_only)
        h, residual = ops.add_rmsnorm(x, residual, layer.input_norm, cfg.rms_norm_eps)  # [N, hidden]
        qkv = self._linear(h, layer.qkv)  # [N, (H + 2KV) * D]
        attn = self._attention(layer, qkv, step, kv_cache, store_only=kv_only)  # [N, H, D]
        if attn is None:
            return x, residual
        o = self._linear(attn.reshape(n, cfg.num_attention_heads * cfg.head_dim), layer.o)  # [N, hidden]
        h, residual = ops.add_rmsnorm(o, residual, layer.post_norm, cfg.rms_norm_eps)
        down = self._linear(ops.silu_mul(self._linear(h, layer.gate_up)), layer.down)  # [N, hidden]
        return down, residual

    def _layer_one_row(
        self, layer: LayerWeights, x: torch.Tensor, residual: torch.Tensor | None, step: StepInputs,
        kv_cache: KVCache, *, kv_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_layer` for a single row: the GEMV launches carry the norms, residual adds and SiLU."""
        from runtime.kernels.gemv import NONE, RMSNORM, SILU_MUL

        cfg, ops = self.config, self.ops
        eps = cfg.rms_norm_eps
        if self.one_row == "mixed":
            h, residual = ops.add_rmsnorm(x, residual, layer.input_norm, eps)
            qkv = self._linear(h, layer.qkv)
        else:
            qkv, residual = _gemv(x, layer.qkv, RMSNORM, residual, layer.input_norm, eps)  # [1, (H+2KV)*D]
        attn = self._attention(layer, qkv, step, kv_cache, store_only=kv_only)  # [1, H, D]
        assert residual is not None
        if attn is None:
            return x, residual
        o, _ = _gemv(attn.reshape(1, -1), layer.o, NONE)  # [1, hidden]
        if self.one_row in ("mixed", "mixed2"):
            h, residual = ops.add_rmsnorm(o, residual, layer.post_norm, eps)
            gate_up = self._linear(h, layer.gate_up)
        else:
            gate_up, residual = _gemv(o, layer.gate_up, RMSNORM, residual, layer.post_norm, eps)  # [1, 2I]
        down, _ = _gemv(gate_up, layer.down, SILU_MUL)  # [1, hidden]
        assert residual is not None
        return down, residual

    def _attention(
        self, layer: LayerWeights, qkv: torch.Tensor, step: StepInputs, kv_cache: KVCache, *,
        store_only: bool = False,
    ) -> torch.Tensor | None:
        """qkv [N, (H + 2KV) * D] -> attention output [N, H, D]; the rows' K/V stored in the layer's cache.
        `store_only`: the same kernels store the K/V (so bit-equal), nothing attends, -> None."""
        cfg, ops = self.config, self.ops
        k_cache, v_cache = kv_cache.k[layer.layer_idx], kv_cache.v[layer.layer_idx]  # [blocks, bs, KV, D]
        scales = kv_cache.scales(layer.layer_idx)  # an FP8 cache's k_scale, v_scale; else none
        rope = (layer.q_norm, layer.k_norm, self.cos, self.sin, step.positions, step.slot_mapping)
        if step.max_query_len == 1 and self.fused_rope and step.num_parts <= FUSED_ROPE_MAX_PARTS:
            return ops.decode_attention_rope(qkv, *rope, k_cache, v_cache, step.block_tables, step.seq_lens,
                                             step.num_parts, cfg.num_attention_heads, cfg.rms_norm_eps,
                                             store_only=store_only, **scales)
        q = ops.qk_norm_rope_store(qkv, *rope, k_cache, v_cache, cfg.num_attention_heads,
                                   cfg.num_key_value_heads, cfg.rms_norm_eps, **scales)  # [N, H, D]
        if store_only:
            return None
        if step.max_query_len == 1:
            return ops.decode_attention(q, k_cache, v_cache, step.block_tables, step.seq_lens, step.num_parts,
                                        **scales)
        return ops.prefill_attention(q, k_cache, v_cache, step.block_tables, step.seq_lens, step.query_start,
                                     step.max_query_len, **scales)

    def _tail(
        self, layers: tuple[LayerWeights, ...], x: torch.Tensor, residual: torch.Tensor | None,
        step: StepInputs, kv_cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        for layer in layers:
            x, residual = self._layer(layer, x, residual, step, kv_cache)
        return x, residual

    def _head(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: torch.Tensor, head: object, step: StepInputs
    ) -> torch.Tensor:
        if step.max_query_len != 1:  # only each sequence's last row reaches the head
            x = x.index_select(0, step.logits_indices)
            residual = None if residual is None else residual.index_select(0, step.logits_indices)
        if self.one_row == "gemv" and x.shape[0] == 1:
            from runtime.kernels.gemv import RMSNORM

            # float32 logits straight from the kernel (rounded to bf16 first: the values of `.float()`)
            return _gemv(x, head, RMSNORM, residual, norm, self.config.rms_norm_eps, torch.float32)[0]
        h, _ = self.ops.add_rmsnorm(x, residual, norm, self.config.rms_norm_eps)  # [S, hidden]
        logits = self._linear(h, head)
        return logits.float() if self.float_logits else logits

    @torch.inference_mode()
    def __call__(
        self, step: StepInputs, kv_cache: KVCache, *, text: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """-> (text logits [S, Vt] or None, audio logits [S, Va]).

        `text=False` (an audio-only step: every sampling row is in audio mode, where the sampled text token is
        overwritten with MODALITY_PAD, runtime/sampling.py): the text tail still stores its K/V in every
        layer (later text rows attend to them), but its last layer stops after its K/V store and the text
        norm and head do not run: the last layer's o, gate/up and down matrices and the 151680-row head,
        1.58 GB of the 16.8 GB a bf16 step reads. The audio logits and every cache entry are bit-equal to
        the whole step's."""
        most = self.pdl_max_rows if step.max_query_len == 1 else PDL_PREFILL_MAX_ROWS
        with pdl_launches(self.pdl if step.tokens.shape[0] <= most else "off"):
            return self._forward(step, kv_cache, text)

    def _forward(
        self, step: StepInputs, kv_cache: KVCache, text: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        w = self.weights
        x = self.embed(step.tokens, step.is_audio)  # [N, hidden]
        x, residual = self._tail(w.shared, x, None, step, kv_cache)
        text_out = self._text_out if text else self._text_kv
        if self.tail_stream is None or step.max_query_len != 1:  # prefill: compute-bound, see __init__
            return text_out(x, residual, step, kv_cache), self._audio_out(x, residual, step, kv_cache)
        # fork: the audio branch waits for the shared layers, then runs beside the text branch. Memory: x and
        # residual stay referenced here until after the join, so the main stream cannot reuse them early; the
        # side stream only ever runs after a wait on the main one, so it cannot reuse the audio logits'
        # memory before the main stream's readers of them (enqueued earlier) have run.
        main = torch.cuda.current_stream(x.device)
        self.tail_stream.wait_stream(main)
        with torch.cuda.stream(self.tail_stream):
            audio_logits = self._audio_out(x, residual, step, kv_cache)
        text_logits = text_out(x, residual, step, kv_cache)
        main.wait_stream(self.tail_stream)
        return text_logits, audio_logits

    def _text_out(
        self, x: torch.Tensor, residual: torch.Tensor | None, step: StepInputs, kv_cache: KVCache
    ) -> torch.Tensor:
        """Text tail and head -> [S, Vt] logits (dtype: see the class)."""
        text, text_res = self._tail(self.weights.text, x, residual, step, kv_cache)
        return self._head(text, text_res, self.weights.text_norm, self.weights.text_head, step)

    def _text_kv(
        self, x: torch.Tensor, residual: torch.Tensor | None, step: StepInputs, kv_cache: KVCache
    ) -> None:
        """The text tail's K/V stores only (an audio-only step, see __call__)."""
        *layers, last = self.weights.text
        x, residual = self._tail(tuple(layers), x, residual, step, kv_cache)
        self._layer(last, x, residual, step, kv_cache, kv_only=True)

    def _audio_out(
        self, x: torch.Tensor, residual: torch.Tensor | None, step: StepInputs, kv_cache: KVCache
    ) -> torch.Tensor:
        """Audio tail and head -> [S, Va] logits (dtype: see the class)."""
        audio, audio_res = self._tail(self.weights.audio, x, residual, step, kv_cache)
        return self._head(audio, audio_res, self.weights.audio_norm, self.weights.audio_head, step)


def _gemv(
    x: torch.Tensor, w: object, prologue: int, residual: torch.Tensor | None = None,
    norm: torch.Tensor | None = None, eps: float = 1e-6, out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One-row GEMV on a bf16 or FP8 weight (see runtime/kernels/gemv.py)."""
    from runtime.kernels.gemv import gemv

    kw = {"prologue": prologue, "residual": residual, "norm_weight": norm, "eps": eps, "out_dtype": out_dtype}
    if isinstance(w, Fp8Weight):
        return gemv(x, w.weight, scale=w.scale, **kw)
    assert isinstance(w, torch.Tensor)
    return gemv(x, w, **kw)


def max_blocks_for(max_model_len: int, block_size: int) -> int:
    """Block-table width that covers `max_model_len` positions."""
    return math.ceil(max_model_len / block_size)
