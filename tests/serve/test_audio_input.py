"""Speech input at the edge: input_audio parts decoded to 16 kHz mono (deployments/audio_input.py), the chat
request dict they make (validation.py), and the prompt rows the LLM deployment builds from their codes."""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import soundfile

from deployments.audio_input import decode_input_audio
from deployments.errors import ApiError
from deployments.llm_server import prompt_content
from deployments.validation import Limits, chat_request
from runtime.config import AUDIO_PAD_ID, EOSP_ID, IM_END_ID, IM_START_ID, MODALITY_PAD_ID, SOSP_ID
from runtime.prompts import AudioContent, ChatMessage, PromptError, build_prompt_rows
from runtime.tokenizer import Tokenizer

LIMITS = Limits(served_model_name="moss-speech", voices=["default"], max_input_chars=100,
                max_new_tokens_limit=100, default_max_new_tokens=10, max_input_audio_s=3.0)


def audio_b64(samples: np.ndarray, rate: int, *, fmt: str = "WAV", subtype: str | None = "PCM_16") -> str:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return base64.b64encode(buffer.getvalue()).decode()


def tone(seconds: float, rate: int, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    wave = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    return wave if channels == 1 else np.stack([wave] * channels, axis=1)


def decode(data: str, max_seconds: float = 10.0) -> np.ndarray:
    return decode_input_audio(data, "wav", param="p", max_seconds=max_seconds)


@pytest.mark.parametrize(("rate", "channels", "fmt", "subtype"), [
    (16000, 1, "WAV", "PCM_16"), (48000, 2, "WAV", "PCM_16"), (24000, 1, "WAV", "FLOAT"), (22050, 1, "FLAC", "PCM_16")])
def test_a_clip_becomes_16_khz_mono_float32_of_the_same_duration(rate: int, channels: int, fmt: str,
                                                                 subtype: str) -> None:
    samples = decode(audio_b64(tone(1.5, rate, channels), rate, fmt=fmt, subtype=subtype))
    assert samples.dtype == np.float32 and samples.ndim == 1 and samples.flags.c_contiguous
    assert samples.size == 24000
    # the 440 Hz tone survives the down-mix and resampling: its level stays 0.5 / sqrt(2)
    assert abs(float(np.sqrt(np.mean(samples[2000:-2000] ** 2))) - 0.5 / np.sqrt(2)) < 0.01


def test_an_ogg_vorbis_clip_decodes() -> None:
    samples = decode_input_audio(audio_b64(tone(1.0, 48000), 48000, fmt="OGG", subtype="VORBIS"), "ogg", param="p",
                                 max_seconds=10.0)
    assert samples.dtype == np.float32 and samples.size == 16000
    assert abs(float(np.sqrt(np.mean(samples[2000:-2000] ** 2))) - 0.5 / np.sqrt(2)) < 0.02


def test_an_mp3_clip_decodes() -> None:
    samples = decode(audio_b64(tone(1.0, 44100), 44100, fmt="MP3", subtype=None))
    assert samples.dtype == np.float32 and abs(samples.size - 16000) <= 1200  # the encoder's padding frames


@pytest.mark.parametrize(("data", "code", "fragment"), [
    ("not base64!", "invalid_audio", "not valid base64"),
    (base64.b64encode(b"RIFF0000WAVEjunk").decode(), "invalid_audio", "could not be decoded"),
    (audio_b64(tone(0.07, 16000), 16000), "invalid_audio", "input audio is 70 ms long; at least 80 ms"),
    (audio_b64(tone(10.5, 8000), 8000), "audio_too_long", "input audio is 10.5 s long; the limit is 10 s"),
    (audio_b64(tone(1.0, 3000), 3000), "invalid_audio", "sample rate 3000 Hz is below 4000 Hz"),
    (audio_b64(tone(0.2, 192000), 192000), "invalid_audio", "sample rate 192000 Hz is above 96000 Hz"),
    (audio_b64(tone(0.2, 16000, channels=9), 16000), "invalid_audio", "9 channels; at most 8 are taken"),
    (audio_b64(np.array([0.1, np.nan] * 8000, dtype=np.float32), 16000, subtype="FLOAT"), "invalid_audio",
     "non-finite samples"),
    (audio_b64(np.array([0.1, 1e20] * 8000, dtype=np.float32), 16000, subtype="FLOAT"), "invalid_audio",
     "input audio peaks at 1e+20; float samples must lie within +-16 (full scale is 1)"),
    (audio_b64(np.array([0.1, -17.0] * 8000, dtype=np.float32), 16000, subtype="FLOAT"), "invalid_audio",
     "input audio peaks at 17; float samples"),
])
def test_bad_audio_is_a_400_naming_the_part(data: str, code: str, fragment: str) -> None:
    with pytest.raises(ApiError) as info:
        decode(data)
    assert info.value.status == 400 and info.value.code == code and info.value.param == "p"
    assert fragment in info.value.message


@pytest.fixture
def frames_read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Clips whose header does not give their length (as some MP3 streams'), and the frames each decode read."""
    read: list[int] = []
    blocks = soundfile.SoundFile.blocks

    def counted(self: soundfile.SoundFile, *args: object, **kwargs: object):
        read.append(0)
        for block in blocks(self, *args, **kwargs):
            read[-1] += len(block)
            yield block

    monkeypatch.setattr("deployments.audio_input._header_frames", lambda file: 0)
    monkeypatch.setattr(soundfile.SoundFile, "blocks", counted)
    return read


def test_a_clip_of_unknown_length_is_read_only_up_to_its_limit(frames_read: list[int]) -> None:
    from deployments.audio_input import READ_BLOCK_FRAMES

    with pytest.raises(ApiError) as info:
        decode(audio_b64(tone(30.0, 48000, channels=2), 48000), max_seconds=10.0)
    assert info.value.code == "audio_too_long" and info.value.param == "p"
    assert info.value.message == "input audio is longer than the limit of 10 s"
    assert frames_read == [-(-480_001 // READ_BLOCK_FRAMES) * READ_BLOCK_FRAMES]  # the block past 10 s, no more
    assert decode(audio_b64(tone(1.5, 48000, channels=2), 48000)).size == 24000  # under the limit: all of it


def chat(messages: list) -> bytes:
    return json.dumps({"model": "moss-speech", "messages": messages}).encode()


def speech_part(seconds: float) -> dict:
    return {"type": "input_audio", "input_audio": {"data": audio_b64(tone(seconds, 16000), 16000), "format": "wav"}}


def test_a_chat_request_carries_speech_as_samples_between_its_text_parts() -> None:
    _, payload = chat_request(chat([
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "listen: "}, speech_part(1.0),
                                     {"type": "text", "text": "thanks"}]}]), LIMITS)
    system, (role, content) = payload["messages"]
    assert system == ("system", "be brief") and role == "user"
    assert [part["type"] for part in content] == ["text", "audio", "text"]
    assert content[0]["text"] == "listen: " and content[2]["text"] == "thanks"
    assert content[1]["samples"].shape == (16000,) and content[1]["samples"].dtype == np.float32


@pytest.mark.parametrize(("messages", "param", "fragment"), [
    ([{"role": "system", "content": [speech_part(0.5)]}, {"role": "user", "content": "hi"}], "messages.0.content.0",
     "a system message must be text"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA"}}]}],
     "messages.0.content.0.input_audio.format", "Field required"),
    ([{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "input_audio", "input_audio": {
        "data": "AAAA", "format": "aac"}}]}], "messages.0.content.1.input_audio.format",
        "Input should be 'wav', 'mp3', 'flac' or 'ogg'"),
    ([{"role": "user", "content": [speech_part(2.0), speech_part(1.5)]}], "messages",
     "the request's input audio lasts 3.5 s in all; the limit is 3 s"),
])
def test_bad_speech_parts_are_400s_naming_where(messages: list, param: str, fragment: str) -> None:
    with pytest.raises(ApiError) as info:
        chat_request(chat(messages), LIMITS)
    assert info.value.status == 400 and info.value.param == param and fragment in info.value.message


