"""The arithmetic of the vocoder's Triton kernels, pinned on CPU against the modules they replace.

The kernels themselves need a GPU; `bench/vocoder_profile.py` compares them with these same modules on the
H200 (bench/results/vocoder-profile-h200.json). Here the PyTorch transcriptions of their index arithmetic
(`aa_snake_reference`: one snake per output tap, `aa_snake_polyphase_reference`: one snake per upsampled
position, gathered) must equal bigvgan's `Activation1d`, edges included.
"""

from __future__ import annotations

import pytest
import torch
from bigvgan.activations import Snake, SnakeBeta
from bigvgan.alias_free_activation.torch.act import Activation1d

from vocoder import StreamingVocoder
from vocoder.aa_activation import (
    FusedActivation1d,
    _snake_params,
    aa_snake_polyphase_reference,
    aa_snake_reference,
    fuse_activations,
)
from vocoder.config import VocoderConfig
from vocoder.mel_vocoder import build_generator


def _activation(cls: type, channels: int, seed: int) -> Activation1d:
    torch.manual_seed(seed)
    act = Activation1d(cls(channels, alpha_logscale=True))
    with torch.no_grad():
        for p in act.act.parameters():
            p.normal_(0.0, 0.5)  # log-scale alpha/beta away from 0 so every channel differs
    return act


@pytest.mark.parametrize("reference", [aa_snake_reference, aa_snake_polyphase_reference])
@pytest.mark.parametrize("cls", [SnakeBeta, Snake])
@pytest.mark.parametrize("length", [1, 2, 3, 4, 7, 40, 257])
def test_kernel_arithmetic_equals_the_package_activation(reference, cls: type, length: int) -> None:
    act = _activation(cls, 5, seed=length)
    x = 2.0 * torch.randn(3, 5, length, generator=torch.Generator().manual_seed(length))
    alpha, beta, log_scale = _snake_params(act.act)
    with torch.no_grad():
        want = act(x)
        got = reference(x, alpha, beta, act.upsample.filter, act.downsample.lowpass.filter, log_scale=log_scale)
    assert got.shape == want.shape == (3, 5, length)
    torch.testing.assert_close(got, want, rtol=0, atol=4e-6)


def test_fuse_activations_swaps_every_activation_and_keeps_cpu_output() -> None:
    generator = build_generator(VocoderConfig.preset("tiny").bigvgan, seed=3)
    plain = sum(type(m) is Activation1d for m in generator.modules())
    mel = torch.randn(2, 80, 9, generator=torch.Generator().manual_seed(0)) - 5.0
    with torch.no_grad():
        before = generator(mel)
        assert fuse_activations(generator) == plain > 0
        after = generator(mel)  # CPU: FusedActivation1d falls back to the package's composition
    assert sum(isinstance(m, FusedActivation1d) for m in generator.modules()) == plain
    assert not any(type(m) is Activation1d for m in generator.modules())
    assert torch.equal(before, after)


def test_fusion_refuses_other_filter_geometry() -> None:
    act = Activation1d(SnakeBeta(4, alpha_logscale=True), up_ratio=2, up_kernel_size=8)
    with pytest.raises(ValueError, match="12-tap"):
        fuse_activations(torch.nn.Sequential(act))
    assert type(act) is Activation1d


def test_triton_kernels_follow_the_device() -> None:
    voc = StreamingVocoder.from_preset("tiny")  # CPU: the PyTorch modules
    assert voc.triton_kernels is False
    assert not any(isinstance(m, FusedActivation1d) for m in voc.generator.modules())
    assert not any(getattr(m, "use_triton", False) for m in voc.flow.modules())
    with pytest.raises(ValueError, match="CUDA device and Triton"):
        StreamingVocoder.from_preset("tiny", triton_kernels=True)
