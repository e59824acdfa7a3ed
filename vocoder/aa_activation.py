"""BigVGAN's anti-aliased activation as one fused kernel on CUDA (the package's modules elsewhere).

`bigvgan.alias_free_activation.torch.act.Activation1d` computes downsample2(snake(upsample2(x))) with
replicate padding and 12-tap Kaiser-sinc filters: eight or so kernels, three of them at twice the rate,
per activation, and BigVGAN runs one before every conv. The package's own fused CUDA kernel
(`use_cuda_kernel=True`) is built with nvcc at first use for `compute_70`, which CUDA 13 no longer
accepts; here the same fusion is a Triton kernel (`vocoder/kernels/aa_snake.py`), compiled by Triton
for whatever GPU is present.

Polyphase derivation (ratio 2, K = 12, UpSample1d: pad 5, crop 15; DownSample1d: pad 5 left, 6 right):
the transposed conv gives o[n] = sum_{2i + k = n} xpad[i] hu[k] with xpad[i] = x[clamp(i - 5)], so
u[p] = 2 o[p + 15] = 2 sum_{k = p + 5 (mod 2)} hu[k] x[clamp((p + 5 - k) / 2)] for p in [0, 2T); the
strided low-pass reads u replicate-padded: y[t] = sum_j hd[j] S(u[clamp(2t + j - 5, 0, 2T - 1)]).
`aa_snake_reference` evaluates exactly that in PyTorch, so CPU tests pin the index arithmetic the
kernel uses against the package's modules.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

from vocoder.kernels import HAS_TRITON

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # bigvgan imports huggingface_hub; never go online from here

from bigvgan.activations import Snake, SnakeBeta
from bigvgan.alias_free_activation.torch.act import Activation1d

_TAPS = 12


def _snake_params(act: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    if isinstance(act, SnakeBeta):
        return act.alpha, act.beta, bool(act.alpha_logscale)
    if isinstance(act, Snake):
        return act.alpha, None, bool(act.alpha_logscale)
    raise TypeError(f"no fused kernel for activation {type(act).__name__}")


def _check_geometry(act: Activation1d) -> None:
    up, down = act.upsample, act.downsample.lowpass
    ok = (
        up.ratio == 2
        and up.kernel_size == _TAPS
        and up.pad == 5
        and up.pad_left == 15
        and up.pad_right == 15
        and down.stride == 2
        and down.kernel_size == _TAPS
        and down.pad_left == 5
        and down.pad_right == 6
        and down.padding
        and down.padding_mode == "replicate"
    )
    if not ok:
        raise ValueError("fused activation supports ratio 2 with 12-tap filters only (bigvgan's default)")


def _reference_inputs(
    x: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor | None,
    up_filter: torch.Tensor,
    down_filter: torch.Tensor,
    log_scale: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """x, the two filters and the snake u -> u + sin^2(a u) / (b + 1e-9), all in float32 per channel."""
    a = alpha.float()[None, :, None]
    b = (beta if beta is not None else alpha).float()[None, :, None]
    if log_scale:
        a, b = a.exp(), b.exp()

    def snake(u: torch.Tensor) -> torch.Tensor:
        return u + torch.sin(u * a) ** 2 / (b + 1e-9)

    return x.float(), up_filter.reshape(-1).float(), down_filter.reshape(-1).float(), snake


def aa_snake_reference(
    x: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor | None,
    up_filter: torch.Tensor,
    down_filter: torch.Tensor,
    *,
    log_scale: bool,
) -> torch.Tensor:
    """The fused kernel's arithmetic in PyTorch (float32): x [B, C, T] -> [B, C, T]."""
    length = x.shape[2]
    xf, hu, hd, snake = _reference_inputs(x, alpha, beta, up_filter, down_filter, log_scale)
    t = torch.arange(length, device=x.device)
    last = length - 1
    # The replicate-padded ends of u: u[0] (odd taps) and u[2T - 1] (even taps), one value per row.
    u_first = 2.0 * sum(hu[2 * r + 1] * xf[:, :, min(max(2 - r, 0), last)] for r in range(6))[:, :, None]
    u_last = 2.0 * sum(hu[2 * r] * xf[:, :, max(min(length + 2 - r, last), 0)] for r in range(6))[:, :, None]
    y = torch.zeros_like(xf)
    for j in range(_TAPS):
        u = torch.zeros_like(xf)
        for r in range(6):
            k = j % 2 + 2 * r  # the taps of this parity; x index t + (j - k) / 2, replicate-clamped
            u += hu[k] * xf[:, :, (t + (j - k) // 2).clamp(0, last)]
        u = 2.0 * u
        p = 2 * t + j - 5
        u = torch.where(p < 0, u_first, torch.where(p > 2 * length - 1, u_last, u))
        y += hd[j] * snake(u)
    return y.to(x.dtype)


def aa_snake_polyphase_reference(
    x: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor | None,
    up_filter: torch.Tensor,
    down_filter: torch.Tensor,
    *,
    log_scale: bool,
) -> torch.Tensor:
    """The gather kernel's arithmetic in PyTorch (float32): snake once per upsampled position.

    ue[q] = u[2q] = 2 sum_r hu[2r + 1] x[q + 2 - r], uo[q] = u[2q + 1] = 2 sum_r hu[2r] x[q + 3 - r]
    (x replicate-clamped; for q < 0 both are u[0] = ue[0], for q >= T both are u[2T - 1] = uo[T - 1]),
    y[t] = sum_a hd[2a + 1] S(ue[t + a - 2]) + hd[2a] S(uo[t + a - 3]).
    """
    length = x.shape[2]
    xf, hu, hd, snake = _reference_inputs(x, alpha, beta, up_filter, down_filter, log_scale)
    last = length - 1
    q = torch.arange(-3, length + 3, device=x.device)  # every q some output reads
    qc = q.clamp(0, last)
    ue = 2.0 * sum(hu[2 * r + 1] * xf[:, :, (qc + 2 - r).clamp(0, last)] for r in range(6))
    uo = 2.0 * sum(hu[2 * r] * xf[:, :, (qc + 3 - r).clamp(0, last)] for r in range(6))
    ue, uo = torch.where(q > last, uo, ue), torch.where(q < 0, ue, uo)
    se, so = snake(ue), snake(uo)
    y = torch.zeros_like(xf)
    for i in range(6):  # se[t + i - 2] sits at column t + i + 1, so[t + i - 3] at column t + i
        y += hd[2 * i + 1] * se[:, :, i + 1 : i + 1 + length] + hd[2 * i] * so[:, :, i : i + length]
    return y.to(x.dtype)


class FusedActivation1d(Activation1d):
    """An `Activation1d` (same submodules and parameters) whose CUDA forward is one Triton kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, C, T] -> [B, C, T]; the package's composition where Triton or CUDA is absent."""
        if not (HAS_TRITON and x.is_cuda):
            return super().forward(x)
        from vocoder.kernels.aa_snake import aa_snake

        alpha, beta, log_scale = _snake_params(self.act)
        return aa_snake(x, alpha, beta, *self._float_filters(), log_scale=log_scale)

    def _float_filters(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The 12-tap filters as contiguous float32, made again only when the buffers change (a cast per
        call would add two kernels to every activation, in eager runs and in captured graphs alike)."""
        buffers = (self.upsample.filter, self.downsample.lowpass.filter)
        key = tuple((f.data_ptr(), f._version, f.dtype) for f in buffers)  # in-place copies bump _version
        cached = self.__dict__.get("_filters_f32")
        if cached is None or cached[0] != key:
            cached = (key, tuple(f.reshape(-1).float().contiguous() for f in buffers))
            self.__dict__["_filters_f32"] = cached
        return cached[1]


def fuse_activations(model: nn.Module) -> int:
    """Turn every `Activation1d` in `model` into a `FusedActivation1d` in place; returns how many."""
    found = [m for m in model.modules() if type(m) is Activation1d]
    for module in found:  # check all before changing any
        _check_geometry(module)
        _snake_params(module.act)
    for module in found:
        module.__class__ = FusedActivation1d
    return len(found)
