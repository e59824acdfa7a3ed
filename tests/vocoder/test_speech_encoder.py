"""vocoder/speech_encoder.py: 16 kHz audio -> codes (Whisper-VQ), its lengths, masking, segments and loader."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vocoder.speech_encoder import (
    FRAME_BUCKET,
    SpeechEncoderConfig,
    block_causal,
    build_speech_encoder,
    load_speech_encoder,
    log_mel,
    save_speech_encoder,
    speech_encoder_for,
)

TINY = SpeechEncoderConfig.preset("tiny")


def noise(num_samples: int, seed: int, scale: float = 0.3) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(num_samples) * scale).astype(np.float32)


@pytest.fixture(scope="module")
def encoder():
    return build_speech_encoder(TINY, seed=0)


@pytest.mark.parametrize(("num_samples", "codes"), [
    (160, 1), (1280, 1), (1439, 1), (1440, 2), (16000, 13), (16001, 13), (480_000, 375), (480_160, 376),
    (500_000, 391), (960_000, 750)])
def test_a_clip_gives_one_code_per_80_ms_rounded_up_per_30_s_segment(encoder, num_samples: int, codes: int) -> None:
    assert TINY.num_codes(num_samples) == codes
    out = encoder.encode(noise(num_samples, seed=num_samples))
    assert len(out) == codes
    assert all(isinstance(code, int) and 0 <= code < 16384 for code in out)


def test_the_full_preset_is_whisper_large_v3_truncated_at_the_quantizer() -> None:
    with torch.device("meta"):
        model = build_speech_encoder(SpeechEncoderConfig.preset("full"), device="meta")
    assert sum(p.numel() for p in model.parameters()) == 343_119_360
    assert len(model.layers) == 16 and model.codebook.weight.shape == (16384, 1280)
    assert SpeechEncoderConfig.preset("full").samples_per_code == 1280  # 12.5 codes per second of 16 kHz


def test_codes_are_a_function_of_the_audio_and_the_weights_seed(encoder) -> None:
    clip = noise(24_000, seed=1)
    assert encoder.encode(clip) == build_speech_encoder(TINY, seed=0).encode(clip)
    assert encoder.encode(clip) != build_speech_encoder(TINY, seed=1).encode(clip)
    assert encoder.encode(clip) != encoder.encode(noise(24_000, seed=2))


def test_bfloat16_weights_keep_a_float32_front_end() -> None:
    float32 = build_speech_encoder(TINY, seed=4)
    bf16 = build_speech_encoder(TINY, seed=4, dtype=torch.bfloat16)
    assert bf16.codebook.weight.dtype == torch.bfloat16 and bf16.mel_filters.dtype == torch.float32
    assert torch.equal(bf16.mel_filters, float32.mel_filters)
    clip = noise(20_000, seed=9)
    seen: list[torch.Tensor] = []
    run = bf16.codes_of_frames
    bf16.codes_of_frames = lambda mel_in, count: seen.append(mel_in.clone()) or run(mel_in, count)
    assert len(bf16.encode(clip)) == len(float32.encode(clip)) == 16
    # what the bf16 layers get is the float32 log-mel of the float32 samples, rounded once at the end
    frames = 20_000 // 160
    (mel_in,) = seen
    assert mel_in.dtype == torch.bfloat16
    assert torch.equal(mel_in[:, :frames], log_mel(torch.from_numpy(clip), float32.mel_filters)[:, :frames].bfloat16())


def test_segments_of_30_s_are_encoded_independently(encoder) -> None:
    first, rest = noise(480_000, seed=3), noise(40_000, seed=4)
    assert encoder.encode(np.concatenate([first, rest])) == encoder.encode(first) + encoder.encode(rest)


def test_the_block_causal_mask_sees_the_past_and_the_own_block() -> None:
    allowed = block_causal(7, 3, torch.device("cpu"))
    expected = torch.tensor([[j <= i or j // 3 == i // 3 for j in range(7)] for i in range(7)])
    assert torch.equal(allowed, expected)


def test_codes_of_a_finished_4_s_block_do_not_depend_on_later_audio(encoder) -> None:
    # 64000 samples = 400 mel frames = 200 frames after the convolutions = the first block (50 codes). Later
    # audio reaches it only through the clip's log-mel maximum, so the later audio here is much quieter.
    head = noise(64_000, seed=5, scale=0.5)
    one = encoder.encode(np.concatenate([head, noise(32_000, seed=6, scale=0.01)]))
    two = encoder.encode(np.concatenate([head, noise(32_000, seed=7, scale=0.01)]))
    assert one[:50] == two[:50]
    assert one[50:] != two[50:]


@pytest.mark.parametrize("num_samples", [16_000, 36_800, 65_600, 480_000])
def test_padding_to_the_frame_bucket_leaves_the_codes_of_the_clip_alone(encoder, num_samples: int) -> None:
    clip = noise(num_samples, seed=10)
    num_frames = num_samples // 160
    frames = (num_frames + 1) // 2
    mel = log_mel(torch.from_numpy(clip), encoder.mel_filters)[:, :num_frames]
    exact = encoder.codes_of_frames(torch.nn.functional.pad(mel, (0, 2 * frames - num_frames)), torch.tensor(frames))
    assert encoder.encode(clip) == exact.tolist()  # padded to a multiple of FRAME_BUCKET frames inside
    assert frames % FRAME_BUCKET or num_samples == 480_000  # the cases do pad (30 s fills the last bucket)


def test_graphed_encoding_gives_the_eager_codes_with_one_graph_per_bucket() -> None:
    graphed = build_speech_encoder(TINY, seed=0)
    graphed.use_cuda_graphs()  # on CPU: the same static buffers, the function run again instead of a replay
    assert graphed.warm_up() == graphed.num_buckets == 25
    eager = build_speech_encoder(TINY, seed=0)
    for seconds in (0.5, 1.7, 12.0):
        clip = noise(int(seconds * 16000), seed=11)
        assert graphed.encode(clip) == eager.encode(clip)
    assert graphed._graphed.num_replays == 25 + 3 and graphed._graphed.num_eager_calls == 0


def test_bad_clips_are_refused(encoder) -> None:
    with pytest.raises(ValueError, match="too short for one code"):
        encoder.encode(np.zeros(159, dtype=np.float32))
    with pytest.raises(ValueError, match=r"one channel \[samples\], got shape \(2, 2000\)"):
        encoder.encode(np.zeros((2, 2000), dtype=np.float32))
    clip = np.zeros(2000, dtype=np.float32)
    clip[[3, 1500]] = [np.nan, -np.inf]
    with pytest.raises(ValueError, match=r"^audio holds 2 NaN or infinite sample\(s\)$"):
        encoder.encode(clip)
    for samples, dtype in [(np.zeros(2000, dtype=np.int16), "torch.int16"), (np.zeros(2000, dtype=bool), "torch.bool"),
                           (np.zeros(2000, dtype=np.complex64), "torch.complex64"), ([0] * 2000, "torch.int64")]:
        with pytest.raises(ValueError, match=rf"^audio must hold float samples in \[-1, 1\], got dtype {dtype}$"):
            encoder.encode(samples)
    loud = np.zeros(2000, dtype=np.float32)
    loud[7] = -16.5  # 1e20 overflowed the power spectrum: all codes 0
    with pytest.raises(ValueError, match=r"^audio peaks at 16.5; float samples must lie within \+-16 \(full scale is 1\)$"):
        encoder.encode(loud)
    loud[7] = -16.0  # at the bound: taken as it is
    assert len(encoder.encode(loud)) == 2
    float32 = encoder.encode(np.zeros(2000, dtype=np.float32))
    assert len(float32) == encoder.config.num_codes(2000) == 2
    assert encoder.encode(np.zeros(2000, dtype=np.float64)) == encoder.encode([0.0] * 2000) == float32


def test_a_checkpoint_folder_loads_to_the_same_codes_with_unused_tensors_ignored(tmp_path: Path) -> None:
    model = build_speech_encoder(TINY, seed=3)
    unused = {"model.encoder.layers.2.fc1.weight": torch.zeros(4), "model.encoder.embed_positions2.weight":
              torch.zeros(4), "model.encoder.layer_norm.weight": torch.zeros(4)}
    save_speech_encoder(model, tmp_path, prefix="model.encoder.", extra=unused)
    loaded = speech_encoder_for(str(tmp_path))
    clip = noise(30_000, seed=8)
    assert loaded.encode(clip) == model.encode(clip)
    assert json.loads((tmp_path / "config.json").read_text())["quantize_vocab_size"] == 16384


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: t.pop("layers.1.fc2.bias"), r"missing \['layers.1.fc2.bias'\]"),
    (lambda t: t.update({"decoder.proj.weight": torch.zeros(2)}), r"unexpected \['decoder.proj.weight'\]"),
    (lambda t: t.update({"codebook.weight": torch.zeros(16384, 8)}),
     r"'codebook.weight' has shape \(16384, 8\), expected \(16384, 32\)"),
])
def test_a_checkpoint_that_does_not_match_fails_naming_the_tensor(tmp_path: Path, change, message: str) -> None:
    from safetensors.torch import load_file, save_file

    save_speech_encoder(build_speech_encoder(TINY), tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        load_speech_encoder(tmp_path)


def test_a_checkpoint_config_must_describe_this_encoder(tmp_path: Path) -> None:
    save_speech_encoder(build_speech_encoder(TINY), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key, value, message in [("quantize_vocab_size", 4096, "codebook_size must be 16384"),
                                ("pooling_position", 1, "pooling_position must equal quantize_position"),
                                ("encoder_ffn_dim", None, r"lacks \['encoder_ffn_dim'\]")]:
        (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=message):
            load_speech_encoder(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "model.bin")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match=r"no model\*.safetensors"):
        load_speech_encoder(tmp_path)