def test_a_later_clip_is_decoded_only_up_to_what_the_earlier_ones_left(frames_read: list[int]) -> None:
    with pytest.raises(ApiError) as info:
        chat_request(chat([{"role": "user", "content": [speech_part(2.0), speech_part(60.0)]}]), LIMITS)
    assert info.value.status == 400 and info.value.param == "messages" and info.value.code == "audio_too_long"
    assert info.value.message == "the request's input audio lasts longer than the limit of 3 s in all"
    assert frames_read == [32000, 65536]  # the first clip whole; the second's first block passes the 1 s left


def test_the_llm_deployment_turns_encoded_parts_into_the_facts_sheets_rows() -> None:
    tokenizer = Tokenizer.tiny()
    codes = [7, 0, 16383]
    content = prompt_content([{"type": "audio", "codes": codes}])
    rows = build_prompt_rows(tokenizer, [ChatMessage("user", content)], output_modality="audio")
    head = [(t, AUDIO_PAD_ID) for t in [IM_START_ID, *tokenizer.encode("user\n")]]
    segment = [(SOSP_ID, AUDIO_PAD_ID), *((MODALITY_PAD_ID, c) for c in codes), (MODALITY_PAD_ID, EOSP_ID)]
    tail = [(t, AUDIO_PAD_ID) for t in [IM_END_ID, *tokenizer.encode("\n"), IM_START_ID,
                                        *tokenizer.encode("assistant\n")]]
    assert rows == head + segment + tail + [(SOSP_ID, AUDIO_PAD_ID)]
    # the same rows as the runtime's own audio turn
    assert rows == build_prompt_rows(tokenizer, [ChatMessage("user", AudioContent(tuple(codes)))],
                                     output_modality="audio")


