"""Constants and frozen configuration for the codec decoder (codes -> mel -> 24 kHz PCM)."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SAMPLE_RATE = 24000
HOP_LENGTH = 480  # samples per mel frame (50 frames/s)
MEL_FRAMES_PER_CODE = 4  # codes are 12.5 Hz
SAMPLES_PER_CODE = HOP_LENGTH * MEL_FRAMES_PER_CODE  # 1920
NUM_MELS = 80
LOOKAHEAD_CODES = 3
NUM_AUDIO_CODES = 16384  # valid codes are 0..16383
SPEAKER_EMBED_DIM = 192


def resolve_dtype(dtype: Any) -> Any:
    """A torch dtype from None (float32), a torch dtype, or its name: float32, bfloat16, float16."""
    import torch

    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype must be one of {sorted(names)}, got {dtype!r}")
    return names[dtype]


def check_schedule(sizes: Any, overlap_samples: int, name: str) -> tuple[int, ...]:
    """A chunk schedule (sizes in codes) as a tuple of ints; ValueError unless it is non-empty, every size is
    an integer >= 1 (not a float, string or bool) and the crossfade overlap held back from each chunk is
    shorter than its smallest chunk."""
    try:
        chosen = tuple(operator.index(size) for size in sizes)
    except TypeError:
        chosen = ()
    if not chosen or any(isinstance(size, bool) for size in sizes) or min(chosen) < 1:
        raise ValueError(f"{name} must be a non-empty sequence of integer sizes >= 1, got {sizes!r}")
    if overlap_samples >= SAMPLES_PER_CODE * min(chosen):
        raise ValueError(f"{name} {chosen}: overlap_samples ({overlap_samples}) must be shorter than its "
                         "smallest chunk")
    return chosen


@dataclass(frozen=True)
class EncoderConfig:
    """Code encoder: embedding, pre-lookahead convs, causal blocks at code rate, x4 upsample, frame blocks."""

    vocab_size: int = NUM_AUDIO_CODES
    dim: int = 512
    num_heads: int = 8
    ffn_dim: int = 2048
    num_code_blocks: int = 6
    num_frame_blocks: int = 4
    code_attention_window: int = 4  # each code attends to itself and the 3 codes before it
    frame_attention_window: int = 8  # frames, same rule
    conv_kernel: int = 3  # causal depthwise conv in every block
    lookahead: int = LOOKAHEAD_CODES

    @property
    def upsample_kernel(self) -> int:
        """Causal conv after nearest x4 upsampling (CosyVoice2 Upsample1D: 2 * stride + 1)."""
        return 2 * MEL_FRAMES_PER_CODE + 1

    @property
    def left_context_codes(self) -> int:
        """Codes of history before a position that its encoder output can depend on."""
        code_rf = 2 + self.num_code_blocks * ((self.conv_kernel - 1) + (self.code_attention_window - 1))
        frame_rf = (self.upsample_kernel - 1) + self.num_frame_blocks * (
            (self.conv_kernel - 1) + (self.frame_attention_window - 1)
        )
        return code_rf + -(-frame_rf // MEL_FRAMES_PER_CODE)


@dataclass(frozen=True)
class EstimatorConfig:
    """Causal velocity network (CosyVoice2 CausalConditionalDecoder layout, one channel level)."""

    channels: int = 256
    num_heads: int = 8
    head_dim: int = 64
    num_transformers_per_block: int = 4
    num_mid_blocks: int = 12
    ffn_mult: int = 4
    attention_chunk_frames: int = MEL_FRAMES_PER_CODE  # attention only inside one code's 4 frames

    @property
    def time_embed_dim(self) -> int:
        """Width of the timestep MLP (CosyVoice2: 4 * channels)."""
        return 4 * self.channels


@dataclass(frozen=True)
class FlowConfig:
    """Conditional flow matching: encoder gives mu, estimator is integrated with Euler from seeded noise."""

    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    num_steps: int = 10
    cfg_rate: float = 0.7  # classifier-free guidance: v = (1 + r) v_cond - r v_uncond; 0 disables it

    def validate(self) -> None:
        """Raise ValueError on settings the streaming decoder cannot honour."""
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if not self.cfg_rate >= 0.0:
            raise ValueError(f"cfg_rate must be >= 0, got {self.cfg_rate}")
        # The streaming decoder's chunk rule and its code check use these constants, not the config's values
        if self.encoder.lookahead != LOOKAHEAD_CODES:
            raise ValueError(f"encoder.lookahead must be {LOOKAHEAD_CODES} (the streaming decoder waits for that "
                             f"many codes after a chunk), got {self.encoder.lookahead}")
        if self.encoder.vocab_size != NUM_AUDIO_CODES:
            raise ValueError(f"encoder.vocab_size must be {NUM_AUDIO_CODES} (the codes the decoder accepts), got "
                             f"{self.encoder.vocab_size}")
        if self.estimator.attention_chunk_frames < 1 or MEL_FRAMES_PER_CODE % self.estimator.attention_chunk_frames:
            raise ValueError(
                "attention_chunk_frames must divide MEL_FRAMES_PER_CODE (chunks are code-aligned)"
            )


@dataclass(frozen=True)
class BigVGANConfig:
    """Hyper-parameters handed to `bigvgan.BigVGAN` (names as in its config.json)."""

    upsample_rates: tuple[int, ...] = (5, 4, 3, 2, 2, 2)
    upsample_kernel_sizes: tuple[int, ...] = (11, 8, 7, 4, 4, 4)
    upsample_initial_channel: int = 1536
    resblock: str = "1"
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    activation: str = "snakebeta"
    snake_logscale: bool = True
    use_tanh_at_final: bool = False
    use_bias_at_final: bool = False

    def validate(self) -> None:
        """Raise ValueError unless the generator maps one mel frame to exactly HOP_LENGTH samples."""
        prod = 1
        for rate in self.upsample_rates:
            prod *= rate
        if prod != HOP_LENGTH:
            raise ValueError(f"upsample_rates multiply to {prod}, need {HOP_LENGTH} (hop of this mel)")
        if len(self.upsample_kernel_sizes) != len(self.upsample_rates):
            raise ValueError("upsample_kernel_sizes and upsample_rates differ in length")
        for rate, kernel in zip(self.upsample_rates, self.upsample_kernel_sizes):
            # ConvTranspose1d(k, u, padding=(k-u)//2) yields exactly T*u samples only when k - u is even.
            if kernel < rate or (kernel - rate) % 2 != 0:
                raise ValueError(f"upsample kernel {kernel} for rate {rate}: need kernel >= rate, k - u even")
        if self.upsample_initial_channel % (2 ** len(self.upsample_rates)) != 0:
            raise ValueError("upsample_initial_channel must be divisible by 2 ** number of upsample stages")

    def to_hparams(self) -> dict[str, Any]:
        """The dict `bigvgan.env.AttrDict` expects."""
        return {
            "num_mels": NUM_MELS,
            "sampling_rate": SAMPLE_RATE,
            "hop_size": HOP_LENGTH,
            "n_fft": 1920,
            "win_size": 1920,
            "fmin": 0,
            "fmax": 8000,
            "upsample_rates": list(self.upsample_rates),
            "upsample_kernel_sizes": list(self.upsample_kernel_sizes),
            "upsample_initial_channel": self.upsample_initial_channel,
            "resblock": self.resblock,
            "resblock_kernel_sizes": list(self.resblock_kernel_sizes),
            "resblock_dilation_sizes": [list(d) for d in self.resblock_dilation_sizes],
            "activation": self.activation,
            "snake_logscale": self.snake_logscale,
            "use_tanh_at_final": self.use_tanh_at_final,
            "use_bias_at_final": self.use_bias_at_final,
        }


LATENCY_MODES = ("low", "exact")


@dataclass(frozen=True)
class StreamConfig:
    """When a session emits PCM and how much mel context BigVGAN gets on each side of a chunk.

    latency "low" (default): a chunk leaves as soon as its codes have the encoder lookahead; BigVGAN sees
    `vocoder_right_context_frames` (default 0) past the chunk; the last `overlap_samples` of each chunk are
    held back and crossfaded (raised cosine) with the next chunk's recomputation of them. Chunk boundaries
    follow `chunk_schedule_codes` at fixed code positions, so the audio depends on the codes only, not on
    how they were pushed or batched. latency "exact": wait for BigVGAN's whole right context (streamed PCM
    == whole PCM up to float rounding); chunking by `first_chunk_codes` / `chunk_codes`.

    Light load (low latency only): a session opened while at most `light_load_max_sessions` sessions are
    open (itself included) follows `light_load_schedule_codes` instead, e.g. a smaller first chunk for an
    earlier first audio when nothing else competes for the GPU; its audio then depends on its codes and
    the schedule it opened with. Give it the main schedule's later sizes (e.g. (2, 3, 5, 10, 25) beside
    (4, 5, 10, 25)), so that its chunks pad to shapes the main schedule's warm-up captured.
    """

    latency: str = "low"
    # low: chunk sizes in codes; the last one repeats
    chunk_schedule_codes: tuple[int, ...] = (2, 3, 5, 10, 25)
    overlap_samples: int = 1920  # low: held back at a chunk's end, crossfaded with the next chunk
    first_chunk_codes: int = 2  # exact: emit as soon as this many codes of final PCM exist
    chunk_codes: int = 8  # exact: later chunks wait for this many codes of final PCM (amortises the window)
    light_load_schedule_codes: tuple[int, ...] | None = None  # low: sessions opened under light load
    light_load_max_sessions: int = 1  # light load: at most this many open sessions, the new one included
    # None = exact mode: the generator's exact receptive field (streamed PCM == whole PCM up to rounding);
    # low mode: left = exact field, right = 0. Other values trade exactness for latency (docs/vocoder.md).
    vocoder_left_context_frames: int | None = None
    vocoder_right_context_frames: int | None = None

    def validate(self) -> None:
        """Raise ValueError on unknown modes, chunk sizes below one code, negative contexts or overlaps."""
        if self.latency not in LATENCY_MODES:
            raise ValueError(f"latency must be one of {LATENCY_MODES}, got {self.latency!r}")
        if self.first_chunk_codes < 1 or self.chunk_codes < 1:
            raise ValueError("first_chunk_codes and chunk_codes must be >= 1")
        if self.overlap_samples < 0:
            raise ValueError(f"overlap_samples must be >= 0, got {self.overlap_samples}")
        check_schedule(self.chunk_schedule_codes, self.overlap_samples, "chunk_schedule_codes")
        light = self.light_load_schedule_codes
        if light is not None:
            if self.latency != "low":
                raise ValueError("light_load_schedule_codes needs latency 'low'")
            check_schedule(light, self.overlap_samples, "light_load_schedule_codes")
            if self.light_load_max_sessions < 1:
                raise ValueError("light_load_max_sessions must be >= 1")
        for value in (self.vocoder_left_context_frames, self.vocoder_right_context_frames):
            if value is not None and value < 0:
                raise ValueError("vocoder context frames must be >= 0")


@dataclass(frozen=True)
class VocoderConfig:
    """Everything that defines one decoder: flow, generator, streaming policy."""

    name: str = "full"
    flow: FlowConfig = field(default_factory=FlowConfig)
    bigvgan: BigVGANConfig = field(default_factory=BigVGANConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)

    def validate(self) -> None:
        """Validate all parts."""
        self.flow.validate()
        self.bigvgan.validate()
        self.stream.validate()

    def with_schedules(self, chunk_schedule_codes: Sequence[int] | None = None,
                       light_load_schedule_codes: Sequence[int] | None = None,
                       light_load_max_sessions: int = 1) -> VocoderConfig:
        """This config with a serving app's chunk schedules (None: keep the stream's), validated."""
        stream = self.stream
        if chunk_schedule_codes is not None:
            stream = dataclasses.replace(stream, chunk_schedule_codes=tuple(chunk_schedule_codes))
        if light_load_schedule_codes is not None:
            stream = dataclasses.replace(stream, light_load_schedule_codes=tuple(light_load_schedule_codes),
                                         light_load_max_sessions=light_load_max_sessions)
        config = dataclasses.replace(self, stream=stream)
        config.validate()
        return config

    @classmethod
    def preset(cls, name: str) -> VocoderConfig:
        """`full`: CosyVoice2 flow sizes + BigVGAN-v2 base widths; `tiny`: same layout, small widths."""
        if name == "full":
            return cls(name="full")
        if name == "tiny":
            return cls(
                name="tiny",
                flow=FlowConfig(
                    encoder=EncoderConfig(
                        dim=64, num_heads=2, ffn_dim=128, num_code_blocks=2, num_frame_blocks=1
                    ),
                    estimator=EstimatorConfig(
                        channels=64, num_heads=2, head_dim=32, num_transformers_per_block=1, num_mid_blocks=1
                    ),
                    num_steps=4,
                ),
                bigvgan=BigVGANConfig(
                    upsample_initial_channel=128,
                    resblock_kernel_sizes=(3,),
                    resblock_dilation_sizes=((1, 3, 5),),
                ),
            )
        raise ValueError(f"unknown vocoder preset {name!r}; known: 'tiny', 'full'")
