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
from vocoder.mel_vocoder import (
    ChannelsLastConv1d,
    ChannelsLastConvTranspose1d,
    build_generator,
    use_channels_last,
)


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


def test_channels_last_bigvgan_keeps_values_and_its_data_channels_last() -> None:
    """`use_channels_last` changes strides only: the same PCM on CPU; every conv weight stored with its input
    channels contiguous; the mel converted on the way in; and every conv's output channels-last (conv2d over
    NHWC views), so the next conv and the residual adds see the same layout."""
    generator = build_generator(VocoderConfig.preset("tiny").bigvgan, seed=3)
    mel = torch.randn(2, 80, 9, generator=torch.Generator().manual_seed(0)) - 5.0
    with torch.no_grad():
        before = generator(mel)
        convs = use_channels_last(generator)
        seen: list[bool] = []
        modules = [m for m in generator.modules() if isinstance(m, torch.nn.Conv1d | torch.nn.ConvTranspose1d)]
        hooks = [generator.conv_pre.register_forward_pre_hook(lambda _m, args: seen.append(args[0].stride(1) == 1))]
        outputs: list[torch.Tensor] = []
        hooks += [m.register_forward_hook(lambda _m, _args, out: outputs.append(out)) for m in modules]
        after = generator(mel)
        for hook in hooks:
            hook.remove()
    assert convs == len(modules) > 0
    assert {type(m) for m in modules} == {ChannelsLastConv1d, ChannelsLastConvTranspose1d}
    assert all(m.weight.stride() == (m.weight.shape[1] * m.weight.shape[2], 1, m.weight.shape[1]) for m in modules)
    assert seen == [True]  # the mel reached the first conv channels-last
    assert len(outputs) == len(modules) and all(
        o.shape[1] == 1 or (o.stride(1) == 1 and o.stride(2) == o.shape[1]) for o in outputs)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)


def test_channels_last_needs_the_triton_kernels() -> None:
    with pytest.raises(ValueError, match="channels_last needs the Triton kernels"):
        StreamingVocoder.from_preset("tiny", channels_last=True)
    assert StreamingVocoder.from_preset("tiny").channels_last is False  # CPU


NWC_SCRIPT = """
import sys, torch
from vocoder.kernels import aa_snake as m
from vocoder.aa_activation import aa_snake_reference
worst = 0.0
for (b, c, t) in [(2, 64, 40), (1, 96, 5), (3, 32, 1), (2, 40, 70), (1, 128, 2), (1, 48, 49), (1, 64, 130)]:
    g = torch.Generator().manual_seed(b * 1000 + c + t)
    x = (2.0 * torch.randn(b, t, c, generator=g)).transpose(1, 2)  # [B, C, T] stored channels-last
    assert m.is_channels_last(x) and (t == 1 or not m.is_channels_last(x.contiguous()))  # t = 1: same
    hu, hd = torch.randn(12, generator=g) * 0.3, torch.randn(12, generator=g) * 0.3
    alpha, beta = torch.randn(c, generator=g) * 0.5, torch.randn(c, generator=g) * 0.5
    for has_beta, gather in ((False, False), (True, False), (False, True), (True, True)):
        flags = {"LOG_SCALE": True, "HAS_BETA": has_beta}
        y = m._aa_snake_nwc(x, (alpha, beta if has_beta else alpha), (hu, hd), flags, fast_sin=False, gather=gather)
        want = aa_snake_reference(x.contiguous(), alpha, beta if has_beta else None, hu, hd, log_scale=True)
        assert y.shape == want.shape and y.stride() == x.stride(), (y.stride(), x.stride())
        worst = max(worst, float((y - want).abs().max()))
print(worst)
"""


def test_channels_last_activation_kernel_in_the_triton_interpreter(triton_interpreter) -> None:
    """The channels-last kernels themselves (direct and gathering), run by Triton's CPU interpreter (a fresh
    process: the interpreter is chosen when the kernels are defined) against `aa_snake_reference`: tiles of
    32/64 channels with masked lanes (40 channels), one-frame rows, replicate edges, rows spanning several
    gathering programs (130 frames, 56 per program)."""
    assert float(triton_interpreter(NWC_SCRIPT).split()[-1]) < 2e-5  # float32, sums in another order


