"""Causal building blocks of the flow estimator, with explicit left-context caches for streaming."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vocoder.layout import pointwise_conv


class ConvCache:
    """Left context for every causal conv of one estimator forward.

    Whole-sequence mode (`caches=None`): each conv sees zero padding, as at the start of a stream.
    Streaming mode: conv i is fed `caches[i]` ([B, C, context]) in front of the new frames, and the
    last `context` inputs of each row's first `num_valid[b]` new frames are collected in `updated`,
    so right-padding of shorter rows in a batch never leaks into any row's state.
    """

    def __init__(self, caches: list[torch.Tensor] | None = None, num_valid: torch.Tensor | None = None):
        self.caches = caches
        self.num_valid = num_valid  # [B] long, new valid frames per row
        self.index = 0
        self.updated: list[torch.Tensor] = []
        self._last_frames: dict[int, torch.Tensor] = {}  # context -> gather index [B, 1, ctx]

    def take(self, x: torch.Tensor, context: int) -> torch.Tensor | None:
        """The next conv's cache ([B, C, context]; None in whole-sequence mode), for a fused conv that
        reads it in place and appends its updated cache itself (`extend` without the concatenation)."""
        cache = None if self.caches is None else self.caches[self.index]
        assert cache is None or cache.shape == (x.shape[0], x.shape[1], context), (cache.shape, x.shape)
        self.index += 1
        return cache

    def extend(self, x: torch.Tensor, context: int) -> torch.Tensor:
        """Prepend `context` frames of history: [B, C, T] -> [B, C, context + T]."""
        cache = self.take(x, context)
        full = F.pad(x, (context, 0)) if cache is None else torch.cat([cache.to(x.dtype), x], dim=2)
        if self.num_valid is not None:
            idx = self._last_frames.get(context)
            if idx is None:  # the same positions for every conv of this context: built once per forward
                offsets = torch.arange(context, device=x.device)  # [ctx]
                idx = self._last_frames[context] = (self.num_valid[:, None] + offsets[None, :])[:, None, :]
            self.updated.append(torch.gather(full, 2, idx.expand(-1, x.shape[1], -1)))  # [B, C, ctx]
        return full


class CausalConv1d(nn.Conv1d):
    """Conv1d that only looks left (kernel - 1 frames of history)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3):
        super().__init__(in_channels, out_channels, kernel_size, padding=0)
        self.use_triton = False  # set by StreamingVocoder on CUDA: vocoder/kernels/flow_fused.py
        self._taps: torch.Tensor | None = None  # the weight as [taps, C_out, C_in] for the kernel
        self._taps_key: tuple | None = None

    def forward(self, x: torch.Tensor, cache: ConvCache) -> torch.Tensor:  # type: ignore[override]
        """[B, C_in, T] -> [B, C_out, T]."""
        if self.use_triton and x.is_cuda:
            return self.forward_fused(x, cache)
        return super().forward(cache.extend(x, self.kernel_size[0] - 1))

    def forward_fused(
        self,
        x: torch.Tensor,
        cache: ConvCache,
        norm: nn.LayerNorm | None = None,
        add: torch.Tensor | None = None,
        residual: tuple[nn.Conv1d, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """This conv, then (with `norm`) LayerNorm over channels and Mish, then + add[b, c], then + the 1x1
        conv of `residual` (conv, its input), and the cache update, in Triton kernels
        (vocoder/kernels/flow_fused.py); keeps x's layout (vocoder/layout.py)."""
        from vocoder.kernels.flow_fused import causal_conv_norm_mish

        weight = self.weight
        key = (weight.data_ptr(), weight.dtype, weight._version)
        if self._taps_key != key:  # [taps, C_out, C_in], rebuilt only when the weight changes
            self._taps = weight.detach().permute(2, 0, 1).contiguous()
            self._taps_key = key
        prev = cache.take(x, self.kernel_size[0] - 1)
        stats = None if norm is None else (norm.weight, norm.bias, norm.eps)
        res = None if residual is None else (residual[1], residual[0].weight[:, :, 0], residual[0].bias)
        y, updated = causal_conv_norm_mish(x, prev, self._taps, self.bias, stats, add, cache.num_valid, res)
        if updated is not None:
            cache.updated.append(updated)
        return y


class CausalBlock(nn.Module):
    """Causal conv -> LayerNorm over channels -> Mish (no mixing across time except the conv)."""

    def __init__(self, dim: int, dim_out: int):
        super().__init__()
        self.conv = CausalConv1d(dim, dim_out, 3)
        self.norm = nn.LayerNorm(dim_out)
        self.use_triton = False  # set by StreamingVocoder on CUDA: vocoder/kernels/flow_fused.py

    def forward(self, x: torch.Tensor, cache: ConvCache, add: torch.Tensor | None = None) -> torch.Tensor:
        """[B, C_in, T] -> [B, C_out, T]; `add` [B, C_out] is added to every frame after the Mish."""
        if self.use_triton and x.is_cuda:  # the whole block in one kernel
            return self.conv.forward_fused(x, cache, self.norm, add)
        h = self.conv(x, cache)  # [B, C, T]
        h = F.mish(self.norm(h.transpose(1, 2)).transpose(1, 2))
        return h if add is None else h + add[:, :, None]


class CausalResnetBlock(nn.Module):
    """Two causal blocks with the timestep embedding added in between, plus a 1x1 residual."""

    def __init__(self, dim: int, dim_out: int, time_dim: int):
        super().__init__()
        self.block1 = CausalBlock(dim, dim_out)
        self.time_mlp = nn.Linear(time_dim, dim_out)
        self.block2 = CausalBlock(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def time_bias(self, t_emb: torch.Tensor) -> torch.Tensor:
        """t_emb [N, time_dim] -> the [N, C_out] added after block1 (a function of t alone)."""
        return self.time_mlp(F.mish(t_emb))

    def forward(self, x: torch.Tensor, time_bias: torch.Tensor, cache: ConvCache) -> torch.Tensor:
        """x [B, C_in, T], time_bias [B, C_out] (`time_bias(t_emb)`) -> [B, C_out, T]."""
        h = self.block1(x, cache, add=time_bias)
        if self.block2.use_triton and h.is_cuda:  # block2 and the residual add in its kernels
            return self.block2.conv.forward_fused(h, cache, self.block2.norm, residual=(self.res_conv, x))
        h = self.block2(h, cache)
        return h + pointwise_conv(self.res_conv, x)


class ChunkTransformer(nn.Module):
    """Pre-norm transformer block whose attention stays inside fixed, code-aligned chunks of frames.

    No state crosses a chunk boundary, so streaming needs no KV cache; time mixing across chunks comes
    from the causal convs.
    """

    # Above this many rows cuBLAS's matmuls beat the fused kernels (bench/vocoder_profile.py measures both).
    fused_max_rows = 1024

    def __init__(self, dim: int, num_heads: int, head_dim: int, ffn_mult: int, chunk: int):
        super().__init__()
        self.num_heads, self.head_dim, self.chunk = num_heads, head_dim, chunk
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * num_heads * head_dim, bias=False)
        self.out = nn.Linear(num_heads * head_dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, ffn_mult * dim), nn.GELU(), nn.Linear(ffn_mult * dim, dim))
        self.use_triton = False  # set by StreamingVocoder on CUDA: vocoder/kernels/chunk_attention.py
        self.fuse_linears = True  # with use_triton: norms, linears, GELU, residuals fused (flow_fused.py)
        self.fuse_norms = True  # with fuse_linears, above fused_max_rows: the norms (and an add) as kernels
        self.fuse_attention = True  # with fuse_linears, up to fused_max_rows: LN1 + QKV + attention as one kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, C] -> [B, T, C] (frames as rows, so stacked blocks need no layout change between them);
        T must be a multiple of the chunk."""
        b, t, c = x.shape
        assert t % self.chunk == 0, (t, self.chunk)
        if self.use_triton and x.is_cuda and self.fuse_linears:
            if b * t <= self.fused_max_rows:
                return self._forward_fused(x)
            if self.fuse_norms:
                return self._forward_rows(x)
        h = x.reshape(b * t // self.chunk, self.chunk, c)  # [B*N, chunk, C]
        qkv = self.qkv(self.norm1(h))  # [B*N, chunk, 3*H*D]
        if self.use_triton and h.is_cuda:
            from vocoder.kernels.chunk_attention import chunk_attention

            flat = chunk_attention(qkv.reshape(-1, qkv.shape[-1]), self.num_heads, self.head_dim, self.chunk)
            a = flat.reshape(h.shape[0], self.chunk, -1)
        else:
            shape = (h.shape[0], self.chunk, self.num_heads, self.head_dim)
            q, k, v = (z.reshape(shape).transpose(1, 2) for z in qkv.chunk(3, dim=-1))  # [B*N, H, chunk, D]
            a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(h.shape[0], self.chunk, -1)
        h = h + self.out(a)
        h = h + self.ff(self.norm2(h))
        return h.reshape(b, t, c)

    def _forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The same block at many rows: cuBLAS's linears, the chunk attention kernel, and each LayerNorm in one
        Triton pass, the second with the residual add before it (flow_fused.add_layer_norm)."""
        from vocoder.kernels.chunk_attention import chunk_attention
        from vocoder.kernels.flow_fused import add_layer_norm

        b, t, c = x.shape
        h = x.reshape(b * t, c)
        n1, n2 = self.norm1, self.norm2
        _, normed = add_layer_norm(h, None, (n1.weight, n1.bias, n1.eps))
        a = chunk_attention(F.linear(normed, self.qkv.weight), self.num_heads, self.head_dim, self.chunk)
        h, normed = add_layer_norm(h, self.out(a), (n2.weight, n2.bias, n2.eps))
        h = h + self.ff(normed)
        return h.reshape(b, t, c)

    def _forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """The same block in 4 Triton kernels (vocoder/kernels/flow_fused.py): LN1+QKV+chunk attention (one
        program per head and 16 rows), out+residual, LN2+FF1+GELU, FF2+residual; without `fuse_attention`
        5, the attention a kernel of its own after LN1+QKV. (The attention inside the out projection's
        programs, each recomputing every head for its rows, was slower: bench/results/vocoder-attn-out-h200/.)"""
        from vocoder.kernels.chunk_attention import chunk_attention
        from vocoder.kernels.flow_fused import fused_linear, ln_qkv_attention

        b, t, c = x.shape
        h = x.reshape(b * t, c)
        n1, n2 = self.norm1, self.norm2
        if self.fuse_attention and 16 % self.chunk == 0 and self.head_dim >= 16:  # tl.dot's smallest side
            a = ln_qkv_attention(h, self.qkv.weight, (n1.weight, n1.bias, n1.eps), self.num_heads, self.head_dim,
                                 self.chunk)
        else:
            qkv = fused_linear(h, self.qkv.weight, norm=(n1.weight, n1.bias, n1.eps))
            a = chunk_attention(qkv, self.num_heads, self.head_dim, self.chunk)
        h = fused_linear(a, self.out.weight, self.out.bias, residual=h)
        f = fused_linear(h, self.ff[0].weight, self.ff[0].bias, norm=(n2.weight, n2.bias, n2.eps), gelu=True)
        h = fused_linear(f, self.ff[2].weight, self.ff[2].bias, residual=h)
        return h.reshape(b, t, c)


class TimestepEmbedding(nn.Module):
    """Sinusoidal embedding of t in [0, 1] (scaled by 1000) followed by an MLP."""

    def __init__(self, sin_dim: int, out_dim: int):
        super().__init__()
        self.sin_dim = sin_dim
        self.mlp = nn.Sequential(nn.Linear(sin_dim, out_dim), nn.SiLU(), nn.Linear(out_dim, out_dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """t [B] -> [B, out_dim]."""
        half = self.sin_dim // 2
        freqs = torch.exp(
            torch.arange(half, device=t.device, dtype=torch.float32) * (-math.log(10000) / (half - 1))
        )
        arg = 1000.0 * t.float()[:, None] * freqs[None, :]  # [B, half]
        emb = torch.cat([arg.sin(), arg.cos()], dim=-1)  # [B, sin_dim]
        return self.mlp(emb.to(self.mlp[0].weight.dtype))
