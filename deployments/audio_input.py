"""Speech input at the HTTP edge: a chat `input_audio` part (base64 WAV or MP3) -> 16 kHz mono float32 samples.

Decoding (soundfile), down-mixing and resampling (soxr, its high-quality setting) happen in the ingress, so a
bad file is a 400 before any deployment is called; the vocoder replica turns the samples into codes
(`vocoder.speech_encoder`). Every failure is an `ApiError` 400 naming the part (`param`).
"""
from __future__ import annotations

import base64
import binascii
import functools
import io
from collections.abc import Callable

import numpy as np

from deployments.errors import bad_request
from vocoder.speech_encoder import INPUT_SAMPLE_RATE, MAX_SAMPLE_PEAK

MIN_INPUT_SAMPLES = 1280  # one code's worth at 16 kHz (80 ms)
MIN_SOURCE_RATE = 4000  # Hz; below it no speech is left to encode
# Decoding costs memory and time in proportion to frames x channels, not to the upload's size (a FLAC of
# silence at 655 kHz with 8 channels is a few hundred KB), so the source's rate and channels are bounded and
# the clip is read and down-mixed a block at a time, stopping at the length limit.
MAX_SOURCE_RATE = 96000  # Hz
MAX_SOURCE_CHANNELS = 8
READ_BLOCK_FRAMES = 1 << 16

TooLong = Callable[[float | None], Exception]  # the clip's length in seconds (None: past the limit, not known)


def decode_input_audio(data: str, audio_format: str, *, param: str, max_seconds: float,
                       too_long: TooLong | None = None) -> np.ndarray:
    """The clip as 16 kHz mono float32 samples; a 400 (`invalid_audio` / `audio_too_long`) for base64 that
    does not decode, data soundfile cannot read, a sample rate below 4 kHz or above 96 kHz, more than 8
    channels, non-finite samples, a clip shorter than one code (80 ms) or longer than `max_seconds` (the
    error `too_long` makes, by default one naming this clip). `audio_format` (the part's `format`) only names
    the format in errors: any container libsndfile reads (WAV, MP3, FLAC, Ogg) is decoded."""
    import soundfile
    import soxr

    if too_long is None:
        too_long = functools.partial(_too_long, max_seconds=max_seconds, param=param)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("input_audio.data is not valid base64", param=param, code="invalid_audio") from None
    try:
        with soundfile.SoundFile(io.BytesIO(raw)) as file:
            rate, channels = file.samplerate, file.channels
            if rate < MIN_SOURCE_RATE or rate > MAX_SOURCE_RATE:
                bound = f"below {MIN_SOURCE_RATE}" if rate < MIN_SOURCE_RATE else f"above {MAX_SOURCE_RATE}"
                raise bad_request(f"input audio sample rate {rate} Hz is {bound} Hz", param=param,
                                  code="invalid_audio")
            if channels > MAX_SOURCE_CHANNELS:
                raise bad_request(f"input audio has {channels} channels; at most {MAX_SOURCE_CHANNELS} are taken",
                                  param=param, code="invalid_audio")
            most, frames = int(max_seconds * rate), _header_frames(file)
            if frames > most:  # refused before decoding
                raise too_long(frames / rate)
            blocks = []
            for block in file.blocks(READ_BLOCK_FRAMES, dtype="float32", always_2d=True):
                most -= len(block)
                if most < 0:  # a header without the length (or a wrong one)
                    raise too_long(None)
                blocks.append(block.mean(axis=1, dtype=np.float32) if channels > 1 else block[:, 0])
    except (soundfile.SoundFileError, RuntimeError) as exc:
        reason = getattr(exc, "error_string", None) or str(exc)  # libsndfile's words, without the buffer's repr
        raise bad_request(f"input audio (format {audio_format!r}) could not be decoded: {reason}", param=param,
                          code="invalid_audio") from None
    mono = np.concatenate(blocks) if blocks else np.zeros(0, np.float32)
    if not np.isfinite(mono).all():
        raise bad_request("input audio holds non-finite samples", param=param, code="invalid_audio")
    if rate != INPUT_SAMPLE_RATE and mono.size:
        mono = soxr.resample(mono, rate, INPUT_SAMPLE_RATE, quality="HQ").astype(np.float32, copy=False)
    peak = float(np.abs(mono).max()) if mono.size else 0.0  # after resampling: what the encoder will get
    if peak > MAX_SAMPLE_PEAK:
        raise bad_request(f"input audio peaks at {peak:.4g}; float samples must lie within +-{MAX_SAMPLE_PEAK:g} "
                          "(full scale is 1)", param=param, code="invalid_audio")
    if mono.size < MIN_INPUT_SAMPLES:
        raise bad_request(f"input audio is {mono.size / INPUT_SAMPLE_RATE * 1000:.0f} ms long; at least "
                          f"{MIN_INPUT_SAMPLES / INPUT_SAMPLE_RATE * 1000:.0f} ms is needed", param=param,
                          code="invalid_audio")
    return np.ascontiguousarray(mono)


def _header_frames(file: object) -> int:
    """The clip's length in frames as its header gives it (0 where it does not)."""
    return file.frames


def _too_long(seconds: float | None, *, max_seconds: float, param: str) -> Exception:
    message = (f"input audio is {seconds:.1f} s long; the limit is {max_seconds:g} s" if seconds is not None
               else f"input audio is longer than the limit of {max_seconds:g} s")
    return bad_request(message, param=param, code="audio_too_long")