CAUSAL_CONV_SCRIPT = """
import torch
from vocoder.flow_layers import CausalBlock, CausalConv1d, CausalResnetBlock, ConvCache
from vocoder.kernels import flow_fused
from vocoder.layout import is_channels_last
torch.manual_seed(0)
torch.set_grad_enabled(False)
worst = 0.0
kernels = {"whole": 0, "split": 0, "finish": 0}
class Counted:  # counts the launches of one kernel
    def __init__(self, name, kernel):
        self.name, self.kernel = name, kernel
    def __getitem__(self, grid):
        kernels[self.name] += 1
        return self.kernel[grid]
for name, attr in (("whole", "_causal_conv_norm_mish_kernel"), ("split", "_causal_conv_split_kernel"),
                   ("finish", "_norm_mish_finish_kernel")):
    setattr(flow_fused, attr, Counted(name, getattr(flow_fused, attr)))
for below in (0, 1 << 30):  # whole-channel kernels only, then the channel split wherever it applies
    flow_fused.SPLIT_OPTIONS["below"] = below
    for (b, ci, co, t) in [(2, 48, 40, 20), (1, 32, 32, 5), (3, 24, 16, 1), (2, 16, 24, 17), (1, 40, 64, 3)]:
        block, conv, res = CausalBlock(ci, co), CausalConv1d(ci, co, 3), CausalResnetBlock(ci, co, 8)
        for p in [*block.parameters(), *conv.parameters(), *res.parameters()]:
            p.data.normal_(0.0, 0.2)
        x, add, hist, hist2 = torch.randn(b, t, ci), torch.randn(b, co), torch.randn(b, ci, 2), torch.randn(b, co, 2)
        valid = torch.randint(1, t + 1, (b,))
        for channels_last in (False, True):
            xin = x.transpose(1, 2) if channels_last else x.transpose(1, 2).contiguous()
            for caches, num_valid in (([hist, hist, hist, hist2], valid), (None, None)):  # streaming; a start
                got, ref = [], []
                for fused, out in ((True, got), (False, ref)):
                    cache = ConvCache(caches, num_valid)
                    y1 = block.conv.forward_fused(xin, cache, block.norm, add) if fused else block(xin, cache, add)
                    y2 = conv.forward_fused(xin, cache) if fused else conv(xin, cache)
                    if fused:  # the modules take this path on CUDA only: a resnet with its residual fused
                        h = res.block1.conv.forward_fused(xin, cache, res.block1.norm, add)
                        y3 = res.block2.conv.forward_fused(h, cache, res.block2.norm, residual=(res.res_conv, xin))
                    else:
                        y3 = res(xin, add, cache)
                    if fused:  # the output keeps the input's layout
                        assert all(is_channels_last(y) for y in (y1, y2, y3)) if channels_last or t == 1 else all(
                            y.is_contiguous() for y in (y1, y2, y3)), (y1.stride(), y2.stride(), y3.stride())
                    out += [y1, y2, y3, *cache.updated]
                assert len(got) == len(ref) == (7 if caches else 3)
                for g, r in zip(got, ref):
                    assert g.shape == r.shape, (g.shape, r.shape)
                    worst = max(worst, float((g - r).abs().max()))
    if below == 0:
        assert kernels["split"] == kernels["finish"] == 0 and kernels["whole"] == 5 * 4 * 4, kernels
# then split: every conv with >= 32 output channels (3 of the 5 shapes; 4 convs each, 2 layouts x 2 cache
# modes), the norm kernel finishing the 3 with a norm; the 16- and 24-channel shapes stay whole
assert kernels["split"] == 3 * 4 * 4 and kernels["finish"] == 3 * 4 * 3, kernels
assert kernels["whole"] == 5 * 4 * 4 + 2 * 4 * 4, kernels
from vocoder.kernels.flow_fused import add_layer_norm
for m, c in ((37, 256), (16, 48), (1, 40)):  # rows of the many-row transformer path; masked lanes, one row
    norm = torch.nn.LayerNorm(c)
    norm.weight.data.normal_(1.0, 0.2)
    norm.bias.data.normal_(0.0, 0.2)
    x, y = torch.randn(m, c) * 3.0, torch.randn(m, c)
    s, n = add_layer_norm(x, y, (norm.weight, norm.bias, norm.eps))
    assert torch.equal(s, x + y), "the residual sum"
    worst = max(worst, float((n - norm(x + y)).abs().max()))
    s0, n0 = add_layer_norm(x, None, (norm.weight, norm.bias, norm.eps))
    assert s0.data_ptr() == x.data_ptr()
    worst = max(worst, float((n0 - norm(x)).abs().max()))
from vocoder.flow_layers import ChunkTransformer
from vocoder.kernels.flow_fused import fused_linear
block = ChunkTransformer(48, 2, 16, 4, 4)  # the few-row fused linears, against the block's own modules
for p in block.parameters():
    p.data.normal_(0.0, 0.2)
for m in (40, 7):
    x, f, r = torch.randn(m, 48), torch.randn(m, 192), torch.randn(m, 48)
    n1, n2, ff = block.norm1, block.norm2, block.ff
    pairs = [
        (fused_linear(x, block.qkv.weight, norm=(n1.weight, n1.bias, n1.eps)), block.qkv(n1(x))),
        (fused_linear(x, ff[0].weight, ff[0].bias, norm=(n2.weight, n2.bias, n2.eps), gelu=True), ff[1](ff[0](n2(x)))),
        (fused_linear(f, ff[2].weight, ff[2].bias, residual=r), ff[2](f) + r),
        (fused_linear(x4 := torch.randn(m, 768), w4 := torch.randn(48, 768) * 0.05), x4 @ w4.T),  # 3 K steps
    ]
    for g, w in pairs:
        assert g.shape == w.shape
        worst = max(worst, float((g - w).abs().max()))
from vocoder.kernels.flow_fused import ln_qkv_attention
for m in (40, 8):  # LN1 + QKV + chunk attention in one kernel (a 16-row program half masked at 40 rows)
    x = torch.randn(m, 48)
    n1 = block.norm1
    h = x.reshape(m // 4, 4, 48)
    shape = (m // 4, 4, 2, 16)
    q, k, v = (z.reshape(shape).transpose(1, 2) for z in block.qkv(n1(h)).chunk(3, dim=-1))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(m, 32)
    got = ln_qkv_attention(x, block.qkv.weight, (n1.weight, n1.bias, n1.eps), 2, 16, 4)
    assert got.shape == want.shape
    worst = max(worst, float((got - want).abs().max()))
    # the whole block's fused path (4 kernels) against its PyTorch modules
    block.fuse_attention = True
    worst = max(worst, float((block._forward_fused(x.reshape(2, m // 2, 48)) - block(x.reshape(2, m // 2, 48))).abs().max()))
from vocoder.kernels.channel_bias import add_channel_bias_
for b, c, t in ((2, 24, 33), (1, 96, 5), (3, 40, 1)):  # BigVGAN conv outputs: masked lanes, one frame
    y = torch.randn(b, t, c).transpose(1, 2)
    bias = torch.randn(c)
    want = y + bias[:, None]
    assert add_channel_bias_(y, bias) is y and torch.equal(y, want), "the bias add"
print(worst)
"""


