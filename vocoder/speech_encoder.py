"""Speech in: 16 kHz audio -> 12.5 Hz codec codes (the codec's encoder, a causal Whisper-VQ).

Facts sheet: "Encoder (speech in): causal Whisper-VQ, 16 kHz input, 12.5 codes/s, one codebook of 16384
codes". The sheet gives no more, so the layout is that of the public Whisper-VQ speech tokenizers (the
GLM-4-Voice family): a Whisper encoder truncated where its vector quantizer sits.

- Front end: Whisper's log-mel (n_fft 400, hop 160, Hann window, centred frames, the last one dropped;
  `num_mel_bins` Slaney mel bands; log10 clamped at 1e-10, floored at its maximum - 8, then (x + 4) / 4).
  `samples // 160` frames (100 per second).
- Two convolutions with GELU (kernel 3; the second of stride 2: 50 frames per second), causal (left-padded
  by 2) when `causal_convolution`, else padded by 1 on both sides as Whisper's; learned positions added.
- `num_layers` pre-norm Whisper layers (LayerNorm eps 1e-5; self-attention with biases on q, v and out but
  not on k; GELU MLP) under a block-causal mask: a frame sees every earlier frame and its whole block of
  `causal_block_size` frames (200: 4 s).
- Average pooling by `pooling_kernel_size` (4; a last partial window is zero-padded, as the reference
  tokenizers do), 12.5 per second; then each vector's nearest codebook entry (squared L2 distance in
  float32, the first on a tie) is its code.

A clip of `n` samples gives `ceil(ceil((n // 160) / 2) / 4)` codes (`num_codes`); a clip longer than
`max_source_positions` frames after the convolutions (30 s) is encoded in independent 30 s segments, as
the reference tokenizers do. The frames a clip ends on depend on its whole last block, so codes are final
only per block (not streamed here: a request brings its whole clip).

Weights: `tiny` / `full` presets with deterministic random weights, or a checkpoint folder (`config.json`
with Whisper-VQ fields, `model*.safetensors` with the names below; safetensors only). Whether the
MOSS-Speech codec's encoder checkpoint uses these names is not known here (its weights cannot be downloaded);
`load_speech_encoder` is strict, so a mismatch fails loudly, naming the tensors.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vocoder.config import NUM_AUDIO_CODES, resolve_dtype

INPUT_SAMPLE_RATE = 16000
N_FFT = 400
MEL_HOP = 160  # samples per log-mel frame (100 per second)
# Float samples are on [-1, 1]; peaks up to 16 (24 dB over full scale) are taken as they come. A louder clip is not
# audio at float scale (int16 values as floats, a broken file), and from ~1e17 the power spectrum overflows and
# every code comes out 0.
MAX_SAMPLE_PEAK = 16.0
# Name prefixes a checkpoint may put before the encoder's own names.
CHECKPOINT_PREFIXES = ("model.encoder.", "encoder.")
# Clips are padded to a multiple of this many frames after the convolutions (1.2 s; a multiple of the pooling,
# dividing the 1500 positions): one CUDA graph per multiple.
FRAME_BUCKET = 60


@dataclass(frozen=True)
class SpeechEncoderConfig:
    """Shape of the Whisper-VQ encoder (field names of its `config.json` in the comments)."""

    d_model: int = 1280  # d_model
    num_heads: int = 20  # encoder_attention_heads
    ffn_dim: int = 5120  # encoder_ffn_dim
    num_mel_bins: int = 128  # num_mel_bins
    num_layers: int = 16  # quantize_position (= pooling_position): the layers kept before the quantizer
    max_source_positions: int = 1500  # max_source_positions: 30 s at 50 frames/s
    pooling_kernel_size: int = 4  # pooling_kernel_size
    codebook_size: int = NUM_AUDIO_CODES  # quantize_vocab_size
    causal_block_size: int = 200  # quantize_causal_block_size, frames at 50/s
    causal_convolution: bool = True  # encoder_causal_convolution

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "causal_convolution":
                if not isinstance(value, bool):
                    raise ValueError(f"causal_convolution must be a bool, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be an integer >= 1, got {value!r}")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of num_heads ({self.num_heads})")
        if self.codebook_size != NUM_AUDIO_CODES:
            raise ValueError(f"codebook_size must be {NUM_AUDIO_CODES} (the LLM's audio codes), "
                             f"got {self.codebook_size}")

    @property
    def samples_per_code(self) -> int:
        """16 kHz samples per code: hop x conv stride x pooling (1280: 12.5 codes per second)."""
        return MEL_HOP * 2 * self.pooling_kernel_size

    @property
    def segment_samples(self) -> int:
        """Samples of one independently encoded segment (`max_source_positions` frames after the convs)."""
        return self.max_source_positions * 2 * MEL_HOP

    def num_codes(self, num_samples: int) -> int:
        """Codes a clip of `num_samples` 16 kHz samples gives (segments counted one by one)."""
        full, rest = divmod(num_samples, self.segment_samples)
        per_full = self._codes_of_segment(self.segment_samples)
        return full * per_full + (self._codes_of_segment(rest) if rest else 0)

    def _codes_of_segment(self, num_samples: int) -> int:
        frames = num_samples // MEL_HOP
        return math.ceil(math.ceil(frames / 2) / self.pooling_kernel_size)

    @classmethod
    def preset(cls, name: str) -> SpeechEncoderConfig:
        """`full`: the Whisper-large-v3 widths truncated at the quantizer (16 layers, ~0.3B parameters);
        `tiny`: the same structure, small enough for CPU tests."""
        if name == "full":
            return cls()
        if name == "tiny":
            return cls(d_model=32, num_heads=2, ffn_dim=64, num_layers=2)
        raise ValueError(f"unknown speech encoder preset {name!r}; use 'tiny', 'full' or a checkpoint folder")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> SpeechEncoderConfig:
        """From a Whisper-VQ `config.json`; ValueError for a missing field or a layout this encoder lacks."""
        names = {"d_model": "d_model", "num_heads": "encoder_attention_heads", "ffn_dim": "encoder_ffn_dim",
                 "num_mel_bins": "num_mel_bins", "num_layers": "quantize_position",
                 "max_source_positions": "max_source_positions", "pooling_kernel_size": "pooling_kernel_size",
                 "codebook_size": "quantize_vocab_size", "causal_block_size": "quantize_causal_block_size",
                 "causal_convolution": "encoder_causal_convolution"}
        missing = sorted(key for key in names.values() if d.get(key) is None)
        if missing:
            raise ValueError(f"speech encoder config.json lacks {missing}")
        if d.get("pooling_position", d["quantize_position"]) != d["quantize_position"]:
            raise ValueError("pooling_position must equal quantize_position (pooling right before the "
                             f"quantizer), got {d.get('pooling_position')} and {d['quantize_position']}")
        if d.get("pooling_type", "avg") != "avg":
            raise ValueError(f"pooling_type must be 'avg', got {d.get('pooling_type')!r}")
        return cls(**{ours: d[theirs] for ours, theirs in names.items()})

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` fields `from_hf_dict` reads."""
        ours = asdict(self)
        return {"model_type": "whisper_vq", "d_model": ours["d_model"],
                "encoder_attention_heads": ours["num_heads"], "encoder_ffn_dim": ours["ffn_dim"],
                "num_mel_bins": ours["num_mel_bins"], "quantize_position": ours["num_layers"],
                "pooling_position": ours["num_layers"], "pooling_type": "avg",
                "max_source_positions": ours["max_source_positions"],
                "pooling_kernel_size": ours["pooling_kernel_size"], "quantize_vocab_size": ours["codebook_size"],
                "quantize_causal_block_size": ours["causal_block_size"],
                "encoder_causal_convolution": ours["causal_convolution"]}


