"""Qwen3 building blocks: RMSNorm, rotary embeddings, SwiGLU MLP, GQA self-attention, decoder layer.

Parameter names match the checkpoint (`self_attn.q_proj.weight`, `mlp.gate_proj.weight`, ...).
Attention itself is delegated to an `AttentionBackend` so the same layer runs over the paged KV
cache (engine) or over a whole sequence with no cache (reference).
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from runtime.config import ModelConfig


class AttentionBackend(Protocol):
    """Computes attention for one layer instance given its new rows' q [N, H, D], k, v [N, KV, D]."""

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Return the attention output [N, H, D]."""
        ...


class RMSNorm(nn.Module):
    """RMSNorm as in Qwen3: normalise in float32, cast back, then scale by the weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] -> same shape and dtype."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, head_dim] for the given positions; frequencies computed in float32 (as HF Qwen3)."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [D/2]
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [N, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D]; cos, sin: [N, D] -> rotated x (HF rotate_half convention)."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), no bias."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, hidden] -> [N, hidden]."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SelfAttention(nn.Module):
    """GQA self-attention with per-head q/k RMSNorm before RoPE (Qwen3)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        layer_idx: int,
    ) -> torch.Tensor:
        """x: [N, hidden] -> [N, hidden]."""
        n = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(n, self.num_heads, self.head_dim))  # [N, H, D]
        k = self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim))  # [N, KV, D]
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)  # [N, KV, D]
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        out = backend(layer_idx, q, k, v)  # [N, H, D]
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer; `layer_idx` is its KV cache layer-instance index (not a parameter)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        """x: [N, hidden] -> [N, hidden]."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend, self.layer_idx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LayerStack(nn.Module):
    """A run of decoder layers (`<block>.layers.{i}`) with consecutive layer-instance indices."""

    def __init__(self, config: ModelConfig, num_layers: int, first_layer_idx: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(config, first_layer_idx + i) for i in range(num_layers))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        """x: [N, hidden] -> [N, hidden]."""
        for layer in self.layers:
            x = layer(x, cos, sin, backend)
        return x
