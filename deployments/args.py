"""`AppArgs`: the one typed model that both `config/*.yaml` and Python code hand to `build_app`.

Engine settings are passed through to `runtime.engine.EngineConfig` unchanged (field names match);
vocoder settings to `vocoder.StreamingVocoder.from_preset`. Per-deployment options name only the
Serve knobs we support, so a typo in YAML fails at build time instead of being ignored.
"""
from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

# Serve deployment options accepted under `llm_options` / `vocoder_options` / `ingress_options`.
# `num_cpus` / `num_gpus` / `memory` / `resources` (custom resource name -> amount, e.g. one `vocoder_slot`
# per replica where each GPU worker offers one: k8s/rayservice.yaml) go into `ray_actor_options`, `env_vars`
# (name -> string) into its
# `runtime_env` (the replica's process starts with them: e.g. `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, read when
# CUDA initialises, docs/operations.md); the rest are `@serve.deployment` kwargs.
ACTOR_OPTION_KEYS = frozenset({"num_cpus", "num_gpus", "memory", "resources"})
ENV_OPTION_KEY = "env_vars"
DEPLOYMENT_OPTION_KEYS = frozenset({
    "num_replicas", "max_ongoing_requests", "max_queued_requests", "autoscaling_config",
    "health_check_period_s", "health_check_timeout_s", "graceful_shutdown_timeout_s",
    "graceful_shutdown_wait_loop_s",
})

DEFAULT_LLM_OPTIONS: dict[str, Any] = {"num_cpus": 0.5, "num_gpus": 0, "max_ongoing_requests": 256}
DEFAULT_VOCODER_OPTIONS: dict[str, Any] = {"num_cpus": 0.5, "num_gpus": 0, "max_ongoing_requests": 256}
DEFAULT_INGRESS_OPTIONS: dict[str, Any] = {"num_cpus": 0.25, "max_ongoing_requests": 512}
DEFAULT_OPTIONS = {"llm_options": DEFAULT_LLM_OPTIONS, "vocoder_options": DEFAULT_VOCODER_OPTIONS,
                   "ingress_options": DEFAULT_INGRESS_OPTIONS}