def test_causal_conv_and_norm_kernels_in_the_triton_interpreter(triton_interpreter) -> None:
    """The estimator's fused causal conv kernel (vocoder/kernels/flow_fused.py), with LayerNorm + Mish + time
    bias (a CausalBlock) and without (a plain CausalConv1d), on channels-first and channels-last input, with a
    stream's cache and at a stream's start, run by Triton's CPU interpreter against the PyTorch modules: the
    same outputs and cache updates in float32, and each output stored in its input's layout. Then the
    residual add + LayerNorm kernel of the many-row transformer path against `x + y` and `nn.LayerNorm`, the
    few-row fused linears (LN + QKV, LN + FF1 + GELU) and the LN1 + QKV + chunk attention kernel against the
    transformer block's modules, the block's fused path against its PyTorch path, and BigVGAN's channels-last
    conv bias add against PyTorch's."""
    assert float(triton_interpreter(CAUSAL_CONV_SCRIPT).split()[-1]) < 2e-5  # float32, sums in another order


def test_causal_conv_splits_output_channels_only_for_few_programs() -> None:
    """Channel slices of the estimator's causal conv by programs (rows x 16-frame tiles) and output channels:
    16-channel slices under 64 programs (a first chunk's 2 rows x 1 tile: 32 programs instead of 2), whatever
    the rows and frames, so no step compiles a kernel variant the warm-up did not; none from 64 programs up or
    under 32 channels; a partial last slice."""
    pytest.importorskip("triton")
    from vocoder.kernels.flow_fused import SPLIT_OPTIONS, _split_slices

    assert SPLIT_OPTIONS["bco"] == 16 and SPLIT_OPTIONS["below"] == 64
    assert [_split_slices(tiles, 256) for tiles in (1, 2, 8, 32, 63, 64, 640)] == [16, 16, 16, 16, 16, 1, 1]
    assert [_split_slices(4, co) for co in (40, 32, 31, 16, 80)] == [3, 2, 1, 1, 5]
