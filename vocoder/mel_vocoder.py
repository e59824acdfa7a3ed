"""Mel -> waveform with BigVGAN from the `bigvgan` package, built for this mel (24 kHz, 80 bins, hop 480).

Checkpoints: a safetensors file holding the generator state dict (BigVGAN's published `bigvgan_generator.pt`
stores {"generator": state_dict}; convert that once to safetensors elsewhere; pickles are never loaded here).
Keys may carry weight-norm pairs (`weight_g`/`weight_v`, as trained) or folded weights, with or without a
`generator.` prefix.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import os
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vocoder.config import HOP_LENGTH, BigVGANConfig
from vocoder.kernels import HAS_TRITON
from vocoder.layout import is_channels_last, to_channels_last
from vocoder.safetensors_io import read_safetensors

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # bigvgan imports huggingface_hub; never go online from here

from bigvgan.alias_free_activation.torch.act import Activation1d
from bigvgan.bigvgan import AMPBlock1, AMPBlock2, BigVGAN
from bigvgan.env import AttrDict

Interval = tuple[int, int]


def _quiet_remove_weight_norm(model: BigVGAN) -> None:
    with contextlib.redirect_stdout(io.StringIO()):  # bigvgan prints "Removing weight norm..."
        model.remove_weight_norm()


def _randomize(model: BigVGAN, seed: int) -> None:
    """Deterministic weights with unit-gain scaling, so an untrained generator makes audible, unclipped PCM."""
    gen = torch.Generator().manual_seed(seed)
    residual_convs = {id(m) for block in model.resblocks for m in block.modules()}
    for module in model.modules():
        if isinstance(module, nn.Conv1d | nn.ConvTranspose1d):
            w = module.weight
            fan_in = w.shape[1] * w.shape[2] if isinstance(module, nn.Conv1d) else w.shape[0] * w.shape[2]
            if isinstance(module, nn.ConvTranspose1d):
                fan_in = w.shape[0] * w.shape[2] // module.stride[0]
            with torch.no_grad():
                gain = 0.3 if id(module) in residual_convs else 1.0  # keep AMP residual sums from growing
                w.copy_(torch.randn(w.shape, generator=gen) * (gain / math.sqrt(fan_in)))
                if module.bias is not None:
                    module.bias.zero_()
    with torch.no_grad():
        model.conv_post.weight.mul_(0.03)  # PCM std ~0.15, away from the [-1, 1] clamp


def build_generator(
    cfg: BigVGANConfig,
    *,
    checkpoint: str | Path | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> BigVGAN:
    """A BigVGAN generator in eval mode with weight norm folded; random (seeded) unless a checkpoint is given."""
    cfg.validate()
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # bigvgan uses the old weight_norm API
        torch.manual_seed(seed)  # bigvgan initialises from the global RNG
        model = BigVGAN(AttrDict(cfg.to_hparams()), use_cuda_kernel=False)
    if checkpoint is None:
        _quiet_remove_weight_norm(model)
        _randomize(model, seed)
    else:
        path = Path(checkpoint)
        if path.suffix != ".safetensors":
            raise ValueError(f"BigVGAN checkpoint must be a .safetensors generator state dict, got {path}")
        stored = read_safetensors(path, "BigVGAN checkpoint")
        state = {k.removeprefix("generator."): v for k, v in stored.items()}
        if len(state) != len(stored):  # "x" and "generator.x" both stored: one would be dropped unseen
            twice = sorted(k for k in state if k in stored and f"generator.{k}" in stored)
            raise ValueError(f"BigVGAN checkpoint {path} stores {twice[:5]} both with and without 'generator.'")
        has_weight_norm = any(k.endswith("weight_g") for k in state)
        if not has_weight_norm:
            _quiet_remove_weight_norm(model)
        try:
            missing, unexpected = model.load_state_dict(state, strict=False)
        except RuntimeError as exc:  # shape mismatch
            raise ValueError(f"BigVGAN checkpoint {path} does not match the config: {exc}") from None
        if missing or unexpected:
            raise ValueError(
                f"BigVGAN checkpoint {path} does not match the config: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
        if has_weight_norm:
            _quiet_remove_weight_norm(model)
    return model.to(device=device, dtype=dtype).eval()


class ChannelsLastConv1d(nn.Conv1d):
    """A Conv1d (same parameters) that runs as a conv2d over a [B, C, 1, T] view. On channels-last data
    that view is NHWC, which cuDNN's Hopper kernels take as is; conv1d itself makes every 3-d input
    contiguous (channels-first) before it reaches cuDNN, which then converts it back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias, late = _split_bias(self.bias, x)
        y = F.conv2d(x.unsqueeze(2), self.weight.unsqueeze(2), bias, (1, self.stride[0]), (0, self.padding[0]),
                     (1, self.dilation[0]), self.groups)
        return _add_late_bias(y.squeeze(2), late)


