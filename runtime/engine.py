"""The LLM engine: `EngineCore` runs synchronous steps; `Engine` streams them to asyncio callers.

`EngineCore.step()` = expire queued requests, schedule, run the model, record the results and
turn the new rows into events. `Engine` runs that loop on one dedicated thread, so forwards never
block the event loop, and hands each request's events to its own asyncio queue with
`loop.call_soon_threadsafe`. The life of a request is told in docs/engine.md.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace

import torch
from torch import nn

from runtime.block_manager import BlockManager
from runtime.config import CODES_PER_SECOND, MODALITY_PAD_ID, ModelConfig, Row, check_field_types
from runtime.device_memory import cap_device_memory, capped_free_bytes, check_device, indexed_cuda_device
from runtime.errors import EngineError, EngineUnhealthyError, InvalidRequestError, is_device_error
from runtime.fp8 import Weight
from runtime.fused import FusedWeights
from runtime.kv_cache import allocate_kv_cache, kv_bytes_per_block, kv_storage_dtype, num_blocks_for_budget
from runtime.matmul_check import ProductCheck, distinct_matrices, verify_products
from runtime.model import MossSpeechForCausalLM, build_model, split_rows
from runtime.model_runner import ModelInput, ModelRunner, RowFeed
from runtime.request import (
    TIMELINE_CODES,
    AudioCodes,
    Event,
    Finished,
    GenerationRequest,
    TextDelta,
    Timeline,
    validate_request,
)
from runtime.sampling import LaunchedRows, RequestSampler
from runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from runtime.sequence import PENDING_ROW, IncrementalDetokenizer, Sequence
from runtime.tokenizer import Tokenizer
from runtime.transfer import to_device

logger = logging.getLogger(__name__)
# What a request that ends on logits without a valid draw (NaN or infinite) is told.
BROKEN_LOGITS_MESSAGE = "the model produced non-finite logits (NaN or inf) for this request"

DEFAULT_CPU_KV_CACHE_BYTES = 256 * 2**20  # CPU has no "free device memory" to take a fraction of
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PRESETS = ("tiny", "full")  # random weights + the byte-level tokenizer; anything else is a folder


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an engine; see docs/contracts.md and docs/engine.md."""

    model: str = "tiny"  # preset name ("tiny", "full": random weights) or checkpoint folder
    device: str = "cpu"
    dtype: str | None = None  # float32 on cpu, bfloat16 on cuda
    block_size: int = 16
    kv_cache_bytes: int | None = None  # wins over the fraction when given
    kv_cache_memory_fraction: float = 0.5  # of the device memory free after loading the weights (or left under the cap)
    max_num_running: int = 64
    max_num_waiting: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    debug_checks: bool = False
    weights_seed: int = 0
    queue_timeout_s: float = 300.0  # a request waiting longer ends with Finished("error")
    fast_path: bool = False  # fused weights + fused ops; decode steps in CUDA graphs on CUDA
    fp8_scope: str | None = None  # fast path only: FP8 weights for "shared" | "layers" | "all" (docs/gpu.md)
    # "auto": the KV cache in `dtype`; "fp8": e4m3 codes with a scale per (position, KV head), half the bytes
    # of bf16 per token (runtime/kv_cache.py, docs/engine.md)
    kv_cache_dtype: str = "auto"
    # fast path only: decode steps with no row in text mode skip the text head (ModelRunner, docs/gpu.md)
    audio_only_steps: bool = True
    # Asynchronous steps: launch step n+1 (its new rows' inputs fed on the device from step n's sampler)
    # before reading step n's ids, so the host's work overlaps the GPU's; None: on CUDA only. docs/engine.md.
    async_scheduling: bool | None = None
    # Real-time pacing: seconds of audio a stream may run ahead of real time (None: as fast as possible).
    # See SchedulerConfig.pacing_lead_codes and docs/engine.md.
    pacing_lead_s: float | None = None
    # First-audio hold: see SchedulerConfig.first_audio_hold_* and docs/engine.md (None: off).
    first_audio_hold_codes: int | None = None
    first_audio_hold_s: float = 0.025
    first_audio_hold_max_running: int = 1
    # Multiply each distinct matrix of the model at a few row counts and compare with float32 before serving;
    # a wrong product stops the engine (runtime/matmul_check.py). None: on CUDA only.
    check_matmuls: bool | None = None
    # Health (`Engine.check_health`, which Serve's replica health check calls): the engine stops taking requests
    # and reports itself unhealthy after this many failed steps in a row, after one step failed with a device
    # error (a CUDA error poisons the process's context: every later step would fail too), or while one step
    # has run longer than step_timeout_s (a hung kernel); Serve then replaces the replica.
    max_consecutive_step_failures: int = 3
    step_timeout_s: float = 60.0
    # Run the largest step the scheduler can form off the CUDA graphs (max_num_batched_tokens rows over up to
    # max_num_running sequences, all sampling) once before serving: its activations then sit reserved under
    # the memory cap, or the engine fails to start with EngineMemoryError naming the settings, instead of a
    # burst of prompts failing every in-flight request mid-serving. None: on CUDA only.
    check_largest_step: bool | None = None
    # Run eager steps of a fixed set of shapes once before serving (`warm_step_shapes`): Triton compiles a
    # kernel again for each new specialisation of its integer arguments (1, a multiple of 16, any other), so
    # the first mixed step of a new kind under traffic would otherwise stall every stream for the compile.
    # None: on CUDA with the fast path only.
    warm_step_shapes: bool | None = None
    # Fast path on CUDA: row buckets of the one-sequence prefill graphs (None: runtime.cuda_graph's
    # DEFAULT_PREFILL_BUCKETS). A chunk runs padded to the smallest bucket that holds it; longer ones run eagerly.
    prefill_buckets: tuple[int, ...] | None = None
    # CUDA only: the most device memory this process's PyTorch allocator may hold, set before the weights load
    # (runtime/device_memory.py; for a card shared with the vocoder). None: no cap.
    memory_cap_bytes: int | None = None

    def __post_init__(self) -> None:
        check_field_types(self)
        device_type = check_device(self.device, "device")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or None, got {self.dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if not 0 < self.kv_cache_memory_fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if self.memory_cap_bytes is not None:
            if self.memory_cap_bytes < 1:
                raise ValueError(f"memory_cap_bytes must be >= 1 or None, got {self.memory_cap_bytes}")
            if device_type != "cuda":
                raise ValueError(f"memory_cap_bytes needs a CUDA device, got device {self.device!r}")
        kv_storage_dtype(self.kv_cache_dtype, torch.float32)  # validates it
        if self.max_consecutive_step_failures < 1:
            raise ValueError(f"max_consecutive_step_failures must be >= 1, got {self.max_consecutive_step_failures}")
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0, got {self.step_timeout_s}")
        if self.pacing_lead_s is not None and not self.pacing_lead_s > 0:
            raise ValueError(f"pacing_lead_s must be > 0 or None, got {self.pacing_lead_s}")
        if self.fp8_scope is not None:
            from runtime.fused import FP8_SCOPES

            if self.fp8_scope not in FP8_SCOPES:
                raise ValueError(f"fp8_scope must be one of {FP8_SCOPES} or None, got {self.fp8_scope!r}")
            if not self.fast_path:
                raise ValueError("fp8_scope needs fast_path=True (the plain model has no FP8 path)")
        if self.prefill_buckets is not None:
            buckets = tuple(self.prefill_buckets)  # YAML and JSON give lists
            if not buckets or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in buckets):
                raise ValueError(f"prefill_buckets must be positive row counts or None, got {self.prefill_buckets!r}")
            object.__setattr__(self, "prefill_buckets", tuple(sorted(set(buckets))))
        self.scheduler_config()  # validates the scheduler limits

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of the weights and activations (and of the KV cache unless `kv_cache_dtype` says FP8)."""
        if self.dtype is not None:
            return _DTYPES[self.dtype]
        return torch.bfloat16 if torch.device(self.device).type == "cuda" else torch.float32

    @property
    def kv_dtype(self) -> torch.dtype:
        """The element type of the KV cache."""
        return kv_storage_dtype(self.kv_cache_dtype, self.torch_dtype)

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's share of this config."""
        return SchedulerConfig(
            max_num_running=self.max_num_running, max_num_waiting=self.max_num_waiting,
            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
            queue_timeout_s=self.queue_timeout_s,
            pacing_lead_codes=None if self.pacing_lead_s is None else math.ceil(self.pacing_lead_s * CODES_PER_SECOND),
            first_audio_hold_codes=self.first_audio_hold_codes, first_audio_hold_s=self.first_audio_hold_s,
            first_audio_hold_max_running=self.first_audio_hold_max_running,
        )


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for autoscaling and metrics; prefix-cache figures are token counts."""

    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_used: int
    num_blocks_free: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int = 0
    num_step_failures: int = 0  # steps that raised (each failed every request in flight), lifetime
    # requests the engine holds any state for (sequence, detokenizer, output stream): 0 when idle, so a
    # request that ended without giving everything back shows here
    num_tracked_requests: int = 0


@dataclass(frozen=True)
class StepRecord:
    """Where one engine step's wall time went (host clock, seconds).

    `forward_s` is the time to launch the forward pass (a graph replay returns at once);
    `sample_s` includes waiting for the GPU to finish it, since sampling reads the ids back. With
    asynchronous steps a record is the step launched, and `sample_s` is the wait for the previous step's
    ids, reading them and launching this step's sampling: the phases add up to the loop's period.
    """

    path: str  # the model runner's path: "graph", "prefill_graph", "fast" or "plain"
    num_seqs: int
    num_rows: int
    num_decode_seqs: int
    schedule_s: float
    prepare_s: float
    forward_s: float
    sample_s: float
    record_s: float

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.forward_s + self.sample_s + self.record_s


STEP_LOG_LEN = 4096  # steps kept in `EngineCore.step_log`


@dataclass
class _Launched:
    """An asynchronous step scheduled and prepared (`EngineCore.schedule_step`), then launched (`launch`)."""

    out: SchedulerOutput
    inp: ModelInput
    logits: tuple[torch.Tensor | None, torch.Tensor] | None  # set by `EngineCore.launch`
    feed: RowFeed | None
    timing: list[float]  # schedule_s, prepare_s, then forward_s once launched
    started: float  # perf_counter at its scheduling


@dataclass
class _InFlight:
    """An asynchronous step whose rows are sampled on the device and not read yet."""

    seqs: list[Sequence]  # the sequences sampled, in the order of `rows`
    rows: LaunchedRows
    index: dict[str, int]  # request id -> position in `seqs`


def _charge_step(out: SchedulerOutput, step_s: float) -> None:
    """Add a step's wall time to each of its sequences' prefill or decode time."""
    for chunk in out.chunks:
        if chunk.is_decode:
            chunk.seq.decode_s += step_s
            chunk.seq.num_decode_steps += 1
        else:
            chunk.seq.prefill_s += step_s


def default_seed(request_id: str) -> int:
    """Seed of a request that gives none: the first 8 bytes of sha256(request_id)."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "little")


