"""Channels-last storage of [B, C, T] activations (torch only; the CUDA paths keep their data so).

A [B, C, T] tensor stored channels-last is the transposed view of a contiguous [B, T, C]: frames are rows
with their channels contiguous. cuDNN's Hopper convs take that layout without conversions (BigVGAN,
`mel_vocoder.use_channels_last`), and the flow estimator's transformers, which treat frames as rows, read
it without a copy (`FlowEstimator.channels_last`).
"""

from __future__ import annotations

import torch


def is_channels_last(x: torch.Tensor) -> bool:
    """x [B, C, T] stored time-major, channels contiguous (strides (T*C, 1, C))."""
    bsz, channels, length = x.shape
    return channels > 1 and x.stride(1) == 1 and (length == 1 or x.stride(2) == channels) and (
        bsz == 1 or x.stride(0) == channels * length)


def to_channels_last(x: torch.Tensor) -> torch.Tensor:
    """[B, C, T] (or a conv weight [O, I, K]) with the same values, stored channels-last. A no-op for a
    tensor already stored so."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def empty_channels_last(b: int, c: int, t: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised [B, C, T] stored channels-last, on `like`'s device with its dtype."""
    return torch.empty(b, t, c, device=like.device, dtype=like.dtype).transpose(1, 2)


def cat_channels(tensors: list[torch.Tensor], channels_last: bool | None = None) -> torch.Tensor:
    """torch.cat(tensors, dim=1) of [B, C_i, T] tensors, stored channels-last if `channels_last` (None: when
    the first one is)."""
    if channels_last if channels_last is not None else is_channels_last(tensors[0]):
        return torch.cat([x.transpose(1, 2) for x in tensors], dim=2).transpose(1, 2)
    return torch.cat(tensors, dim=1)


def pointwise_conv(conv: torch.nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """A kernel-1 Conv1d; on channels-last x as one matmul over frames, its output channels-last too (a conv1d
    would copy x to channels-first first)."""
    return pointwise(x, conv.weight[:, :, 0], conv.bias)


def pointwise(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`pointwise_conv` from the conv's [C_out, C_in] weight and bias."""
    if is_channels_last(x):
        return torch.nn.functional.linear(x.transpose(1, 2), weight, bias).transpose(1, 2)
    return torch.nn.functional.conv1d(x, weight[:, :, None], bias)