class ChannelsLastConvTranspose1d(nn.ConvTranspose1d):
    """`ChannelsLastConv1d` for a ConvTranspose1d."""

    def forward(self, x: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        assert output_size is None, "bigvgan does not pass output_size"
        bias, late = _split_bias(self.bias, x)
        y = F.conv_transpose2d(x.unsqueeze(2), self.weight.unsqueeze(2), bias, (1, self.stride[0]),
                               (0, self.padding[0]), (0, self.output_padding[0]), self.groups,
                               (1, self.dilation[0]))
        return _add_late_bias(y.squeeze(2), late)


def _split_bias(bias: torch.Tensor | None, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(bias for the conv call, bias to add after it): on CUDA with Triton the bias is added by
    `vocoder.kernels.channel_bias` (PyTorch's own broadcast add after cuDNN is slow on channels-last data)."""
    if bias is not None and x.is_cuda and HAS_TRITON:
        return None, bias
    return bias, None


def _add_late_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is None:
        return y
    if not is_channels_last(y):  # a one-channel output (conv_post): nothing to gain
        return y.add_(bias[:, None])
    from vocoder.kernels.channel_bias import add_channel_bias_

    return add_channel_bias_(y, bias)


def use_channels_last(model: BigVGAN) -> int:
    """Keep BigVGAN's data channels-last from its first conv to its last, in place; returns how many convs.

    Every conv weight is stored channels-last and runs as a conv2d over an NHWC view (the classes above);
    a pre-hook hands the model its mel channels-last. cuDNN's fastest conv kernels on Hopper work on NHWC
    data: given channels-first tensors they convert each input and output around every conv. The residual
    adds keep their inputs' layout and the fused activation has a channels-last kernel
    (vocoder/kernels/aa_snake.py), so nothing converts in between. Values are unchanged: only strides
    differ."""
    swaps = {nn.Conv1d: ChannelsLastConv1d, nn.ConvTranspose1d: ChannelsLastConvTranspose1d}
    convs = [m for m in model.modules() if type(m) in swaps]
    for conv in convs:
        if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise ValueError(f"channels-last convs take zero padding given as numbers, not {conv.padding!r}")
    for conv in convs:
        conv.weight.data = to_channels_last(conv.weight.data)
        conv.__class__ = swaps[type(conv)]
    model.register_forward_pre_hook(lambda _module, args: (to_channels_last(args[0]), *args[1:]))
    return len(convs)


def _conv_back(conv: nn.Conv1d, span: Interval) -> Interval:
    assert conv.stride[0] == 1
    k, d, p = conv.kernel_size[0], conv.dilation[0], conv.padding[0]
    assert isinstance(p, int)
    return span[0] - p, span[1] + (k - 1) * d - p


def _conv_transpose_back(conv: nn.ConvTranspose1d, span: Interval) -> Interval:
    k, u, p = conv.kernel_size[0], conv.stride[0], conv.padding[0]
    return -((-(span[0] + p - (k - 1))) // u), (span[1] + p) // u


def _activation_back(act: Activation1d, span: Interval) -> Interval:
    low = act.downsample.lowpass  # strided low-pass at the doubled rate
    s, kd, pl = low.stride, low.kernel_size, low.pad_left
    up_lo, up_hi = s * span[0] - pl, s * span[1] - pl + kd - 1
    up = act.upsample  # replicate-pad, transposed filter, crop
    r, ku, pad, crop = up.ratio, up.kernel_size, up.pad, up.pad_left
    return -((-(up_lo + crop - (ku - 1))) // r) - pad, (up_hi + crop) // r - pad


def _resblock_back(block: nn.Module, span: Interval) -> Interval:
    lo, hi = span
    if isinstance(block, AMPBlock1):
        acts1, acts2 = block.activations[::2], block.activations[1::2]
        for c1, c2, a1, a2 in reversed(list(zip(block.convs1, block.convs2, acts1, acts2))):
            b = _activation_back(a1, _conv_back(c1, _activation_back(a2, _conv_back(c2, (lo, hi)))))
            lo, hi = min(lo, b[0]), max(hi, b[1])  # residual: identity path plus branch
    elif isinstance(block, AMPBlock2):
        for conv, act in reversed(list(zip(block.convs, block.activations))):
            b = _activation_back(act, _conv_back(conv, (lo, hi)))
            lo, hi = min(lo, b[0]), max(hi, b[1])
    else:  # pragma: no cover - bigvgan has only these two
        raise TypeError(type(block))
    return lo, hi


def receptive_field_frames(model: BigVGAN) -> tuple[int, int]:
    """(left, right): the samples of mel frame f depend only on mel frames [f - left, f + right].

    Walks the generator's layers backwards with exact index arithmetic (convs, transposed convs, the
    anti-aliased up/down-sampling filters, residual unions). Window edges (zero or replicate padding)
    therefore cannot reach a sample whose whole interval lies inside the window.
    """
    frame = 1_000_000  # far from any edge
    span: Interval = (frame * HOP_LENGTH, frame * HOP_LENGTH + HOP_LENGTH - 1)
    span = _conv_back(model.conv_post, span)
    span = _activation_back(model.activation_post, span)
    for i in reversed(range(model.num_upsamples)):
        blocks = model.resblocks[i * model.num_kernels : (i + 1) * model.num_kernels]
        spans = [_resblock_back(block, span) for block in blocks]
        span = min(s[0] for s in spans), max(s[1] for s in spans)
        for up in reversed(model.ups[i]):
            span = _conv_transpose_back(up, span)
    span = _conv_back(model.conv_pre, span)
    return frame - span[0], span[1] - frame


@torch.no_grad()
def effective_context_frames(model: BigVGAN, *, tolerance: float = 1e-6, trials: int = 3) -> tuple[int, int]:
    """(left, right) beyond which a unit change of one mel frame moves no sample by more than `tolerance`.

    Measured in float64 on these weights (random log-mel-like inputs), so it is a property of a checkpoint,
    not a guarantee like `receptive_field_frames`; the far taps of the exact field fall below float32
    rounding long before its end. Use it to set `StreamConfig.vocoder_*_context_frames` for lower latency.
    """
    exact_left, exact_right = receptive_field_frames(model)
    probe = copy.deepcopy(model).double()
    frames = exact_left + exact_right + 9
    j = exact_right + 4  # perturbed frame; frames j - exact_right .. j + exact_left can change
    gen = torch.Generator().manual_seed(0)
    left = right = 0
    for _ in range(trials):
        mel = torch.randn(1, probe.conv_pre.in_channels, frames, generator=gen, dtype=torch.float64) - 5.0
        mel = mel.to(probe.conv_pre.weight.device)  # [1, 80, T]; CPU generator, model may be on a GPU
        bumped = mel.clone()
        bumped[0, :, j] += 1.0
        diff = (probe(bumped) - probe(mel))[0, 0].abs().reshape(frames, HOP_LENGTH).amax(dim=1)  # [T]
        moved = torch.nonzero(diff > tolerance).flatten()
        if moved.numel():
            right = max(right, j - int(moved.min()))  # frame f < j moved: f depends on j = f + right
            left = max(left, int(moved.max()) - j)
    return left, right


def vocode(model: BigVGAN, mel: torch.Tensor) -> torch.Tensor:
    """mel [B, 80, T] -> PCM [B, T * HOP_LENGTH] in [-1, 1]."""
    wav = model(mel.to(next(model.parameters()).dtype))  # [B, 1, T*480]
    assert wav.shape[-1] == mel.shape[-1] * HOP_LENGTH, (wav.shape, mel.shape)
    return wav[:, 0, :]