def test_text_around_speech_stays_inside_the_same_turn() -> None:
    tokenizer = Tokenizer.tiny()
    content = prompt_content([{"type": "text", "text": "a"}, {"type": "text", "text": "b"},
                              {"type": "audio", "codes": [5]}, {"type": "text", "text": "c"}])
    assert content == ("a", "b", AudioContent((5,)), "c")
    rows = build_prompt_rows(tokenizer, [ChatMessage("user", content)], output_modality="text")
    expected = ([(t, AUDIO_PAD_ID) for t in [IM_START_ID, *tokenizer.encode("user\nab")]]
                + [(SOSP_ID, AUDIO_PAD_ID), (MODALITY_PAD_ID, 5), (MODALITY_PAD_ID, EOSP_ID)]
                + [(t, AUDIO_PAD_ID) for t in [*tokenizer.encode("c"), IM_END_ID, *tokenizer.encode("\n"),
                                               IM_START_ID, *tokenizer.encode("assistant\n")]])
    assert rows == expected
    # one text part is the plain text turn
    assert (build_prompt_rows(tokenizer, [ChatMessage("user", ("hi",))], output_modality="text")
            == build_prompt_rows(tokenizer, [ChatMessage("user", "hi")], output_modality="text"))


@pytest.mark.parametrize("content", [[], [{"type": "audio", "samples": [0.0]}], [{"type": "image"}], b"x"])
def test_parts_the_llm_cannot_take_are_prompt_errors(content) -> None:
    with pytest.raises(PromptError):
        prompt_content(content)
    with pytest.raises(PromptError, match="non-empty tuple"):
        ChatMessage("user", ())


def test_speech_input_off_is_a_400_before_any_decoding() -> None:
    from deployments.args import AppArgs

    assert not AppArgs(speech_encoder="none").speech_input and AppArgs().speech_input
    off = Limits(served_model_name="moss-speech", voices=["default"], max_input_chars=100,
                 max_new_tokens_limit=100, default_max_new_tokens=10, max_input_audio_s=0.0)
    garbage = {"type": "input_audio", "input_audio": {"data": "not base64!", "format": "wav"}}
    with pytest.raises(ApiError) as info:
        chat_request(chat([{"role": "user", "content": [{"type": "text", "text": "hi"}, garbage]}]), off)
    assert (info.value.status, info.value.param, info.value.code) == (400, "messages.0.content.1",
                                                                      "unsupported_content")
    assert "speech input is not enabled on this server" in info.value.message
    _, payload = chat_request(chat([{"role": "user", "content": "text still works"}]), off)
    assert payload["messages"] == [("user", "text still works")]