class EngineMemoryError(EngineError, RuntimeError):
    """The settings' largest step does not fit in the device memory left after the weights, the KV cache
    and the CUDA graphs (raised at start-up by `run_largest_step`)."""


@dataclass(frozen=True)
class LargestStep:
    """The start-up run of the largest step (`run_largest_step`)."""

    num_rows: int
    num_seqs: int
    # CUDA: what the allocator holds beyond live tensors once it ran (room kept for steps' activations)
    free_reserved_bytes: int | None


def _step_memory_error(step: str, remedies: str, exc: BaseException) -> EngineMemoryError:
    """A start-up step out of device memory, with what to change: `remedies` after the step budget's."""
    return EngineMemoryError(f"{step} does not fit in device memory next to the weights, KV cache and CUDA graphs: "
                             f"lower max_num_batched_tokens or kv_cache_bytes, {remedies} ({exc})")


def run_largest_step(runner: ModelRunner, config: EngineConfig) -> LargestStep | None:
    """`ModelRunner.run_largest_step` for these settings -> what ran (None: a budget under 2 rows has no
    multi-sequence step). Out of device memory -> EngineMemoryError with the remedies."""
    # no sequence longer than max_model_len: a budget above max_num_running x max_model_len is never filled
    rows = min(config.max_num_batched_tokens, config.max_num_running * config.max_model_len)
    seqs = min(config.max_num_running, rows // 2)
    if seqs < 1:
        return None
    device = runner.device
    try:
        runner.run_largest_step(rows, seqs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except torch.OutOfMemoryError as exc:
        raise _step_memory_error(
            f"the largest step these settings allow ({rows} rows, max_num_batched_tokens, over {seqs} sequences)",
            "or raise memory_cap_bytes", exc) from None
    free = None
    if device.type == "cuda":
        free = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        logger.info("largest step (%d rows over %d sequences) ran; %.2f GiB reserved for steps", rows, seqs,
                    free / 2**30)
    return LargestStep(rows, seqs, free)


def step_shapes(config: EngineConfig, max_graph_batch: int | None) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The eager step shapes `warm_step_shapes` runs, as (query lengths, context lengths), within the settings.

    Eager steps (the ones off the CUDA graphs: several sequences with a prompt row among them, or more decode
    rows than the largest graph) have any number of rows M and sequences S. Their Triton kernels are
    compiled once per specialisation of such integers (equal to 1, a multiple of 16, anything else) and, for
    FP8 weights, per product path (2-4, 5-16, 17-32, 33-64 and more rows: runtime/fp8.py). These shapes give
    every path both specialisations of M that a step can have, S of 2-32, and prompt rows with and without
    cached context (decode rows have 16 tokens of context): a newcomer's prompt beside running streams
    (1 + 23, 1 + 63, 3 + 197 rows), a burst of spoken questions behind a cached prefix (8 x 5 rows after 80)."""
    d = 16  # context of a decode row
    shapes = [
        ((1, 2), (d, 0)),  # M 3
        ((1, 1, 4), (d, d, 0)),  # M 6
        ((1,) * 14 + (2,), (d,) * 14 + (0,)),  # M 16
        ((1, 23), (d, 0)),  # M 24
        ((1,) * 15 + (17,), (d,) * 15 + (0,)),  # M 32, S 16
        ((5,) * 8, (80,) * 8),  # M 40
        ((1, 63), (d, 40)),  # M 64
        ((1,) * 31 + (33,), (d,) * 31 + (0,)),  # M 64, S 32
        ((1, 1, 1, 197), (d, d, d, 100)),  # M 200
        ((1,) * 15 + (241,), (d,) * 15 + (0,)),  # M 256, S 16
    ]
    if max_graph_batch is not None:  # decode steps of more rows than the largest graph (M odd, M a multiple of 16)
        for rows in sorted({max_graph_batch + 1, -(-(max_graph_batch + 1) // 16) * 16}):
            shapes.append(((1,) * rows, (d,) * rows))
    return [(q, c) for q, c in shapes
            if len(q) <= config.max_num_running and sum(q) <= config.max_num_batched_tokens
            and max(a + b for a, b in zip(q, c, strict=True)) <= config.max_model_len]


def warm_step_shapes(runner: ModelRunner, config: EngineConfig) -> list[tuple[tuple[int, ...], tuple[int, ...], str]]:
    """Run each of `step_shapes` once (`ModelRunner.run_step_shape`) -> (query lens, context lens, path).
    Out of device memory -> EngineMemoryError with the remedies."""
    started = time.perf_counter()
    ran = []
    graphs = runner.graphs
    for query_lens, context_lens in step_shapes(config, None if graphs is None else graphs.max_batch):
        try:
            ran.append((query_lens, context_lens, runner.run_step_shape(query_lens, context_lens)))
        except torch.OutOfMemoryError as exc:
            raise _step_memory_error(
                f"the start-up step of {sum(query_lens)} rows over {len(query_lens)} sequences (warm_step_shapes)",
                "raise memory_cap_bytes, or set warm_step_shapes false", exc) from None
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    logger.info("%d eager step shapes warmed in %.2f s", len(ran), time.perf_counter() - started)
    return ran


def num_kv_blocks(config: EngineConfig, model_config: ModelConfig) -> int:
    """KV pool size from `kv_cache_bytes`, else a fraction of free device memory (a fixed budget on CPU)."""
    device = torch.device(config.device)
    if config.kv_cache_bytes is not None:
        budget = config.kv_cache_bytes
    elif device.type == "cuda":
        budget = int(capped_free_bytes(device, config.memory_cap_bytes) * config.kv_cache_memory_fraction)
    else:
        budget = DEFAULT_CPU_KV_CACHE_BYTES
    num_blocks = num_blocks_for_budget(model_config, config.block_size, config.kv_dtype, budget)
    if num_blocks < 1:
        per_block = kv_bytes_per_block(model_config, config.block_size, config.kv_dtype)
        raise ValueError(f"KV cache budget of {budget} bytes holds no block (one block takes {per_block} bytes)")
    # More blocks than every running sequence at full length can use would only waste memory.
    useful = config.max_num_running * -(-config.max_model_len // config.block_size)
    return min(num_blocks, useful)


def _model_matrices(model: MossSpeechForCausalLM, weights: FusedWeights | None) -> dict[str, Weight]:
    """One matrix per distinct product the model's steps run: the fused ones on the fast path, else the
    plain model's linear layers."""
    if weights is None:
        return distinct_matrices((name, m.weight) for name, m in model.named_modules() if isinstance(m, nn.Linear))
    layers = [(f"{kind}.{i}.{name}", w) for kind, group in (("shared", weights.shared), ("text", weights.text),
                                                             ("audio", weights.audio))
              for i, layer in enumerate(group) for name, w in layer.matrices().items()]
    return distinct_matrices([*layers, ("text_head", weights.text_head), ("audio_head", weights.audio_head)])


def load_model(config: EngineConfig) -> tuple[MossSpeechForCausalLM, Tokenizer]:
    """A preset with random weights (deterministic in `weights_seed`, byte-level tokenizer) or a checkpoint;
    `memory_cap_bytes` is set first.

    FP8 on a GPU: the bf16 model (a checkpoint, or a preset's weights drawn on the GPU) waits in host memory
    and each matrix goes to the device only to be quantized (EngineCore), so the device never holds the
    whole bf16 model and the load peaks near the serving footprint. A bf16 checkpoint waits as views of its
    files' mappings (page cache), so the host's own memory does not hold it either."""
    cap_device_memory(config.device, config.memory_cap_bytes)
    if config.model in _PRESETS:
        model = build_model(
            ModelConfig.preset(config.model), seed=config.weights_seed, device=config.device,
            dtype=config.torch_dtype, debug_checks=config.debug_checks, on_host=_stages_fp8(config),
        )
        return model, Tokenizer.tiny()
    from runtime.weights import load_pretrained

    staged = _stages_fp8(config)
    return load_pretrained(config.model, device="cpu" if staged else config.device, dtype=config.torch_dtype,
                           debug_checks=config.debug_checks, mapped=staged)


def _stages_fp8(config: EngineConfig) -> bool:
    """Whether a checkpoint is loaded into host memory and quantized onto the device layer by layer."""
    return config.fp8_scope is not None and config.fast_path and torch.device(config.device).type == "cuda"


class EngineCore:
    """Synchronous engine: owns scheduler, block manager, model runner and per-request output state."""

    def __init__(self, model: MossSpeechForCausalLM, tokenizer: Tokenizer, config: EngineConfig) -> None:
        model_config = model.config
        if config.max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({config.max_model_len}) exceeds the model's max_position_embeddings "
                f"({model_config.max_position_embeddings})"
            )
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        device = next(model.parameters()).device
        weights = None
        if config.fast_path:  # before sizing the KV pool: FP8 frees the bf16 matrices
            from runtime.fused import fuse_model_weights, quantize_model_in_place

            staged = None  # a checkpoint held on the host for FP8 (load_model): quantized onto the GPU
            if _stages_fp8(config) and device.type == "cpu":
                device = staged = indexed_cuda_device(config.device)
            weights = (quantize_model_in_place(model, config.fp8_scope, staged)
                       if config.fp8_scope is not None else fuse_model_weights(model))
        self.matmul_checks: list[ProductCheck] = []  # the start-up check's products (empty: it did not run)
        if config.check_matmuls or (config.check_matmuls is None and device.type == "cuda"):
            started = time.perf_counter()
            self.matmul_checks = verify_products(_model_matrices(model, weights), dtype=config.torch_dtype)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # its temporaries must not shrink the KV pool sized from free memory
            logger.info("matrix products checked: %d right in %.2f s, largest relative error %.3g",
                        len(self.matmul_checks), time.perf_counter() - started,
                        max((c.rel_err for c in self.matmul_checks), default=0.0))
        kv_cache = allocate_kv_cache(
            model_config, num_kv_blocks(config, model_config), config.block_size, device, config.kv_dtype
        )
        self.block_manager = BlockManager(kv_cache.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config(), self.block_manager)
        self.runner = ModelRunner(
            model, kv_cache, fast_path=config.fast_path, max_model_len=config.max_model_len,
            max_num_running=config.max_num_running, weights=weights, audio_only_steps=config.audio_only_steps,
            prefill_buckets=config.prefill_buckets, max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.largest_step: LargestStep | None = None  # the start-up run of the largest step (None: not run)
        if config.check_largest_step or (config.check_largest_step is None and device.type == "cuda"):
            self.largest_step = run_largest_step(self.runner, config)
        self.warmed_shapes: list[tuple[tuple[int, ...], tuple[int, ...], str]] = []  # (query, context lens, path)
        if config.warm_step_shapes or (config.warm_step_shapes is None and device.type == "cuda" and config.fast_path):
            self.warmed_shapes = warm_step_shapes(self.runner, config)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._num_arrivals = 0
        self.step_log: deque[StepRecord] = deque(maxlen=STEP_LOG_LEN)  # the latest steps, oldest first
        self._timing: list[float] = []  # the current step's phases so far (see StepRecord)
        self.async_scheduling = (device.type == "cuda" if config.async_scheduling is None
                                 else config.async_scheduling)
        self._in_flight: _InFlight | None = None  # asynchronous steps: the step whose rows are not read yet
        self._undelivered: list[tuple[str, Event]] = []  # events of the current step phase (`_take_events`)
        self.num_broken_logits = 0  # requests ended because their logits had no valid draw (NaN / inf)
        self.num_step_reruns = 0  # asynchronous steps run again (a row switched to text mode, or a redraw)
        self._wait_s = 0.0  # the latest `wait_in_flight`

    @classmethod
    def from_config(cls, config: EngineConfig) -> EngineCore:
        """Build model and tokenizer as `load_model` does."""
        return cls(*load_model(config), config)

    def add_request(self, request: GenerationRequest) -> Sequence:
        """Validate and queue `request`; raises InvalidRequestError / ContextLengthExceededError /
        EngineOverloadedError and then nothing has changed."""
        self._validate(request)
        self.scheduler.check_admissible(request)
        seed = default_seed(request.request_id) if request.seed is None else request.seed
        try:
            sampler = RequestSampler(
                request.prompt_rows, request.text_sampling, request.audio_sampling,
                min_new_tokens=request.min_new_tokens, seed=seed,
            )
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from exc
        seq = Sequence(request, sampler, self._num_arrivals, time.monotonic())
        self._num_arrivals += 1
        self.scheduler.add(seq)
        self._detokenizers[request.request_id] = IncrementalDetokenizer(self.tokenizer)
        return seq

    def abort(self, request_id: str) -> list[tuple[str, Event]]:
        """End a request now (its blocks are free on return); its final events, none if not in flight."""
        seq = self.scheduler.abort(request_id)
        return [] if seq is None else self._finish_events(seq)

    def abort_with_error(self, request_id: str, message: str) -> list[tuple[str, Event]]:
        """End a request with reason "error" and `message` (its blocks are free on return)."""
        seq = self.scheduler.abort(request_id, "error", message)
        return [] if seq is None else self._finish_events(seq)

    def fail_all(self, message: str) -> list[tuple[str, Event]]:
        """End every in-flight request with reason "error" (after an engine failure or at shutdown). First
        come the events a failed step had produced before it failed (`_undelivered`): a request it finished is
        no longer in flight, and those events are its last rows and its `Finished`."""
        events = self._take_events()
        for request_id in list(self.scheduler.seqs):
            events += self.abort_with_error(request_id, message)
        self._in_flight = None
        return events

    @property
    def has_work(self) -> bool:
        """Whether any request is waiting or running (or an asynchronous step's rows are not read yet)."""
        return self.scheduler.has_work or self._in_flight is not None

    def begin_step(self) -> tuple[list[tuple[str, Event]], SchedulerOutput, ModelInput | None]:
        """Expire overdue waiting requests, schedule, and build the model input (None: nothing to run)."""
        start = time.perf_counter()
        out = self._schedule()
        scheduled = time.perf_counter()
        inp = None if out.is_empty else self.runner.prepare(out)
        self._timing = [scheduled - start, time.perf_counter() - scheduled]
        return self._take_events(), out, inp

    def _schedule(self) -> SchedulerOutput:
        """Expire overdue waiting requests (their events to `_undelivered`) and schedule the next step, noting
        each sequence's first scheduled step in its Timeline."""
        for seq in self.scheduler.expire_waiting():
            self._undelivered += self._finish_events(seq)
        out = self.scheduler.schedule()
        for chunk in out.chunks:
            if chunk.seq.first_scheduled_at is None:
                chunk.seq.first_scheduled_at = time.time()
        return out

    def _take_events(self) -> list[tuple[str, Event]]:
        """The events produced since the last call, in order (a step's phases collect theirs here, so that a
        phase failing part-way loses none: `fail_all` hands them out)."""
        events, self._undelivered = self._undelivered, []
        return events

    def run_model(self, inp: ModelInput) -> tuple[dict[str, Row | None], float]:
        """Forward and sample (no core state is touched: callers may run this without their lock)
        -> (sampled rows by request id, seconds)."""
        start = time.perf_counter()
        logits = self.runner.forward(inp)
        launched = time.perf_counter()
        sampled = self.runner.sample(inp, logits)
        done = time.perf_counter()
        self._timing += [launched - start, done - launched]
        return sampled, done - start

    def end_step(
        self, out: SchedulerOutput, sampled: dict[str, Row | None], step_s: float
    ) -> list[tuple[str, Event]]:
        """Record the step's results and return the events they produce, in batch order (a request whose
        row is None, logits without a valid draw, ends with an error first)."""
        start = time.perf_counter()
        _charge_step(out, step_s)
        broken = [request_id for request_id, row in sampled.items() if row is None]
        if broken:  # (rare: the id -> sequence map only then)
            stepped = {chunk.seq.request_id: chunk.seq for chunk in out.chunks}
            for request_id in broken:
                # not a request that was aborted during the step and whose id is in use again
                if self.scheduler.seqs.get(request_id) is stepped[request_id]:
                    self._undelivered += self._fail_broken_logits(request_id, len(sampled))
        for seq, row in self.scheduler.update(out, sampled):
            self._undelivered += self._row_events(seq, row)
        if len(self._timing) == 4:
            self._log_step(out, *self._timing, time.perf_counter() - start)
        self._timing = []
        return self._take_events()

    def step(self) -> list[tuple[str, Event]]:
        """One whole step on the calling thread; returns (request id, event) pairs.

        With `async_scheduling` a step launches the next forward, then reads the rows of the one before
        (so a step's events come out one call later) and launches the sampling of the new one."""
        if self.async_scheduling:
            events, launched = self.schedule_step()
            if launched is not None:
                self.launch(launched)
            self.wait_in_flight()
            return events + self.finish_step(launched)
        events, out, inp = self.begin_step()
        if inp is not None:
            sampled, step_s = self.run_model(inp)
            events += self.end_step(out, sampled, step_s)
        return events

    # ----- asynchronous steps (docs/engine.md, "Asynchronous steps") -----
    @property
    def has_work_in_flight(self) -> bool:
        """Whether an asynchronous step's rows are still to be read."""
        return self._in_flight is not None

    def schedule_step(self) -> tuple[list[tuple[str, Event]], _Launched | None]:
        """Expire, schedule and prepare the next step; the rows still being sampled are fed on the device
        from the step in flight -> (events of expired requests, the step to `launch`, or None)."""
        start = time.perf_counter()
        out = self._schedule()
        if out.is_empty:
            return self._take_events(), None
        scheduled = time.perf_counter()
        inp = self.runner.prepare(out)
        return self._take_events(), _Launched(out, inp, None, self._feed(inp), [scheduled - start, time.perf_counter() - scheduled],
                                 start)

    def launch(self, launched: _Launched) -> None:
        """Launch the scheduled step's forward (no core state is touched: callers may run this without
        their lock; an abort meanwhile only frees blocks, which nothing takes before the next schedule)."""
        start = time.perf_counter()
        launched.logits = self.runner.forward(launched.inp, launched.feed)
        launched.timing.append(time.perf_counter() - start)

    def wait_in_flight(self) -> None:
        """Block until the in-flight step's ids are on the host (no core state is read: callers may run
        this without their lock)."""
        in_flight = self._in_flight
        if in_flight is not None:
            start = time.perf_counter()
            in_flight.rows.wait()
            self._wait_s = time.perf_counter() - start

    def finish_step(self, launched: _Launched | None) -> list[tuple[str, Event]]:
        """Read the in-flight step's rows into their sequences (their events), run `launched` again if
        its inputs or its text head turn out wrong, then launch its sampling and count its rows as
        computed; it is the step in flight then."""
        begin = time.perf_counter()
        if self._in_flight is None:
            self._wait_s = 0.0
        fed_rows: list[Row] = []
        changed = False
        if self._in_flight is not None:
            fed_rows, changed = self._read_in_flight()
            self._in_flight = None
        if launched is None:
            return self._take_events()
        inp = launched.inp
        assert launched.logits is not None, "finish_step before launch"
        stale = launched.feed is not None and changed  # a redraw changed a row the step was fed
        if stale or (launched.logits[0] is None and inp.needs_text_logits):  # a row switched to text mode
            feed = launched.feed
            if stale:
                assert feed is not None
                tokens, is_audio = split_rows(fed_rows)
                device = feed.tokens.device
                feed = RowFeed(to_device(tokens, device), to_device(is_audio, device), feed.dst, feed.src)
            launched.logits = self.runner.forward(inp, feed)
            self.num_step_reruns += 1
        sampling = self.scheduler.advance(launched.out)  # the finished are left out
        position = {rid: i for i, rid in enumerate(inp.sample_request_ids)}
        keep = [position[seq.request_id] for seq in sampling]
        rows = self.runner.launch_sample(inp, launched.logits, keep, next_inputs=True)
        sampled = time.perf_counter()
        for seq in sampling:
            seq.append_row(PENDING_ROW)
        _charge_step(launched.out, time.perf_counter() - launched.started)
        self._in_flight = _InFlight(sampling, rows, {s.request_id: i for i, s in enumerate(sampling)})
        schedule_s, prepare_s, forward_s = launched.timing
        self._log_step(launched.out, schedule_s, prepare_s, forward_s, self._wait_s + sampled - begin,
                       time.perf_counter() - sampled)
        return self._take_events()

    def _feed(self, inp: ModelInput) -> RowFeed | None:
        """Where the in-flight step's sampled rows go in `inp` (None: it holds none of them)."""
        if not inp.pending_rows:
            return None
        in_flight = self._in_flight
        assert in_flight is not None and in_flight.rows.next_tokens is not None and in_flight.rows.next_is_audio is not None
        dst = [i for i, _ in inp.pending_rows]
        src = [in_flight.index[rid] for _, rid in inp.pending_rows]
        tokens, is_audio = in_flight.rows.next_tokens, in_flight.rows.next_is_audio
        if dst == src == list(range(len(in_flight.seqs))):
            return RowFeed(tokens, is_audio)
        device = tokens.device
        return RowFeed(tokens, is_audio, to_device(torch.tensor(dst, dtype=torch.long), device),
                       to_device(torch.tensor(src, dtype=torch.long), device))

    def _read_in_flight(self) -> tuple[list[Row], bool]:
        """Read the in-flight step's rows into their sequences (their events to `_undelivered`) -> (the rows
        in sampling order, whether a redraw changed an id after the rows' inputs were computed on the
        device)."""
        in_flight = self._in_flight
        assert in_flight is not None
        rows, changed = in_flight.rows.complete()
        for seq, row in zip(in_flight.seqs, rows, strict=True):
            if seq.is_finished:  # aborted meanwhile
                continue
            if row is None:  # logits without a valid draw: the request ends here
                self._undelivered += self._fail_broken_logits(seq.request_id, len(rows))
                continue
            assert seq.rows[-1] is PENDING_ROW
            seq.rows[-1] = row
            self.scheduler.accept_row(seq, row)
            self._undelivered += self._row_events(seq, row)
        # a failed request has no row; a placeholder keeps the list aligned with the fed step's rows (that
        # request is finished, so a rerun of the step computes nothing anyone reads for it)
        return [(MODALITY_PAD_ID, 0) if row is None else row for row in rows], changed

    def _fail_broken_logits(self, request_id: str, num_sampled: int) -> list[tuple[str, Event]]:
        """End a request whose logits had no valid draw (NaN or infinite), with reason "error"; the other
        requests of the step go on. Logged, with where the request stood, for finding the values' origin."""
        self.num_broken_logits += 1
        seq = self.scheduler.seqs.get(request_id)
        logger.error(
            "non-finite logits for request %s (%s rows computed, %s generated) in a step sampling %d requests; "
            "ending it with an error", request_id, None if seq is None else seq.num_computed_tokens,
            None if seq is None else seq.num_generated, num_sampled,
        )
        return self.abort_with_error(request_id, BROKEN_LOGITS_MESSAGE)

    def stats(self, held_elsewhere: AbstractSet[str] = frozenset()) -> EngineStats:
        """Queue lengths, block usage and prefix-cache counters. `held_elsewhere`: ids of requests a caller holds
        state for (the async engine's output streams), counted in `num_tracked_requests` with this core's."""
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_blocks_total=bm.num_blocks, num_blocks_used=bm.num_used_blocks, num_blocks_free=bm.num_free_blocks,
            prefix_cache_queries=bm.prefix_cache_queries, prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_tracked_requests=len(self.scheduler.seqs.keys() | self._detokenizers.keys() | held_elsewhere),
        )

    def _log_step(self, out: SchedulerOutput, schedule_s: float, prepare_s: float, forward_s: float,
                  sample_s: float, record_s: float) -> None:
        """Append the step's StepRecord to `step_log`."""
        self.step_log.append(StepRecord(
            path=self.runner.last_path, num_seqs=len(out.chunks), num_rows=out.num_batched_tokens,
            num_decode_seqs=sum(c.is_decode for c in out.chunks), schedule_s=schedule_s, prepare_s=prepare_s,
            forward_s=forward_s, sample_s=sample_s, record_s=record_s))

    def _row_events(self, seq: Sequence, row: Row) -> list[tuple[str, Event]]:
        """The events of a row just accepted: its text, its audio code, the end."""
        rid = seq.request_id
        events: list[tuple[str, Event]] = []
        if row[0] != MODALITY_PAD_ID:
            text = self._detokenizers[rid].push(row[0])
            if text:
                events.append((rid, TextDelta(text)))
        code = seq.sampler.last_output_code
        if code is not None:
            seq.num_codes_sent += 1
            if len(seq.code_times) < TIMELINE_CODES:
                seq.code_times.append(time.time())
            events.append((rid, AudioCodes((code,))))
        if seq.is_finished:
            events += self._finish_events(seq)
        return events

    def _finish_events(self, seq: Sequence) -> list[tuple[str, Event]]:
        """The text still held back (unless aborted), then `Finished`."""
        assert seq.finish_reason is not None
        events: list[tuple[str, Event]] = []
        detokenizer = self._detokenizers.pop(seq.request_id)
        tail = detokenizer.flush()
        if tail and seq.finish_reason != "abort":
            events.append((seq.request_id, TextDelta(tail)))
        finished = Finished(
            reason=seq.finish_reason, num_prompt_tokens=seq.num_prompt_rows, num_generated_tokens=seq.num_generated,
            num_audio_codes=seq.num_codes_sent, num_cached_prompt_tokens=seq.num_cached_tokens,
            error=seq.error, timeline=Timeline(seq.arrived_at, seq.first_scheduled_at, tuple(seq.code_times)),
        )
        events.append((seq.request_id, finished))
        return events

    def _validate(self, request: GenerationRequest) -> None:
        validate_request(request, self.model_config.vocab_size, self.model_config.audio_vocab_size)
        if request.request_id in self.scheduler.seqs:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already in flight")


@dataclass
class _Stream:
    """Where one request's events go: an asyncio queue owned by the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Event]


class Engine:
    """Asyncio front of `EngineCore`: one step thread, one event queue per request.

    The lock guards all core state; the step thread holds it only to schedule and to record
    results, never during the forward pass, so `generate`, `abort` and `stats` stay responsive.
    """

    def __init__(self, model: MossSpeechForCausalLM, tokenizer: Tokenizer, config: EngineConfig) -> None:
        self.core = EngineCore(model, tokenizer, config)
        self.config = config
        self.tokenizer = tokenizer
        self.model_config = model.config
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._is_shut_down = False
        # health (check_health): steps that raised since the last one that ran, all that ever raised, the first
        # device error, and when the step now running began (monotonic; None between steps)
        self._failed_in_a_row = 0
        self._step_failures = 0
        self._device_error: str | None = None
        self._step_started: float | None = None
        self._sleep = asyncio.sleep  # how `generate` waits to batch codes (tests substitute it)
        self._thread = threading.Thread(target=self._run_loop, name="moss-engine-step", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        """Build from a preset (random weights, deterministic in `weights_seed`) or a checkpoint folder."""
        return cls(*load_model(config), config)

    async def generate(
        self, request: GenerationRequest, *, eager_codes: int = 0, codes_batch_s: float = 0.0
    ) -> AsyncIterator[Event]:
        """Stream `request`'s events, ending with `Finished`; typed errors come from the first `__anext__`.

        Closing or cancelling the iterator before `Finished` aborts the request.

        Audio codes that are already queued when the caller asks for the next event come merged into one
        `AudioCodes` (order kept: a text delta or the end is never overtaken). With `codes_batch_s` > 0,
        once `eager_codes` codes have been yielded, an `AudioCodes` event is held until `codes_batch_s`
        has passed since the previous one and then carries every code that arrived meanwhile: a
        transport that costs per event (one Ray streaming item each) then carries a few events per
        second per stream instead of one per decode step, while the first codes still leave at once.
        """
        if not isinstance(request, GenerationRequest):
            raise InvalidRequestError(f"expected a GenerationRequest, got {type(request).__name__}")
        if eager_codes < 0 or not codes_batch_s >= 0:
            raise ValueError(f"eager_codes and codes_batch_s must be >= 0, got {eager_codes}, {codes_batch_s}")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            reason = self._unhealthy_reason()  # a shut-down engine too: a retryable 503 at the edge, not a 500
            if reason is not None:
                raise EngineUnhealthyError(f"the engine cannot serve: {reason}")
            if request.request_id in self._streams:
                raise InvalidRequestError(f"request_id {request.request_id!r} is already in flight")
            self.core.add_request(request)
            self._streams[request.request_id] = stream
        self._wakeup.set()
        is_done = False
        held: Event | None = None  # a non-audio event taken while merging codes: it goes out next
        codes_out = 0
        last_codes_at = -math.inf
        try:
            while not is_done:
                event = held if held is not None else await stream.queue.get()
                held = None
                if isinstance(event, AudioCodes):
                    delay = last_codes_at + codes_batch_s - stream.loop.time()
                    if codes_out >= eager_codes and delay > 0:
                        await self._sleep(delay)
                    codes = list(event.codes)
                    while not stream.queue.empty():
                        queued = stream.queue.get_nowait()
                        if not isinstance(queued, AudioCodes):
                            held = queued
                            break
                        codes.extend(queued.codes)
                    event = AudioCodes(tuple(codes))
                    codes_out += len(codes)
                    last_codes_at = stream.loop.time()
                is_done = isinstance(event, Finished)
                yield event
        finally:
            if not is_done:
                with self._lock:  # only this stream's request: the id may be in use again by a newer one
                    if self._streams.get(request.request_id) is stream:
                        self._deliver(self.core.abort(request.request_id))

    def abort(self, request_id: str) -> None:
        """Free the request's blocks now; its stream ends with Finished("abort"). No-op when not in flight."""
        with self._lock:
            self._deliver(self.core.abort(request_id))

    def stats(self) -> EngineStats:
        """Queue lengths, block usage, prefix-cache counters and failed steps."""
        with self._lock:
            return replace(self.core.stats(self._streams.keys()), num_step_failures=self._step_failures)

    def check_health(self) -> None:
        """Raise EngineUnhealthyError, saying why, when the engine can serve no more: its step thread has
        stopped, a step failed with a device error, `max_consecutive_step_failures` steps in a row failed, or
        the running step has run longer than `step_timeout_s`. New requests are refused meanwhile (the same
        error). Only the last heals (when the step ends); the others last until the replica is replaced."""
        reason = self._unhealthy_reason()
        if reason is not None:
            raise EngineUnhealthyError(reason)

    def _unhealthy_reason(self) -> str | None:
        if self._is_shut_down:
            return "the engine is shut down"
        if not self._thread.is_alive():
            return "the engine's step thread has stopped"
        if self._device_error is not None:
            return f"a step failed with a device error: {self._device_error}"
        limit = self.config.max_consecutive_step_failures
        if self._failed_in_a_row >= limit:
            return f"{self._failed_in_a_row} steps in a row failed (max_consecutive_step_failures {limit})"
        started = self._step_started
        if started is not None and (running := time.monotonic() - started) > self.config.step_timeout_s:
            return f"a step has run for {running:.0f} s (step_timeout_s {self.config.step_timeout_s:g})"
        return None

    async def shutdown(self) -> None:
        """Stop the step thread; in-flight requests end with Finished("abort"). Waits for a running step at most
        `step_timeout_s`: past that the step is hung (`check_health`), and the thread (a daemon) is left to the
        process's exit, so that a replica replaced for a hung step stops instead of holding its GPU share."""
        with self._lock:
            self._is_shut_down = True
            for request_id in list(self.core.scheduler.seqs):
                self._deliver(self.core.abort(request_id))
        self._wakeup.set()
        await asyncio.to_thread(self._thread.join, self.config.step_timeout_s)
        if self._thread.is_alive():
            logger.warning("the engine's step thread did not stop within step_timeout_s (%g s): a step is hung; "
                           "leaving it to the process's exit", self.config.step_timeout_s)

    def _deliver(self, events: list[tuple[str, Event]]) -> None:
        """Hand events to their streams' loops (caller holds the lock)."""
        for request_id, event in events:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            if isinstance(event, Finished):
                del self._streams[request_id]
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, event)
            except RuntimeError:  # the caller's loop is closed: nobody is left to read the event
                logger.debug("dropped an event for %s: its event loop is closed", request_id)

    def _run_loop(self) -> None:
        while True:
            self._wakeup.wait()
            try:
                if not self._run_one_step():
                    return
            except Exception as exc:  # a failed step must not leave streams hanging
                logger.exception("engine step failed; failing every in-flight request")
                with self._lock:
                    self._step_started = None
                    self._failed_in_a_row += 1
                    self._step_failures += 1
                    if self._device_error is None and is_device_error(exc):
                        self._device_error = repr(exc)
                    self._deliver(self.core.fail_all(f"engine step failed: {exc!r}"))
            except BaseException as exc:  # the thread ends (check_health says so): end every stream first
                with self._lock:
                    self._deliver(self.core.fail_all(f"engine step thread stopped: {exc!r}"))
                raise

    def _step_ran(self) -> None:
        """A step's results are recorded (caller holds the lock)."""
        self._step_started = None
        self._failed_in_a_row = 0

    def _run_one_step(self) -> bool:
        """Schedule and record under the lock, forward without it; False once shut down."""
        with self._lock:
            if self._is_shut_down:
                return False
            if not self.core.has_work:
                self._wakeup.clear()
                return True
            if self.core.async_scheduling:
                events, launched = self.core.schedule_step()
                self._deliver(events)
                is_idle = launched is None and not self.core.has_work_in_flight
            else:
                events, out, inp = self.core.begin_step()
                self._deliver(events)
                is_idle = inp is None
        if self.core.async_scheduling and not is_idle:
            self._step_started = time.monotonic()
            if launched is not None:
                self.core.launch(launched)
            self.core.wait_in_flight()  # the GPU runs `launched` meanwhile
            with self._lock:
                self._deliver(self.core.finish_step(launched))
                self._step_ran()
            return True
        if is_idle:  # queue expiries only, or every stream is paced: sleep until one is due
            with self._lock:
                due = self.core.scheduler.next_due_in()
            time.sleep(min(0.002, max(0.0005, due or 0.0)))  # a new request waits at most 2 ms
            return True
        self._step_started = time.monotonic()
        sampled, step_s = self.core.run_model(inp)
        with self._lock:
            self._deliver(self.core.end_step(out, sampled, step_s))
            self._step_ran()
        return True
