"""The fast path's per-layer operations, in two interchangeable backends.

`TorchOps` is pure PyTorch (runs anywhere; it is what CPU tests exercise) and rounds exactly as the
plain model (runtime/layers.py, runtime/attention.py). `TritonOps` calls the fused Triton kernels of
runtime/kernels/ and reads the paged cache in place. Both take static-shape tensors only, so a step
built from them can be captured in a CUDA graph.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

from runtime.kernels import HAS_TRITON
from runtime.kv_cache import read_rows, store_rows
from runtime.layers import apply_rotary


class TorchOps:
    """Reference backend (CPU fallback)."""

    name = "torch"

    @staticmethod
    def add_rmsnorm(
        x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(x + residual) * weight, x + residual); x, residual [N, C]."""
        summed = x if residual is None else x + residual
        xf = summed.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
        return weight * xf.to(summed.dtype), summed

    @staticmethod
    def qk_norm_rope_store(
        qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos_table: torch.Tensor,
        sin_table: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, eps: float, *,
        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """qkv [N, (H + 2KV) * D] -> q [N, H, D]; K/V stored at slot_mapping (slots < 0 skipped; FP8 codes
        and their scales where `k_scale`, `v_scale` are given: runtime/kv_cache.py)."""
        n, head_dim = qkv.shape[0], q_norm.shape[0]
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
        cos, sin = cos_table[positions], sin_table[positions]  # [N, D]
        q = apply_rotary(_rms(q.reshape(n, num_heads, head_dim), q_norm, eps), cos, sin)  # [N, H, D]
        k = apply_rotary(_rms(k.reshape(n, num_kv_heads, head_dim), k_norm, eps), cos, sin)  # [N, KV, D]
        v = v.reshape(n, num_kv_heads, head_dim)
        keep = slot_mapping >= 0
        store_rows(k_cache, k_scale, slot_mapping[keep], k[keep])
        store_rows(v_cache, v_scale, slot_mapping[keep], v[keep])
        return q

    @staticmethod
    def embed(tokens: torch.Tensor, is_audio: torch.Tensor, text_table: torch.Tensor,
              audio_table: torch.Tensor) -> torch.Tensor:
        """[N] -> [N, hidden]: text table for text rows, audio table for audio rows (static shapes)."""
        zero = torch.zeros_like(tokens)
        text = F.embedding(torch.where(is_audio, zero, tokens), text_table)  # [N, hidden]
        audio = F.embedding(torch.where(is_audio, tokens, zero), audio_table)  # [N, hidden]
        return torch.where(is_audio[:, None], audio, text)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [N, 2I] -> silu(gate) * up [N, I]."""
        gate, up = gate_up.chunk(2, dim=1)
        return F.silu(gate) * up

    @staticmethod
    def decode_attention(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
        seq_lens: torch.Tensor, num_parts: int, *, k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [B, H, D], one row per sequence -> [B, H, D] (gathers keys; reference only)."""
        block_size = k_cache.shape[1]
        pos = torch.arange(block_tables.shape[1] * block_size, device=q.device)  # [Kmax]
        slots = block_tables.long()[:, pos // block_size] * block_size + pos % block_size  # [B, Kmax]
        k = read_rows(k_cache, k_scale, slots, q.dtype).transpose(1, 2)  # [B, KV, Kmax, D]
        v = read_rows(v_cache, v_scale, slots, q.dtype).transpose(1, 2)
        mask = (pos[None, :] < seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, Kmax]
        out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, enable_gqa=True)
        return out.squeeze(2)

    @classmethod
    def decode_attention_rope(cls, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        """`qk_norm_rope_store` then `decode_attention` (one op so that a backend may fuse them); arguments
        as runtime.kernels.paged_attention.paged_decode_attention_rope -> [B, H, D] (`store_only`: None)."""
        return rope_then_attend(cls, *args, **kwargs)

    @staticmethod
    def prefill_attention(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
        seq_lens: torch.Tensor, query_start: torch.Tensor, max_query_len: int, *,
        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [N, H, D] grouped by sequence -> [N, H, D], causal over earlier pages and the new rows."""
        block_size = k_cache.shape[1]
        out = torch.empty_like(q)
        starts, lens = query_start.tolist(), seq_lens.tolist()
        for s, seq_len in enumerate(lens):
            lo, hi = starts[s], starts[s + 1]
            if hi == lo:  # a sequence with no new rows (e.g. empty padding of a prefill graph)
                continue
            pos = torch.arange(seq_len, device=q.device)
            slots = block_tables[s].long()[pos // block_size] * block_size + pos % block_size  # [seq_len]
            q_s = q[lo:hi].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
            k_s = read_rows(k_cache, k_scale, slots, q.dtype).transpose(0, 1).unsqueeze(0)  # [1, KV, K, D]
            v_s = read_rows(v_cache, v_scale, slots, q.dtype).transpose(0, 1).unsqueeze(0)
            q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=q.device)
            mask = pos[None, :] <= q_pos[:, None]  # [Q, K]
            o = F.scaled_dot_product_attention(q_s, k_s, v_s, attn_mask=mask, enable_gqa=True)
            out[lo:hi] = o.squeeze(0).transpose(0, 1)
        return out

    @staticmethod
    def decode_num_parts(batch: int, num_kv_heads: int, max_context: int, **_: object) -> int:
        return 1


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same math as RMSNorm.forward (runtime/layers.py), on a plain weight tensor."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class TritonOps:
    """Fused Triton kernels (CUDA only)."""

    name = "triton"

    def __init__(self, fallback: Iterable[str] = ()) -> None:
        """`fallback`: op names (e.g. "decode_attention") to run with the PyTorch op instead."""
        if not HAS_TRITON:
            raise RuntimeError("TritonOps needs triton (use TorchOps on this machine)")
        from runtime.kernels import elementwise, paged_attention

        self._ew = elementwise
        self._pa = paged_attention
        self.add_rmsnorm = elementwise.add_rmsnorm
        self.qk_norm_rope_store = elementwise.qk_norm_rope_store
        self.silu_mul = elementwise.silu_mul
        self.embed = elementwise.embed
        self.prefill_attention = paged_attention.paged_prefill_attention
        self.decode_attention_rope = paged_attention.paged_decode_attention_rope
        self.decode_num_parts = paged_attention.decode_num_parts
        self.fallback = sorted(fallback)
        for name in self.fallback:
            setattr(self, name, getattr(TorchOps, name))
        if {"qk_norm_rope_store", "decode_attention", "decode_attention_rope"} & set(self.fallback):
            # the fused op contains both: run this backend's two ops (each a kernel or its fallback)
            self.decode_attention_rope = functools.partial(rope_then_attend, self)

    def decode_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
        seq_lens: torch.Tensor, num_parts: int, **scales: torch.Tensor | None,
    ) -> torch.Tensor:
        return self._pa.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, num_parts=num_parts,
                                               **scales)


def rope_then_attend(
    ops: Any, qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos_table: torch.Tensor,
    sin_table: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, num_parts: int, num_heads: int,
    eps: float, *, store_only: bool = False, **scales: torch.Tensor | None,
) -> torch.Tensor | None:
    """`decode_attention_rope` as two of `ops`'s ops: q/k norm + RoPE + K/V store, then decode attention
    (`store_only`: the first alone, -> None). `scales`: `k_scale`, `v_scale` of an FP8 cache."""
    q = ops.qk_norm_rope_store(qkv, q_norm, k_norm, cos_table, sin_table, positions, slot_mapping, k_cache,
                               v_cache, num_heads, k_cache.shape[2], eps, **scales)
    if store_only:
        return None
    return ops.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, num_parts, **scales)


def default_ops(device: torch.device | str) -> TorchOps | TritonOps:
    """Triton kernels on CUDA when Triton is present, else the PyTorch reference ops."""
    if torch.device(device).type == "cuda" and HAS_TRITON:
        return TritonOps()
    return TorchOps()


def rope_tables(max_positions: int, head_dim: int, theta: float, dtype: torch.dtype,
                device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, D] computed exactly as layers.rotary_cos_sin does per step."""
    from runtime.layers import rotary_cos_sin

    positions = torch.arange(max_positions, device=device)
    return rotary_cos_sin(positions, head_dim, theta, dtype)

