"""Speech input at the HTTP edge: a chat `input_audio` part (base64 WAV or MP3) -> 16 kHz mono float32 samples.

Decoding (soundfile), down-mixing and resampling (soxr, its high-quality setting) happen in the ingress, so a
bad file is a 400 before any deployment is called; the vocoder replica turns the samples into codes
(`vocoder.speech_encoder`). Every failure is an `ApiError` 400 naming the part (`param`).
"""
from __future__ import annotations

import base64
import binascii
import io

import numpy as np

from deployments.errors import bad_request
from vocoder.speech_encoder import INPUT_SAMPLE_RATE

MIN_INPUT_SAMPLES = 1280  # one code's worth at 16 kHz (80 ms)
MIN_SOURCE_RATE = 4000  # Hz; below it no speech is left to encode


def decode_input_audio(data: str, audio_format: str, *, param: str, max_seconds: float) -> np.ndarray:
    """The clip as 16 kHz mono float32 samples; a 400 (`invalid_audio` / `audio_too_long`) for base64 that
    does not decode, data soundfile cannot read, a sample rate below 4 kHz, non-finite samples, a clip
    shorter than one code (80 ms) or longer than `max_seconds`. `audio_format` (the part's `format`) only
    names the format in errors: any container libsndfile reads (WAV, MP3, FLAC, Ogg) is decoded."""
    import soundfile
    import soxr

    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("input_audio.data is not valid base64", param=param, code="invalid_audio") from None
    try:
        with soundfile.SoundFile(io.BytesIO(raw)) as file:
            rate = file.samplerate
            if rate < MIN_SOURCE_RATE:
                raise bad_request(f"input audio sample rate {rate} Hz is below {MIN_SOURCE_RATE} Hz", param=param,
                                  code="invalid_audio")
            if file.frames > 0 and file.frames > max_seconds * rate:  # before reading it all
                raise _too_long(file.frames / rate, max_seconds, param)
            samples = file.read(dtype="float32", always_2d=True)
    except (soundfile.SoundFileError, RuntimeError) as exc:
        reason = getattr(exc, "error_string", None) or str(exc)  # libsndfile's words, without the buffer's repr
        raise bad_request(f"input audio (format {audio_format!r}) could not be decoded: {reason}", param=param,
                          code="invalid_audio") from None
    mono = samples.mean(axis=1, dtype=np.float32) if samples.shape[1] > 1 else samples[:, 0]
    if mono.size > max_seconds * rate:  # formats whose length is known only once read (MP3 streams)
        raise _too_long(mono.size / rate, max_seconds, param)
    if not np.isfinite(mono).all():
        raise bad_request("input audio holds non-finite samples", param=param, code="invalid_audio")
    if rate != INPUT_SAMPLE_RATE and mono.size:
        mono = soxr.resample(mono, rate, INPUT_SAMPLE_RATE, quality="HQ").astype(np.float32, copy=False)
    if mono.size < MIN_INPUT_SAMPLES:
        raise bad_request(f"input audio is {mono.size / INPUT_SAMPLE_RATE * 1000:.0f} ms long; at least "
                          f"{MIN_INPUT_SAMPLES / INPUT_SAMPLE_RATE * 1000:.0f} ms is needed", param=param,
                          code="invalid_audio")
    return np.ascontiguousarray(mono)


def _too_long(seconds: float, max_seconds: float, param: str) -> Exception:
    return bad_request(f"input audio is {seconds:.1f} s long; the limit is {max_seconds:g} s", param=param,
                       code="audio_too_long")