def _check_options(value: dict[str, Any]) -> dict[str, Any]:
    allowed = ACTOR_OPTION_KEYS | DEPLOYMENT_OPTION_KEYS | {ENV_OPTION_KEY}
    unknown = set(value) - allowed
    if unknown:
        raise ValueError(f"unknown deployment option(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    for key in ("num_cpus", "num_gpus"):
        amount = value.get(key, 0)
        if not isinstance(amount, int | float) or isinstance(amount, bool) or not 0 <= amount < math.inf:
            raise ValueError(f"{key} must be a finite number >= 0, got {amount!r}")
    resources = value.get("resources", {})
    if not isinstance(resources, dict) or not all(
            isinstance(k, str) and k and k not in ("CPU", "GPU", "memory") and isinstance(v, int | float)
            and not isinstance(v, bool) and v > 0 for k, v in resources.items()):
        raise ValueError(f"resources must map custom resource names (not CPU, GPU or memory) to amounts > 0, "
                         f"got {resources!r}")
    env = value.get(ENV_OPTION_KEY, {})
    if not isinstance(env, dict) or not all(
            isinstance(k, str) and k and "=" not in k and isinstance(v, str) for k, v in env.items()):
        raise ValueError(f"env_vars must map variable names to strings (quote numbers in YAML), got {env!r}")
    return value


class AppArgs(BaseModel):
    """Everything `build_app` needs; `serve run config/serve.yaml` fills it from the YAML `args:`."""

    # strict: no bool for an int (True was 1), no "16" for a number, no float for an int; no NaN or infinity
    # (an infinite codes_batch_s never sent a chunk after the first two, an infinite retry_after_s made every
    # 503 a 500)
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    # Passed as keyword arguments to runtime.engine.EngineConfig (model, device, dtype, block_size,
    # kv_cache_bytes, max_num_running, max_num_waiting, max_model_len, ...).
    engine: dict[str, Any] = Field(default_factory=lambda: {"model": "tiny", "device": "cpu"})
    # Name used in responses; a request's `model` field must be this name (else a 404 model_not_found).
    served_model_name: str = "moss-speech"
    vocoder_preset: Literal["tiny", "full"] = "tiny"
    vocoder_device: str = "cpu"
    vocoder_dtype: Literal["bfloat16", "float16", "float32"] | None = None
    vocoder_seed: int = 0
    # Speech input (chat `input_audio` parts): the codec's encoder, run on the vocoder replica's device and
    # dtype. "tiny" / "full": random weights from vocoder_seed (noise codes; every path exercised); else a
    # Whisper-VQ checkpoint folder, config.json + model*.safetensors (vocoder/speech_encoder.py); "none": no
    # encoder is built and speech input is a 400 (a card with no room for it: config/serve-4090.yaml).
    speech_encoder: str = Field(default="tiny", min_length=1)
    # Replay CUDA graphs of the vocoder's per-chunk stages (StreamingVocoder.use_cuda_graphs); cuda only.
    vocoder_cuda_graphs: bool = False
    # Pad vocoder steps to bucketed rows / codes / windows (StreamingVocoder.use_cuda_graphs(bucket_shapes)),
    # so the set of graphs to capture is bounded and a warm-up can capture it before traffic.
    vocoder_bucket_shapes: bool = False
    # Row counts whose steps StreamingVocoder.warm_up captures when the replica starts (cuda graphs on);
    # with bucket_shapes give row buckets (vocoder.streaming.ROW_BUCKETS). Empty: no warm-up.
    vocoder_warmup_rows: list[int] = Field(default_factory=list)
    # false: shapes the warm-up did not capture run eagerly instead of being captured under traffic
    # (StreamingVocoder.freeze_graphs), so the graphs' memory is fixed once the replica is up: for a replica
    # under vocoder_memory_cap_bytes, where a capture at run time could fail. Needs vocoder_warmup_rows.
    vocoder_graphs_after_warmup: bool = True
    # With vocoder_graphs_after_warmup false: row counts whose steps a second warm-up runs eagerly after the
    # freeze, so that under traffic the first eager step of each shape does not wait for its kernels to
    # compile and tune (vocoder.streaming.build_for_serving). Empty: none.
    vocoder_eager_warmup_rows: list[int] = Field(default_factory=list)
    # Open sessions whose flow state is allocated at start (StreamingVocoder.reserve_sessions; ~0.66 MB
    # each for `full` in bf16). Past it the state pool doubles, which drops the captured flow graphs.
    vocoder_reserved_sessions: int = Field(default=0, ge=0)
    # Chunk sizes (codes) of a stream's low-latency chunks, the last repeating (vocoder StreamConfig);
    # None: the preset's (2, 3, 5, 10, 25). A bigger first chunk costs first-audio time and buys the
    # listener more buffered audio before the second chunk is due (docs/vocoder.md, Chunk schedule).
    vocoder_chunk_schedule_codes: list[int] | None = None
    # A second schedule for streams that open while the vocoder replica has at most
    # `vocoder_light_load_max_sessions` open streams (the new one included), e.g. a smaller first chunk for
    # an earlier first audio when nothing else competes (vocoder StreamConfig, docs/vocoder.md). None: off.
    vocoder_light_load_schedule_codes: list[int] | None = None
    vocoder_light_load_max_sessions: int = Field(default=1, ge=1)
    # The vocoder's Triton kernels (fused BigVGAN activation, chunk attention; vocoder/kernels/).
    # None: on wherever CUDA and Triton are present; false forces the bigvgan package's modules and SDPA.
    vocoder_triton_kernels: bool | None = None
    # CUDA only: the most device memory the vocoder replica's PyTorch allocator may hold, set before it builds
    # anything (runtime/device_memory.py; the LLM's is `engine.memory_cap_bytes`). For a card both share.
    vocoder_memory_cap_bytes: int | None = Field(default=None, ge=1)
    # Multiply each distinct matrix of the vocoder's flow at a few row counts and compare with float32 before
    # the replica serves; a wrong product stops it (runtime/matmul_check.py, as the engine's
    # `check_matmuls`). None: on CUDA only.
    vocoder_check_matmuls: bool | None = None
    # Most streams the vocoder deployment advances in one `StreamingVocoder.step` call.
    vocoder_max_batch_size: int = Field(default=32, ge=1, le=1024)
    # Vocoder scheduling (deployments/batcher.py). "deadline": one chunk per stream per step, newcomers
    # first, then the least buffered listeners, each joining while rows x the largest chunk's codes stays
    # within `vocoder_step_code_budget`; streams end inside those steps. A step whose first stream has less
    # than `vocoder_urgent_buffer_s` of audio buffered is reported as "urgent". "fifo": the earlier rule
    # (every stream with codes pending in one step), kept for A/B runs.
    vocoder_batching: Literal["deadline", "fifo"] = "deadline"
    vocoder_step_code_budget: int = Field(default=256, ge=1)
    # The budget of a step while some listener has less than `vocoder_urgent_buffer_s` buffered (None: the
    # same); larger steps move more audio per GPU second when streams run behind.
    vocoder_urgent_step_code_budget: int | None = Field(default=None, ge=1)
    vocoder_urgent_buffer_s: float = Field(default=0.5, ge=0)
    # A fast lane ("deadline" only; deployments/batcher.py): a second worker thread and CUDA stream that
    # open sessions and step newcomers and urgent listeners in steps of at most this many padded code rows
    # while the main step runs, instead of after it. None: one lane.
    vocoder_fast_lane_code_budget: int | None = Field(default=None, ge=1)
    # With the fast lane: the main lane starts no background step (every listener in it has at least
    # `vocoder_urgent_buffer_s` buffered) while a newcomer's first chunk is computed ("first_chunk"), or
    # also while a newcomer waits for its first chunk's codes, for at most `vocoder_yield_max_s` from its
    # session's opening ("newcomer"; deployments/batcher.py).
    vocoder_background_yield: Literal["off", "first_chunk", "newcomer"] = "off"
    vocoder_yield_max_s: float = Field(default=0.3, gt=0)
    # Replica health (docs/operations.md): a vocoder call (one batched step, a finish, an open) running longer
    # than this fails the replica's health check until it returns, so Serve replaces a replica whose kernel
    # hung. Steps take milliseconds; the warm-up runs before serving, outside the batcher.
    vocoder_call_timeout_s: float = Field(default=60.0, gt=0)
    # LLM -> vocoder transport: the codes of a stream's first two chunks leave the LLM deployment at once,
    # later codes in batches at most every `codes_batch_s` (each batch is one Ray streaming item, which
    # costs ~0.2-1 ms of CPU: one item per decode step per stream saturates a replica at a few thousand
    # per second). 0: one item per engine step.
    codes_batch_s: float = Field(default=0.04, ge=0)

    # Request limits enforced by the ingress before any model is touched.
    max_input_chars: int = Field(default=4096, ge=1)
    # Speech input: the seconds of audio one request may carry in all (12.5 prompt rows per second), and the
    # largest request body (base64 audio is 4/3 of the file: 8 MiB holds 196 s of 16 kHz PCM16 mono WAV).
    max_input_audio_s: float = Field(default=120.0, gt=0)
    max_body_bytes: int = Field(default=8 << 20, ge=1024)
    max_new_tokens_limit: int = Field(default=4096, ge=1)
    default_max_new_tokens: int = Field(default=1024, ge=1)
    # Server-side timeouts: no request lives longer than request_timeout_s, and a stream that yields
    # nothing for stream_idle_timeout_s is aborted.
    request_timeout_s: float = Field(default=600.0, gt=0)
    stream_idle_timeout_s: float = Field(default=60.0, gt=0)
    # Seconds suggested in Retry-After when Serve itself rejects a request (queue full).
    retry_after_s: float = Field(default=1.0, gt=0)
    # Fail fast at build time when GPUs are requested but the cluster has none (a GPU request on a
    # GPU-less cluster otherwise hangs in DEPLOYING). Turn off only for clusters that add GPU nodes
    # on demand (KubeRay autoscaler).
    require_gpus_at_start: bool = True

    llm_options: dict[str, Any] = Field(default_factory=lambda: dict(DEFAULT_LLM_OPTIONS))
    vocoder_options: dict[str, Any] = Field(default_factory=lambda: dict(DEFAULT_VOCODER_OPTIONS))
    ingress_options: dict[str, Any] = Field(default_factory=lambda: dict(DEFAULT_INGRESS_OPTIONS))

    @field_validator("llm_options", "vocoder_options", "ingress_options")
    @classmethod
    def _validate_options(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        # the options given replace the defaults one by one, not as a whole: `llm_options: {env_vars: ...}`
        # alone would otherwise drop max_ongoing_requests to Serve's 5
        return {**DEFAULT_OPTIONS[info.field_name], **_check_options(value)}

    @field_validator("vocoder_device", "engine")
    @classmethod
    def _validate_device(cls, value: Any, info: ValidationInfo) -> Any:
        from runtime.device_memory import check_device

        if info.field_name == "engine":
            check_device(value.get("device", "cpu"), "engine.device")
        else:
            check_device(value, info.field_name)
        return value

    @field_validator("vocoder_warmup_rows", "vocoder_eager_warmup_rows")
    @classmethod
    def _validate_warmup_rows(cls, value: list[int], info: ValidationInfo) -> list[int]:
        if any(r < 1 for r in value):
            raise ValueError(f"{info.field_name} must all be >= 1, got {value}")
        return value

    @model_validator(mode="after")
    def _check_vocoder_graph_options(self) -> AppArgs:
        if (self.vocoder_bucket_shapes or self.vocoder_warmup_rows) and not self.vocoder_cuda_graphs:
            raise ValueError("vocoder_bucket_shapes and vocoder_warmup_rows need vocoder_cuda_graphs: true")
        if not self.vocoder_graphs_after_warmup and not self.vocoder_warmup_rows:
            raise ValueError("vocoder_graphs_after_warmup: false needs vocoder_warmup_rows")
        if self.vocoder_eager_warmup_rows and self.vocoder_graphs_after_warmup:
            raise ValueError("vocoder_eager_warmup_rows needs vocoder_graphs_after_warmup: false")
        largest = self.vocoder_max_batch_size
        if self.vocoder_bucket_shapes:  # every step is padded to its row bucket
            from vocoder.streaming import row_bucket
            largest = row_bucket(largest)
        for name in ("vocoder_warmup_rows", "vocoder_eager_warmup_rows"):
            if unused := [r for r in getattr(self, name) if r > largest]:
                raise ValueError(f"{name} {unused}: no vocoder step has more than {largest} rows "
                                 f"(vocoder_max_batch_size {self.vocoder_max_batch_size}), so none would use them")
        if self.vocoder_fast_lane_code_budget is not None and self.vocoder_batching != "deadline":
            raise ValueError("vocoder_fast_lane_code_budget needs vocoder_batching: deadline")
        if self.vocoder_memory_cap_bytes is not None and not self.vocoder_device.startswith("cuda"):
            raise ValueError(f"vocoder_memory_cap_bytes needs vocoder_device cuda, got {self.vocoder_device!r}")
        if self.vocoder_background_yield != "off" and self.vocoder_fast_lane_code_budget is None:
            raise ValueError("vocoder_background_yield needs vocoder_fast_lane_code_budget")
        if self.default_max_new_tokens > self.max_new_tokens_limit:
            raise ValueError(f"default_max_new_tokens ({self.default_max_new_tokens}) must not exceed "
                             f"max_new_tokens_limit ({self.max_new_tokens_limit})")
        from vocoder.config import VocoderConfig

        # the vocoder replica builds this config: a schedule it refuses (a 1-code chunk is shorter than the
        # crossfade) fails here, at build time
        try:
            VocoderConfig.preset(self.vocoder_preset).with_schedules(
                self.vocoder_chunk_schedule_codes, self.vocoder_light_load_schedule_codes,
                self.vocoder_light_load_max_sessions)
        except ValueError as exc:  # its messages start with the stream field's name
            raise ValueError(f"vocoder_{exc}") from None
        if self.codes_batch_s >= self.stream_idle_timeout_s:
            raise ValueError(f"codes_batch_s ({self.codes_batch_s}) must be below stream_idle_timeout_s "
                             f"({self.stream_idle_timeout_s}): a stream's codes may wait that long between batches")
        urgent = self.vocoder_urgent_step_code_budget
        if urgent is not None and urgent < self.vocoder_step_code_budget:
            raise ValueError(f"vocoder_urgent_step_code_budget ({urgent}) must be at least "
                             f"vocoder_step_code_budget ({self.vocoder_step_code_budget})")
        return self

    @field_validator("engine")
    @classmethod
    def _validate_engine(cls, value: dict[str, Any]) -> dict[str, Any]:
        if "model" not in value:
            raise ValueError("engine.model is required (a preset name such as 'tiny' or a checkpoint dir)")
        from runtime.engine import EngineConfig

        try:  # the replica builds EngineConfig(**engine): a wrong key or value fails here, at build time
            EngineConfig(**value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"engine: {exc}".replace("EngineConfig.__init__() ", "")) from None
        return value

    @property
    def speech_input(self) -> bool:
        """Whether the app takes speech input (an encoder is configured)."""
        return self.speech_encoder != "none"


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split user options into (`@serve.deployment` kwargs, `ray_actor_options`)."""
    actor = {k: v for k, v in options.items() if k in ACTOR_OPTION_KEYS and v is not None}
    if options.get(ENV_OPTION_KEY):
        actor["runtime_env"] = {"env_vars": dict(options[ENV_OPTION_KEY])}
    deployment = {k: v for k, v in options.items() if k in DEPLOYMENT_OPTION_KEYS}
    if "num_cpus" not in actor:
        # Every replica asks for a whole CPU unless told otherwise; on a 2-core machine three
        # deployments then never all schedule (see docs/serving.md).
        actor["num_cpus"] = 0.25
    if actor.get("num_gpus") == 0:
        del actor["num_gpus"]
    return deployment, actor
