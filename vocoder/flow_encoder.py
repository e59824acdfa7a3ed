"""Code encoder of the flow: codes (12.5 Hz) -> mu, 80 x 4 mel-rate frames per code.

Sees exactly LOOKAHEAD_CODES codes to the right (pre-lookahead conv) and otherwise only the past, with
a bounded left receptive field (`EncoderConfig.left_context_codes`), so a stream can recompute it over
a bounded code history and get the same values as a whole-sequence pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vocoder.config import MEL_FRAMES_PER_CODE, NUM_MELS, EncoderConfig


def sliding_causal_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """Bool [T, T]: query i may attend key j iff 0 <= i - j < window."""
    pos = torch.arange(length, device=device)
    diff = pos[:, None] - pos[None, :]
    return (diff >= 0) & (diff < window)


class EncoderBlock(nn.Module):
    """Causal depthwise conv (relative position), windowed causal self-attention, feed-forward."""

    def __init__(self, dim: int, num_heads: int, ffn_dim: int, conv_kernel: int):
        super().__init__()
        self.num_heads = num_heads
        self.conv_kernel = conv_kernel
        self.conv_norm = nn.LayerNorm(dim)
        self.dwconv = nn.Conv1d(dim, dim, conv_kernel, groups=dim)
        self.attn_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.ffn_norm = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(), nn.Linear(ffn_dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, D], mask [T, T] bool -> [B, T, D]."""
        b, t, d = x.shape
        h = self.conv_norm(x).transpose(1, 2)  # [B, D, T]
        x = x + self.dwconv(F.pad(h, (self.conv_kernel - 1, 0))).transpose(1, 2)
        q, k, v = self.qkv(self.attn_norm(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.num_heads, d // self.num_heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, T, Dh]
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        return x + self.ffn(self.ffn_norm(x))


class CodeEncoder(nn.Module):
    """codes -> mu (the flow's per-frame condition)."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.dim
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.lookahead_conv = nn.Conv1d(d, d, cfg.lookahead + 1)  # output i sees codes i..i+lookahead
        self.lookahead_causal = nn.Conv1d(d, d, 3)
        self.code_blocks = nn.ModuleList(
            EncoderBlock(d, cfg.num_heads, cfg.ffn_dim, cfg.conv_kernel) for _ in range(cfg.num_code_blocks)
        )
        self.upsample_conv = nn.Conv1d(d, d, cfg.upsample_kernel)
        self.frame_blocks = nn.ModuleList(
            EncoderBlock(d, cfg.num_heads, cfg.ffn_dim, cfg.conv_kernel) for _ in range(cfg.num_frame_blocks)
        )
        self.final_norm = nn.LayerNorm(d)
        self.proj = nn.Linear(d, NUM_MELS)

    def forward(self, codes: torch.Tensor, num_valid: torch.Tensor) -> torch.Tensor:
        """codes [B, N] long (rows right-padded), num_valid [B] -> mu [B, NUM_MELS, 4N].

        Positions at or beyond a row's `num_valid` are zero vectors, exactly what a whole-sequence pass
        sees past the end of the stream; so a row's valid outputs never depend on its neighbours.
        """
        n = codes.shape[1]
        valid = torch.arange(n, device=codes.device)[None, :] < num_valid[:, None]  # [B, N]
        x = self.embed(codes) * valid[:, :, None].to(self.embed.weight.dtype)  # [B, N, D]
        h = x.transpose(1, 2)  # [B, D, N]
        h = F.leaky_relu(self.lookahead_conv(F.pad(h, (0, self.cfg.lookahead))))
        h = self.lookahead_causal(F.pad(h, (2, 0)))
        x = x + h.transpose(1, 2)  # [B, N, D]
        mask = sliding_causal_mask(n, self.cfg.code_attention_window, codes.device)
        for block in self.code_blocks:
            x = block(x, mask)
        h = x.transpose(1, 2).repeat_interleave(MEL_FRAMES_PER_CODE, dim=2)  # [B, D, 4N]
        h = self.upsample_conv(F.pad(h, (self.cfg.upsample_kernel - 1, 0)))
        x = h.transpose(1, 2)  # [B, 4N, D]
        mask = sliding_causal_mask(x.shape[1], self.cfg.frame_attention_window, codes.device)
        for block in self.frame_blocks:
            x = block(x, mask)
        return self.proj(self.final_norm(x)).transpose(1, 2)  # [B, 80, 4N]
