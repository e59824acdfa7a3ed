"""Parts of the decoder: noise, BigVGAN receptive field and checkpoints, voices, state pool, config."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from vocoder.config import HOP_LENGTH, BigVGANConfig, VocoderConfig
from vocoder.flow import FlowDecoder
from vocoder.flow_layers import ConvCache
from vocoder.layout import (
    cat_channels,
    empty_channels_last,
    is_channels_last,
    pointwise_conv,
    to_channels_last,
)
from vocoder.make_default_voice import make_voice
from vocoder.mel_vocoder import build_generator, receptive_field_frames, vocode
from vocoder.noise import frame_noise
from vocoder.state_pool import FlowStatePool
from vocoder.voices import DEFAULT_VOICES_DIR, Voice, VoiceLibrary


def test_noise_depends_only_on_seed_and_frame() -> None:
    whole = frame_noise(11, 0, 40)
    assert whole.shape == (80, 40) and whole.dtype == torch.float32
    assert torch.equal(torch.cat([frame_noise(11, 0, 13), frame_noise(11, 13, 40)], dim=1), whole)
    assert not torch.equal(frame_noise(12, 0, 40), whole)
    big = frame_noise(2**40 + 3, 0, 2000)
    assert abs(float(big.mean())) < 0.02 and abs(float(big.std()) - 1.0) < 0.02
    with pytest.raises(ValueError, match="seed"):
        frame_noise(-1, 0, 4)
    with pytest.raises(ValueError, match="seed"):
        frame_noise(1.5, 0, 4)  # type: ignore[arg-type]


def _check_field_bounds_dependence(cfg: BigVGANConfig, expected: tuple[int, int]) -> None:
    model = build_generator(cfg, seed=0).double()
    left, right = receptive_field_frames(model)
    assert (left, right) == expected
    frames = left + right + 21
    j = right + 10
    mel = torch.randn(1, 80, frames, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) - 5
    bumped = mel.clone()
    bumped[0, :, j] += 1.0
    with torch.no_grad():
        diff = (vocode(model, bumped) - vocode(model, mel))[0].abs()
    changed = torch.nonzero(diff > 0).flatten()
    # Frame f's samples depend on mel frames [f - left, f + right], so frame j reaches frames [j - right, j + left].
    assert int(changed.min()) >= (j - right) * HOP_LENGTH
    assert int(changed.max()) < (j + left + 1) * HOP_LENGTH
    assert int(changed.max()) - int(changed.min()) > 10 * HOP_LENGTH  # and it is not trivially small


def test_bigvgan_receptive_field_bounds_the_real_dependence() -> None:
    _check_field_bounds_dependence(VocoderConfig.preset("tiny").bigvgan, (16, 16))


def test_full_layout_receptive_field() -> None:
    # The field depends on kernels, rates and dilations only, so a narrow clone of `full` has full's field.
    _check_field_bounds_dependence(
        dataclasses.replace(BigVGANConfig(), upsample_initial_channel=64), (30, 30)
    )


def test_bigvgan_config_must_fit_this_mel() -> None:
    with pytest.raises(ValueError, match="480"):
        BigVGANConfig(upsample_rates=(4, 4, 2, 2, 2, 2), upsample_kernel_sizes=(8, 8, 4, 4, 4, 4)).validate()
    with pytest.raises(ValueError, match="even"):
        BigVGANConfig(upsample_kernel_sizes=(10, 8, 7, 4, 4, 4)).validate()
    with pytest.raises(ValueError, match="unknown vocoder preset"):
        VocoderConfig.preset("huge")


def test_flow_config_must_match_the_streaming_decoders_constants() -> None:
    flow = VocoderConfig.preset("tiny").flow
    flow.validate()
    for encoder, message in [(dataclasses.replace(flow.encoder, lookahead=4), "^encoder.lookahead must be 3 "),
                             (dataclasses.replace(flow.encoder, lookahead=2), "^encoder.lookahead must be 3 "),
                             (dataclasses.replace(flow.encoder, vocab_size=4096), "^encoder.vocab_size must be 16384 ")]:
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(flow, encoder=encoder).validate()
    for frames in (0, 3):
        with pytest.raises(ValueError, match="^attention_chunk_frames must divide MEL_FRAMES_PER_CODE"):
            dataclasses.replace(flow, estimator=dataclasses.replace(flow.estimator, attention_chunk_frames=frames)).validate()


def test_bigvgan_safetensors_checkpoints(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    cfg = dataclasses.replace(VocoderConfig.preset("tiny").bigvgan, upsample_initial_channel=64)
    source = build_generator(cfg, seed=3)
    mel = torch.randn(1, 80, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = vocode(source, mel)
    folded = tmp_path / "g.safetensors"
    save_file({f"generator.{k}": v.contiguous() for k, v in source.state_dict().items()}, str(folded))
    with torch.no_grad():
        assert torch.equal(vocode(build_generator(cfg, checkpoint=folded, seed=9), mel), want)
    # Weight-norm keys (as trained): g = ||v|| per output channel makes the same weights.
    wn = {}
    for k, v in source.state_dict().items():
        if k.endswith(".weight") and v.dim() == 3:  # weight_norm(dim=0): g is the norm over dims 1, 2
            wn[k[: -len("weight")] + "weight_g"] = v.norm(dim=(1, 2), keepdim=True)
            wn[k[: -len("weight")] + "weight_v"] = v
        else:
            wn[k] = v
    weight_norm = tmp_path / "wn.safetensors"
    save_file({k: v.contiguous() for k, v in wn.items()}, str(weight_norm))
    with torch.no_grad():
        assert torch.allclose(vocode(build_generator(cfg, checkpoint=weight_norm), mel), want, atol=1e-6)
    save_file({"conv_pre.weight": torch.zeros(1)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="does not match"):
        build_generator(cfg, checkpoint=tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="safetensors"):
        build_generator(cfg, checkpoint=tmp_path / "g.pt")


def test_voice_files_round_trip(tmp_path: Path) -> None:
    shipped = VoiceLibrary().get("default")
    rebuilt = make_voice()  # the shipped file is reproducible from the script
    assert torch.equal(shipped.prompt_codes, rebuilt.prompt_codes)
    assert torch.equal(shipped.prompt_mel, rebuilt.prompt_mel)
    assert shipped.prompt_mel.shape == (48, 80) and shipped.speaker_embedding.shape == (192,)
    assert (DEFAULT_VOICES_DIR / "default.safetensors").stat().st_size < 20_000

    make_voice("default").save(tmp_path / "default.safetensors")
    make_voice("alice", seed=1, num_prompt_codes=5).save(tmp_path / "alice.safetensors")
    lib = VoiceLibrary(tmp_path)
    assert lib.names() == ["alice", "default"]
    alice = lib.get("alice")
    assert alice.num_prompt_codes == 5 and alice.prompt_mel.shape == (20, 80)
    with pytest.raises(ValueError, match="known voices: alice, default"):
        lib.get("bob")
    with pytest.raises(ValueError, match="no default"):
        VoiceLibrary(tmp_path / "missing")


def test_voice_validation() -> None:
    good = make_voice()
    with pytest.raises(ValueError, match="prompt_mel"):
        Voice("x", good.speaker_embedding, good.prompt_codes, good.prompt_mel[:-1])
    with pytest.raises(ValueError, match="prompt_codes"):
        Voice("x", good.speaker_embedding, good.prompt_codes + 16384, good.prompt_mel)
    with pytest.raises(ValueError, match="speaker_embedding"):
        Voice("x", good.speaker_embedding[:10], good.prompt_codes, good.prompt_mel)


def test_a_voice_file_of_the_wrong_types_is_refused_before_any_cast(tmp_path: Path) -> None:
    """Float prompt codes would be truncated to integers by the load's cast: refused, as the constructor
    refuses them; so are integer embeddings or mels."""
    from safetensors.torch import save_file

    good = make_voice()
    tensors = {"speaker_embedding": good.speaker_embedding, "prompt_codes": good.prompt_codes.float() + 0.9,
               "prompt_mel": good.prompt_mel}
    save_file(tensors, str(tmp_path / "floaty.safetensors"))
    with pytest.raises(ValueError, match="prompt_codes must be integers, got torch.float32"):
        Voice.load(tmp_path / "floaty.safetensors")
    tensors = {"speaker_embedding": good.speaker_embedding.long(), "prompt_codes": good.prompt_codes,
               "prompt_mel": good.prompt_mel}
    save_file(tensors, str(tmp_path / "intspeaker.safetensors"))
    with pytest.raises(ValueError, match="speaker_embedding must be floating point, got torch.int64"):
        Voice.load(tmp_path / "intspeaker.safetensors")


def test_a_voice_file_that_is_not_safetensors_is_a_value_error_naming_it(tmp_path: Path) -> None:
    """A pickle renamed .safetensors, or a directory of that name: the error names the file (it used to be
    the safetensors library's own error, or an OSError)."""
    import pickle

    (tmp_path / "pickled.safetensors").write_bytes(pickle.dumps({"speaker_embedding": [0.0] * 192}))
    (tmp_path / "folder.safetensors").mkdir()
    for name in ("pickled", "folder"):
        path = tmp_path / f"{name}.safetensors"
        with pytest.raises(ValueError, match=f"voice file {path} cannot be read as safetensors"):
            Voice.load(path)


def test_state_pool_grows_and_keeps_slots() -> None:
    pool = FlowStatePool(
        [(3, 2), (5, 1)], num_steps=2, num_branches=2, device="cpu", dtype=torch.float32, capacity=1
    )
    a = pool.allocate()
    slots = torch.tensor([a])
    pool.write(slots, 1, [torch.ones(2, 3, 2), torch.full((2, 5, 1), 2.0)])
    b = pool.allocate()  # grows
    assert pool.capacity == 2 and {a, b} == {0, 1}
    assert torch.equal(pool.read(slots, 1)[1], torch.full((2, 5, 1), 2.0))
    assert torch.equal(pool.read(torch.tensor([b]), 1)[0], torch.zeros(2, 3, 2))
    pool.release(a)
    assert pool.allocate() == a and float(pool.read(slots, 1)[0].abs().sum()) == 0.0  # re-zeroed
    assert pool.generation == 1
    pool.reserve(5)  # grows once to exactly 5, keeping every slot's contents and which are in use
    pool.write(torch.tensor([b]), 0, [torch.full((2, 3, 2), 3.0), torch.zeros(2, 5, 1)])
    pool.reserve(5)
    assert (pool.capacity, pool.generation, pool.num_used) == (5, 2, 2)
    assert torch.equal(pool.read(torch.tensor([b]), 0)[0], torch.full((2, 3, 2), 3.0))
    both = torch.tensor([b, a])
    pool.write(both, 1, [torch.randn(4, 3, 2), torch.randn(4, 5, 1)])  # step 1 differs per row and branch
    for layer, stacked in enumerate(pool.read_steps(both)):  # every step at once, as `read` gives each
        assert stacked.shape[0] == pool.num_steps
        for k in range(pool.num_steps):
            assert torch.equal(stacked[k], pool.read(both, k)[layer])
    assert [pool.allocate() for _ in range(3)] == [2, 3, 4] and pool.generation == 2


def test_flow_streaming_equals_whole_at_mel_level() -> None:
    torch.manual_seed(0)
    flow = FlowDecoder(VocoderConfig.preset("tiny").flow).eval()
    t = 24
    mu, cond, noise = (torch.randn(1, 80, t) for _ in range(3))
    spk = torch.randn(1, 80)
    whole, _ = flow.solve(mu, spk, cond, noise)
    shapes = flow.cache_shapes()
    caches = [[torch.zeros(2, c, ctx) for c, ctx in shapes] for _ in range(flow.cfg.num_steps)]
    parts = []
    for a, z in [(0, 4), (4, 16), (16, 24)]:
        out, caches = flow.solve(
            mu[..., a:z], spk, cond[..., a:z], noise[..., a:z], caches, torch.tensor([z - a])
        )
        parts.append(out)
    assert torch.allclose(torch.cat(parts, dim=2), whole, atol=1e-5)
    assert float((whole - noise).abs().mean()) > 0.1  # the estimator did move the noise


def test_check_codes_accepts_int_sequences_only() -> None:
    import numpy as np

    from vocoder.session import check_codes

    assert check_codes(np.array([0, 16383], dtype=np.int64)) == [0, 16383]
    assert check_codes(torch.tensor([5, 6])) == [5, 6]
    assert check_codes((1, 2)) == [1, 2]
    with pytest.raises(ValueError, match="one-dimensional"):
        check_codes(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="sequence of ints"):
        check_codes("12")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not an integer"):
        check_codes(np.array([1.0]))
    for booleans in ([True, False], np.array([True]), torch.tensor([False])):  # ints to operator.index
        with pytest.raises(ValueError, match="is a boolean, not a code"):
            check_codes(booleans)


def test_solve_equals_euler_steps_with_per_row_time_embedding() -> None:
    """`solve` computes the time biases of all Euler steps at once; the result must equal integrating with
    the estimator embedding each row's t itself (as it does when no biases are given)."""
    torch.manual_seed(1)
    flow = FlowDecoder(VocoderConfig.preset("tiny").flow).eval()
    flow.cfg = dataclasses.replace(flow.cfg, cfg_rate=0.0)  # one branch: the loop below is plain Euler
    mu, cond, noise = (torch.randn(2, 80, 12) for _ in range(3))
    spk = torch.randn(2, 80)
    got, _ = flow.solve(mu, spk, cond, noise)
    x = noise.clone()
    with torch.no_grad():
        for k in range(flow.cfg.num_steps):
            t0, t1 = flow.t_span[k], flow.t_span[k + 1]
            cache = ConvCache()
            x = x + (t1 - t0) * flow.estimator(x, mu, spk, cond, torch.full((2,), t0), cache)
    assert got.shape == x.shape == (2, 80, 12)
    assert torch.allclose(got, x, atol=1e-5)
    assert float((got - noise).abs().mean()) > 0.1


def test_conv_cache_take_hands_out_caches_in_call_order() -> None:
    caches = [torch.full((2, 3, 2), float(i)) for i in range(3)]
    cache = ConvCache(caches, torch.tensor([4, 1]))
    x = torch.zeros(2, 3, 4)
    assert cache.take(x, 2) is caches[0]
    full = cache.extend(x, 2)  # the second conv, unfused
    assert torch.equal(full[:, :, :2], caches[1]) and cache.index == 2
    assert torch.equal(cache.updated[0][0], torch.zeros(3, 2))  # row 0: 4 new frames, the last 2 of x
    assert torch.equal(cache.updated[0][1], torch.tensor([[1.0, 0.0]] * 3))  # row 1: old frame 1, new 0
    assert cache.take(x, 2) is caches[2]
    assert ConvCache().take(x, 2) is None


def test_estimator_channels_last_keeps_layout_and_values() -> None:
    """`FlowEstimator.channels_last` (set on CUDA with the Triton kernels) stores the activations channels-last:
    the concatenations and 1x1 convs keep that layout (vocoder/layout.py), and the velocity and cache updates
    equal those of channels-first input (here on CPU, where the causal convs are PyTorch's)."""
    torch.manual_seed(3)
    flow = FlowDecoder(VocoderConfig.preset("tiny").flow).eval()
    x, mu, cond = (torch.randn(2, 80, 12) for _ in range(3))
    spk, t = torch.randn(2, 80), torch.tensor([0.3, 0.3])
    shapes = flow.cache_shapes()
    caches = [torch.randn(2, c, ctx) for c, ctx in shapes]
    out = {}
    with torch.no_grad():
        for channels_last in (False, True):
            flow.estimator.channels_last = channels_last
            cache = ConvCache(caches, torch.tensor([12, 7]))
            out[channels_last] = (flow.estimator(x, mu, spk, cond, t, cache), cache.updated)
    (v0, upd0), (v1, upd1) = out[False], out[True]
    assert is_channels_last(v1)
    torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-5)
    assert len(upd1) == len(upd0) == len(shapes)
    for a, b in zip(upd1, upd0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_layout_helpers() -> None:
    conv = torch.nn.Conv1d(6, 5, 1)
    x = torch.randn(3, 7, 6).transpose(1, 2)  # [3, 6, 7] channels-last
    assert is_channels_last(x) and not is_channels_last(x.contiguous())
    assert is_channels_last(torch.randn(2, 4, 1)) and not is_channels_last(torch.randn(2, 1, 5))  # one frame: both
    with torch.no_grad():
        y = pointwise_conv(conv, x)
        assert is_channels_last(y) and y.shape == (3, 5, 7)
        torch.testing.assert_close(y, conv(x.contiguous()))
        assert pointwise_conv(conv, x.contiguous()).is_contiguous()
    z = torch.randn(3, 2, 7)
    both = cat_channels([x, z])
    assert is_channels_last(both) and torch.equal(both, torch.cat([x, z], dim=1))
    assert cat_channels([z, x]).is_contiguous() and is_channels_last(cat_channels([z, x], channels_last=True))
    y = to_channels_last(z)
    assert is_channels_last(y) and torch.equal(y, z) and to_channels_last(y).data_ptr() == y.data_ptr()
    e = empty_channels_last(2, 4, 3, z)
    assert e.shape == (2, 4, 3) and is_channels_last(e)
