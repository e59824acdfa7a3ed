"""The codec's weight files (flow, BigVGAN, speech encoder, voices): loaded into memory of their own, and a
file that is not what it should be is a ValueError naming it, never a cast or a silent drop."""
from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vocoder import StreamingVocoder
from vocoder.config import VocoderConfig
from vocoder.make_default_voice import make_voice
from vocoder.mel_vocoder import build_generator
from vocoder.speech_encoder import (
    SpeechEncoderConfig,
    build_speech_encoder,
    load_speech_encoder,
    save_speech_encoder,
)
from vocoder.voices import Voice

BIGVGAN = dataclasses.replace(VocoderConfig.preset("tiny").bigvgan, upsample_initial_channel=64)


def state_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_loaded_weights_do_not_follow_their_file(tmp_path: Path, zero_tensor_bytes) -> None:
    """safetensors' CPU loaders return views of the file's mapping: a file rewritten in place changed the live
    speech encoder and voice (a truncated one would fault the process). The generator and the flow copy into
    their own parameters, and are checked here so that they keep doing so."""
    generator = build_generator(BIGVGAN, seed=3)
    save_file(generator.state_dict(), str(tmp_path / "g.safetensors"))
    flow = StreamingVocoder.from_preset("tiny", seed=5).flow
    save_file(flow.state_dict(), str(tmp_path / "flow.safetensors"))
    save_speech_encoder(build_speech_encoder(SpeechEncoderConfig.preset("tiny"), seed=2), tmp_path / "enc")
    make_voice("alice", seed=1).save(tmp_path / "alice.safetensors")

    loaded = {
        "generator": build_generator(BIGVGAN, checkpoint=tmp_path / "g.safetensors", seed=9),
        "flow": StreamingVocoder.from_preset("tiny", seed=0, flow_checkpoint=tmp_path / "flow.safetensors").flow,
        "encoder": load_speech_encoder(tmp_path / "enc"),
    }
    voice = Voice.load(tmp_path / "alice.safetensors")
    before = {name: state_of(module) for name, module in loaded.items()}
    assert same(before["generator"], state_of(generator)) and same(before["flow"], state_of(flow))
    voice_before = voice.speaker_embedding.clone()
    for file in (tmp_path / "g.safetensors", tmp_path / "flow.safetensors", tmp_path / "enc" / "model.safetensors",
                 tmp_path / "alice.safetensors"):
        zero_tensor_bytes(file)
        assert not any(t.any() for t in load_file(str(file)).values())  # the file did change
    for name, module in loaded.items():
        assert same(state_of(module), before[name]), name
    assert torch.equal(voice.speaker_embedding, voice_before)


def test_bigvgan_keys_stored_with_and_without_the_generator_prefix_are_refused(tmp_path: Path) -> None:
    """"generator.conv_pre.weight" and "conv_pre.weight" both stored: one of them was dropped unseen."""
    state = build_generator(BIGVGAN, seed=3).state_dict()
    save_file({**state, "generator.conv_pre.weight": torch.zeros_like(state["conv_pre.weight"])},
              str(tmp_path / "g.safetensors"))
    with pytest.raises(ValueError, match=r"stores \['conv_pre.weight'\] both with and without 'generator.'"):
        build_generator(BIGVGAN, checkpoint=tmp_path / "g.safetensors")


def test_integer_tensors_in_codec_checkpoints_are_refused_by_name(tmp_path: Path) -> None:
    state = build_generator(BIGVGAN, seed=3).state_dict()
    save_file({**state, "conv_pre.bias": state["conv_pre.bias"].long()}, str(tmp_path / "g.safetensors"))
    with pytest.raises(ValueError, match=r"g.safetensors holds tensors that are not floating point: "
                                         r"conv_pre.bias \(torch.int64\)"):
        build_generator(BIGVGAN, checkpoint=tmp_path / "g.safetensors")
    flow = StreamingVocoder.from_preset("tiny").flow.state_dict()
    name = next(iter(flow))
    save_file({**flow, name: flow[name].to(torch.int32)}, str(tmp_path / "flow.safetensors"))
    with pytest.raises(ValueError, match=rf"flow.safetensors holds tensors that are not floating point: {name}"):
        StreamingVocoder.from_preset("tiny", flow_checkpoint=tmp_path / "flow.safetensors")
    save_speech_encoder(build_speech_encoder(SpeechEncoderConfig.preset("tiny")), tmp_path / "enc")
    tensors = load_file(str(tmp_path / "enc" / "model.safetensors"))
    tensors["codebook.weight"] = tensors["codebook.weight"].long()
    save_file(tensors, str(tmp_path / "enc" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"speech encoder tensor 'codebook.weight' in model.safetensors is "
                                         r"torch.int64, not floating point"):
        load_speech_encoder(tmp_path / "enc")


def test_codec_files_that_are_not_safetensors_are_value_errors_naming_them(tmp_path: Path) -> None:
    pickled = pickle.dumps({"conv_pre.weight": [0.0]})
    for name in ("g", "flow"):
        (tmp_path / f"{name}.safetensors").write_bytes(pickled)
    with pytest.raises(ValueError, match=f"BigVGAN checkpoint {tmp_path / 'g.safetensors'} cannot be read"):
        build_generator(BIGVGAN, checkpoint=tmp_path / "g.safetensors")
    with pytest.raises(ValueError, match=f"flow checkpoint {tmp_path / 'flow.safetensors'} cannot be read"):
        StreamingVocoder.from_preset("tiny", flow_checkpoint=tmp_path / "flow.safetensors")
    enc = tmp_path / "enc"
    save_speech_encoder(build_speech_encoder(SpeechEncoderConfig.preset("tiny")), enc)
    good_config = (enc / "config.json").read_text()
    (enc / "model.safetensors").write_bytes(pickled)
    with pytest.raises(ValueError, match=f"speech encoder file {enc / 'model.safetensors'} cannot be read"):
        load_speech_encoder(enc)
    (enc / "config.json").write_text("{" + good_config)
    with pytest.raises(ValueError, match=f"{enc / 'config.json'} is not valid JSON"):
        load_speech_encoder(enc)
    (enc / "config.json").write_text(json.dumps([json.loads(good_config)]))
    with pytest.raises(ValueError, match="must hold a JSON object, got list"):
        load_speech_encoder(enc)


def test_a_flow_checkpoint_loads_exactly_and_a_mismatched_one_is_refused(tmp_path: Path) -> None:
    source = StreamingVocoder.from_preset("tiny", seed=5).flow.state_dict()
    save_file(source, str(tmp_path / "flow.safetensors"))
    loaded = StreamingVocoder.from_preset("tiny", seed=0, flow_checkpoint=tmp_path / "flow.safetensors")
    assert same(state_of(loaded.flow), source)
    # float64 weights (a training export) load too, cast to the vocoder's float32
    save_file({k: v.double() for k, v in source.items()}, str(tmp_path / "flow64.safetensors"))
    wide = StreamingVocoder.from_preset("tiny", seed=0, flow_checkpoint=tmp_path / "flow64.safetensors")
    assert same(state_of(wide.flow), source)
    assert not same(state_of(StreamingVocoder.from_preset("tiny", seed=0).flow), source)  # the seed alone differs
    name = next(iter(source))
    save_file({k: v for k, v in source.items() if k != name}, str(tmp_path / "short.safetensors"))
    with pytest.raises(ValueError, match=f"flow checkpoint {tmp_path / 'short.safetensors'} does not match"):
        StreamingVocoder.from_preset("tiny", flow_checkpoint=tmp_path / "short.safetensors")