def mel_filters(num_mel_bins: int) -> np.ndarray:
    """Slaney mel filter bank [num_mel_bins, N_FFT // 2 + 1] for 16 kHz (as Whisper's front end)."""
    import librosa

    return librosa.filters.mel(sr=INPUT_SAMPLE_RATE, n_fft=N_FFT, n_mels=num_mel_bins).astype(np.float32)


def log_mel(audio: torch.Tensor, filters: torch.Tensor) -> torch.Tensor:
    """Whisper's log-mel of a 16 kHz mono clip [n] (float32): [num_mel_bins, n // 160]."""
    window = torch.hann_window(N_FFT, device=audio.device)
    stft = torch.stft(audio, N_FFT, MEL_HOP, window=window, return_complex=True)  # centred, reflect-padded
    power = stft[..., :-1].abs() ** 2
    mel = torch.clamp(filters @ power, min=1e-10).log10()
    mel = torch.maximum(mel, mel.max() - 8.0)
    return (mel + 4.0) / 4.0


class _Conv(nn.Conv1d):
    """Kernel-3 convolution, causal (left padding 2) or Whisper's symmetric padding 1."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, causal: bool) -> None:
        super().__init__(in_channels, out_channels, 3, stride=stride, padding=0)
        self.pad = (2, 0) if causal else (1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, self.pad))


class _SelfAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        t, d = x.shape
        # [1, heads, T, head dim]: the fused attention kernels take 4-D inputs only (3-D ones run the math path)
        q, k, v = (proj(x).view(1, t, self.num_heads, d // self.num_heads).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None, None])
        return self.out_proj(out.transpose(1, 2).reshape(t, d))


class _Layer(nn.Module):
    """One pre-norm Whisper encoder layer."""

    def __init__(self, cfg: SpeechEncoderConfig) -> None:
        super().__init__()
        self.self_attn = _SelfAttention(cfg.d_model, cfg.num_heads)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.ffn_dim)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """`bias` [T, T]: 0 where a frame may attend, -inf elsewhere."""
        x = x + self.self_attn(self.self_attn_layer_norm(x), bias)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


def block_causal(num_frames: int, block_size: int, device: torch.device) -> torch.Tensor:
    """[T, T] bool, True where frame i may attend to frame j: j <= i, or j in i's block."""
    index = torch.arange(num_frames, device=device)
    return (index[None, :] <= index[:, None]) | (index[None, :] // block_size == index[:, None] // block_size)


class SpeechEncoder(nn.Module):
    """Whisper-VQ encoder; `state_dict` keys are the checkpoint names (without a prefix)."""

    def __init__(self, cfg: SpeechEncoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self._graphed: Any = None  # vocoder.graphs.GraphedFunction after use_cuda_graphs()
        # CUDA: the stream `encode` runs on (None: the caller's current stream). The vocoder replica gives it
        # one of its own, so that an encode overlaps the vocoder's steps instead of queueing behind them.
        self.stream: torch.cuda.Stream | None = None
        self.conv1 = _Conv(cfg.num_mel_bins, cfg.d_model, 1, cfg.causal_convolution)
        self.conv2 = _Conv(cfg.d_model, cfg.d_model, 2, cfg.causal_convolution)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, cfg.d_model)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers))
        self.codebook = nn.Embedding(cfg.codebook_size, cfg.d_model)
        # float32 whatever the weights' dtype (not a buffer, which `.to(dtype)` would cast); on the device
        # when first used there
        self._mel_filters = torch.from_numpy(mel_filters(cfg.num_mel_bins))

    @property
    def device(self) -> torch.device:
        return self.codebook.weight.device

    @property
    def mel_filters(self) -> torch.Tensor:
        """The front end's float32 filter bank on the encoder's device."""
        if self._mel_filters.device != self.device:
            self._mel_filters = self._mel_filters.to(self.device)
        return self._mel_filters

    @torch.inference_mode()
    def encode(self, audio: np.ndarray | torch.Tensor) -> list[int]:
        """Codes of a 16 kHz mono clip (float samples in [-1, 1]); `config.num_codes(len(audio))` of them,
        each in 0..codebook_size-1. ValueError for a clip too short for one code or not one-dimensional; for a
        NaN or infinite sample or one beyond +-MAX_SAMPLE_PEAK (the codes of NaN distances are all 0); and for
        integer, boolean or complex samples (int16 PCM would be encoded at 32767 times its level)."""
        audio = torch.as_tensor(audio)
        if not audio.is_floating_point():
            raise ValueError(f"audio must hold float samples in [-1, 1], got dtype {audio.dtype}")
        audio = audio.to(torch.float32)
        if audio.ndim != 1:
            raise ValueError(f"audio must be one channel [samples], got shape {tuple(audio.shape)}")
        if self.config.num_codes(audio.numel()) < 1:
            raise ValueError(f"audio of {audio.numel()} samples is too short for one code "
                             f"(at least {MEL_HOP} samples at 16 kHz)")
        if not bool(torch.isfinite(audio).all()):
            raise ValueError(f"audio holds {int((~torch.isfinite(audio)).sum())} NaN or infinite sample(s)")
        peak = float(audio.abs().max())
        if peak > MAX_SAMPLE_PEAK:
            raise ValueError(f"audio peaks at {peak:.4g}; float samples must lie within +-{MAX_SAMPLE_PEAK:g} "
                             "(full scale is 1)")
        with torch.cuda.stream(self.stream):  # (None: a no-op, the caller's current stream)
            audio = audio.to(self.device)
            step = self.config.segment_samples
            codes: list[int] = []
            for start in range(0, audio.numel(), step):
                segment = audio[start:start + step]
                if segment.numel() < MEL_HOP:  # a remainder shorter than one mel frame gives no code
                    continue
                codes += self._encode_segment(segment).tolist()  # (waits for this stream only)
        return codes

    def _encode_segment(self, audio: torch.Tensor) -> torch.Tensor:
        """Codes of one segment: the log-mel eagerly, then the rest (`codes_of_frames`) on the mel padded to a
        `FRAME_BUCKET` multiple of frames, through a CUDA graph per bucket after `use_cuda_graphs`."""
        mel = log_mel(F.pad(audio, (0, max(0, N_FFT // 2 + 1 - audio.numel()))), self.mel_filters)
        num_frames = audio.numel() // MEL_HOP
        frames = (num_frames + 1) // 2  # after the stride-2 convolution
        padded = min(self.config.max_source_positions, -(-frames // FRAME_BUCKET) * FRAME_BUCKET)
        mel_in = torch.zeros(self.config.num_mel_bins, 2 * padded, device=self.device, dtype=self.codebook.weight.dtype)
        mel_in[:, :num_frames] = mel[:, :num_frames]
        count = torch.tensor(frames, device=self.device)
        run = self._graphed if self._graphed is not None else self.codes_of_frames
        return run(mel_in, count)[:-(-frames // self.config.pooling_kernel_size)]

    def codes_of_frames(self, mel: torch.Tensor, num_frames: torch.Tensor) -> torch.Tensor:
        """Codes [T / pooling] of a log-mel [mel bins, 2T] whose first `num_frames` (a 0-d device tensor) of the T
        frames after the convolutions are the clip's: the later ones are masked out as keys and zeroed before the
        pooling, so the clip's codes are those of the clip alone (up to the products' rounding). Static shapes:
        one CUDA graph serves every clip of a bucket."""
        x = F.gelu(self.conv1(mel))
        x = F.gelu(self.conv2(x)).transpose(0, 1)  # [T, d] at 50 frames/s
        x = x + self.embed_positions.weight[:x.shape[0]]
        valid = torch.arange(x.shape[0], device=x.device) < num_frames
        allowed = block_causal(x.shape[0], self.config.causal_block_size, x.device) & valid[None, :]
        # rows 16-byte aligned (a width of 8k): PyTorch's memory-efficient attention takes such a bias as it is
        width = -(-x.shape[0] // 8) * 8
        bias = torch.zeros(x.shape[0], width, device=x.device, dtype=x.dtype)[:, :x.shape[0]]
        bias.masked_fill_(~allowed, float("-inf"))
        for layer in self.layers:
            x = layer(x, bias)
        x = x * valid[:, None].to(x.dtype)
        k = self.config.pooling_kernel_size
        x = F.pad(x.transpose(0, 1), (0, (-x.shape[0]) % k))
        pooled = F.avg_pool1d(x[None], k)[0].transpose(0, 1).float()  # [codes, d]
        book = self.codebook.weight.float()
        distances = pooled.square().sum(1, keepdim=True) + book.square().sum(1) - 2 * pooled @ book.T
        return distances.argmin(dim=1)

    def use_cuda_graphs(self) -> None:
        """Run `codes_of_frames` through one captured CUDA graph per frame bucket (on CPU the same buffers are
        used with the function run again, for tests); the graphs share one memory pool."""
        from vocoder.graphs import GraphedFunction

        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self._graphed = GraphedFunction(self.codes_of_frames, max_graphs=self.num_buckets, capture_after_calls=1,
                                        pool=pool)

    @property
    def num_buckets(self) -> int:
        return -(-self.config.max_source_positions // FRAME_BUCKET)

    def warm_up(self) -> int:
        """Encode one clip per frame bucket (capturing every bucket's graph after `use_cuda_graphs`, so none is
        captured under traffic), then freeze the graphs; returns the graphs captured."""
        for bucket in range(1, self.num_buckets + 1):
            frames = min(bucket * FRAME_BUCKET, self.config.max_source_positions)
            self.encode(torch.zeros(2 * MEL_HOP * frames))
        if self._graphed is None:
            return 0
        self._graphed.freeze()
        return self._graphed.num_graphs


def build_speech_encoder(cfg: SpeechEncoderConfig, *, seed: int = 0, device: str | torch.device = "cpu",
                         dtype: torch.dtype = torch.float32) -> SpeechEncoder:
    """A SpeechEncoder with deterministic random weights (a function of `seed` only)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SpeechEncoder(cfg)
        with torch.no_grad():
            model.codebook.weight.normal_(0.0, 1.0)
    return model.to(device=device, dtype=dtype).eval()


def _ignorable(name: str, cfg: SpeechEncoderConfig) -> bool:
    """Tensors of a Whisper-VQ checkpoint the truncated encoder does not use: the layers after the quantizer,
    the positions of the pooled sequence (only read by those layers) and Whisper's final LayerNorm."""
    if name.startswith("layers."):
        index = name.split(".")[1]
        return index.isdigit() and int(index) >= cfg.num_layers
    return name == "embed_positions2.weight" or name.startswith("layer_norm.")


def load_speech_encoder(path: str | Path, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32) -> SpeechEncoder:
    """A SpeechEncoder from a checkpoint folder: `config.json` and `model*.safetensors` (safetensors only).

    Strict: every tensor the encoder has must be present with its shape (names may carry a
    `CHECKPOINT_PREFIXES` prefix); any other tensor is an error unless `_ignorable`. Errors name the tensors."""
    from safetensors import SafetensorError, safe_open

    folder = Path(path)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"speech encoder checkpoint {folder} has no config.json")
    try:
        hf_config = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_path} is not valid JSON: {exc}") from None
    if not isinstance(hf_config, dict):
        raise ValueError(f"{config_path} must hold a JSON object, got {type(hf_config).__name__}")  # noqa: TRY004 - a file's content; callers catch ValueError
    cfg = SpeechEncoderConfig.from_hf_dict(hf_config)
    files = sorted(folder.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"speech encoder checkpoint {folder} has no model*.safetensors")
    with torch.device("meta"):  # no memory for the weights until they are read
        model = SpeechEncoder(cfg)
    wanted = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except SafetensorError as exc:  # a renamed pickle, a truncated download
            raise ValueError(f"speech encoder file {file} cannot be read as safetensors: {exc}") from None
        with handle:
            for stored in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                name = next((stored[len(p):] for p in CHECKPOINT_PREFIXES if stored.startswith(p)), stored)
                if name in wanted:
                    if name in state:
                        raise ValueError(f"speech encoder checkpoint holds {name!r} twice")
                    tensor = handle.get_tensor(stored)
                    if tuple(tensor.shape) != tuple(wanted[name].shape):
                        raise ValueError(f"speech encoder tensor {stored!r} has shape {tuple(tensor.shape)}, "
                                         f"expected {tuple(wanted[name].shape)} from config.json (in {file})")
                    if not tensor.is_floating_point():
                        raise ValueError(f"speech encoder tensor {stored!r} in {file.name} is {tensor.dtype}, "
                                         "not floating point")
                    # a copy: get_tensor's CPU tensor is a view of the file's mapping, which follows the file
                    state[name] = tensor.to(dtype, copy=True)
                elif not _ignorable(name, cfg):
                    unexpected.append(stored)
    missing = sorted(set(wanted) - set(state))
    if missing or unexpected:
        raise ValueError(f"speech encoder checkpoint {folder} does not match the encoder: "
                         f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
                         f"unexpected {sorted(unexpected)[:8]}{' ...' if len(unexpected) > 8 else ''}")
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval()


def save_speech_encoder(model: SpeechEncoder, path: str | Path, *, prefix: str = "",
                        extra: dict[str, torch.Tensor] | None = None) -> None:
    """Write `model` as a checkpoint folder `load_speech_encoder` reads (tests make small ones with it);
    `prefix` before every name, `extra` tensors added as they are."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=1))
    tensors = {prefix + name: t.detach().cpu().contiguous() for name, t in model.state_dict().items()}
    save_file({**tensors, **(extra or {})}, str(folder / "model.safetensors"))


def speech_encoder_for(spec: str, *, device: str | torch.device = "cpu",
                       dtype: torch.dtype | str | None = None, seed: int = 0) -> SpeechEncoder:
    """`tiny` / `full` (random weights from `seed`) or a checkpoint folder; dtype None or a name as the
    vocoder's (`resolve_dtype`)."""
    dtype = resolve_dtype(dtype)
    if spec in ("tiny", "full"):
        return build_speech_encoder(SpeechEncoderConfig.preset(spec), seed=seed, device=device, dtype=dtype)
    return load_speech_encoder(spec, device=device, dtype=dtype)


def build_speech_encoder_for_serving(spec: str, vocoder_kwargs: dict[str, Any]) -> SpeechEncoder:
    """The speech encoder as the vocoder replica builds it beside its vocoder: `spec` (`speech_encoder_for`) on
    the vocoder's device and dtype, random weights from its seed; on a CUDA device a stream of its own, and with
    its `cuda_graphs` one graph per frame bucket, all captured now (`warm_up`) so that none is captured under
    traffic."""
    import logging
    import time

    encoder = speech_encoder_for(spec, device=vocoder_kwargs.get("device", "cpu"), dtype=vocoder_kwargs.get("dtype"),
                                 seed=vocoder_kwargs.get("seed", 0))
    if encoder.device.type == "cuda":  # its own stream, high priority: a question waits for its encode
        encoder.stream = torch.cuda.Stream(encoder.device, priority=-1)
    if vocoder_kwargs.get("cuda_graphs") and encoder.device.type == "cuda":
        encoder.use_cuda_graphs()
        started = time.monotonic()
        captured = encoder.warm_up()
        logging.getLogger(__name__).info("speech encoder warm-up: %d graphs captured in %.1f s", captured,
                                         time.monotonic() - started)
    return encoder


__all__ = ["INPUT_SAMPLE_RATE", "SpeechEncoder", "SpeechEncoderConfig", "build_speech_encoder",
           "build_speech_encoder_for_serving",
           "load_speech_encoder", "save_speech_encoder", "speech_encoder_for"]
