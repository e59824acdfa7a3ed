"""StreamingVocoder: codes -> 24 kHz PCM, one session per stream, sessions batched per step."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from runtime.device_memory import cap_device_memory
from runtime.kernels import pdl_launches, resolve_pdl
from runtime.matmul_check import CHECK_ROWS, ProductCheck, distinct_matrices, verify_products
from runtime.transfer import to_device
from vocoder.aa_activation import fuse_activations
from vocoder.chunking import crossfade_weights, join_chunk, scheduled_chunk_ends
from vocoder.config import (
    HOP_LENGTH,
    LOOKAHEAD_CODES,
    MEL_FRAMES_PER_CODE,
    NUM_AUDIO_CODES,
    VocoderConfig,
    check_schedule,
    resolve_dtype,
)
from vocoder.flow import FlowDecoder
from vocoder.flow_layers import CausalBlock, CausalConv1d, ChunkTransformer
from vocoder.graphs import GraphedFunction
from vocoder.kernels import HAS_TRITON
from vocoder.mel_vocoder import build_generator, receptive_field_frames, use_channels_last, vocode
from vocoder.noise import batch_frame_noise, check_seed, frame_noise
from vocoder.safetensors_io import read_safetensors
from vocoder.session import VocoderSession, check_codes
from vocoder.state_pool import FlowStatePool
from vocoder.voices import DEFAULT_VOICES_DIR, Voice, VoiceLibrary

_F = MEL_FRAMES_PER_CODE
_EMPTY = np.zeros(0, dtype=np.float32)
PRIMED_CACHE_SIZE = 64  # (voice, seed) primings kept by `StreamingVocoder.open_many`
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256)  # rows with bucket_shapes


def row_bucket(n: int) -> int:
    """The smallest of ROW_BUCKETS (then multiples of 64) that holds n rows."""
    return next((b for b in ROW_BUCKETS if b >= n), -(-n // 64) * 64)


def _codes_covering(frames: int) -> int:
    """Codes whose mel frames reach `frames` (ceiling division by the frames per code)."""
    return -(-frames // _F)


class _Lane:
    """Where a step runs: a CUDA stream (None: the caller's current stream), the per-chunk tensor functions
    (graph-replaying wrappers after `use_cuda_graphs`, each lane with graphs of its own) and a padding slot."""

    def __init__(self, fns: tuple[Callable, Callable, Callable], stream: torch.cuda.Stream | None = None):
        self.stream = stream
        self.lock = threading.Lock()  # one call at a time per lane (its graphs' static buffers)
        self.encode, self.flow_step, self.generate = fns
        self.graphed: list[GraphedFunction] = []
        self.scratch_slot: int | None = None  # with bucket_shapes: padding rows read and write their caches here
        self.pool_generation = 0  # the state pool's generation its flow graphs were captured against


def _pdl_scoped(fn: Callable, mode: str) -> Callable:
    """`fn` with its Triton kernels launched in PDL `mode` (captured graphs keep the launch attributes)."""
    if mode == "off":
        return fn

    def scoped(*args, **kwargs):
        with pdl_launches(mode):
            return fn(*args, **kwargs)

    return scoped


class StreamingVocoder:
    """Streaming codec decoder (flow matching to mel, BigVGAN to PCM); see docs/vocoder.md.

    Over a session's life the PCM returned by push/step/finish adds up to exactly
    SAMPLES_PER_CODE * codes pushed, whatever the chunking and whichever other sessions share a step.
    latency "exact": it equals `decode_whole` on the same codes within float rounding. latency "low"
    (default): chunks leave after their codes' encoder lookahead, with crossfaded ends; the audio is a
    function of the codes alone (not of push sizes or batch neighbours) and stays close to `decode_whole`
    (docs/vocoder.md states the measured bound). Not thread-safe, with one exception: drive one instance
    from one thread (or event loop) at a time, except that steps on different lanes (`add_lane`) may run
    on different threads at once (calls on one lane wait for each other), as long as no session is in two
    calls at once. `open` runs on a lane like a step; `close` may come from any thread, but not for a session
    in a call still running (its slot goes back to the pool at once, and the next `open` may take it while
    that call still writes it; `deployments/batcher.py` closes only sessions no step holds).
    """

    def __init__(
        self,
        config: VocoderConfig,
        flow: FlowDecoder,
        generator: torch.nn.Module,
        voices: VoiceLibrary,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        triton_kernels: bool | None = None,
        pdl: str = "auto",
        channels_last: bool | None = None,
    ):
        config.validate()
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.flow = flow.to(device=self.device, dtype=dtype).eval()
        self.generator = generator.to(device=self.device, dtype=dtype).eval()
        self.voices = voices
        self.triton_kernels = self._enable_triton_kernels(triton_kernels)
        # BigVGAN's data channels-last (mel_vocoder.use_channels_last): None = with the Triton kernels
        if channels_last and not self.triton_kernels:
            raise ValueError("channels_last needs the Triton kernels (the package's activation would copy)")
        self.channels_last = self.triton_kernels if channels_last is None else channels_last
        if self.channels_last:
            use_channels_last(self.generator)
        # programmatic dependent launch of the Triton kernels ("auto": where supported); same results either way
        self.pdl = resolve_pdl(pdl, self.device, self.triton_kernels)
        exact_left, exact_right = receptive_field_frames(self.generator)
        stream = config.stream
        self.is_low_latency = stream.latency == "low"
        self.exact_left_context = exact_left
        self.left_context = (
            exact_left if stream.vocoder_left_context_frames is None else stream.vocoder_left_context_frames
        )
        default_right = 0 if self.is_low_latency else exact_right
        self.right_context = (
            default_right
            if stream.vocoder_right_context_frames is None
            else stream.vocoder_right_context_frames
        )
        self.overlap_samples = stream.overlap_samples if self.is_low_latency else 0
        self._overlap_frames = -(-self.overlap_samples // HOP_LENGTH)  # frames re-vocoded for the crossfade
        self._fade_in, self._fade_out = crossfade_weights(self.overlap_samples)
        self.history_codes = config.flow.encoder.left_context_codes
        self.pool = FlowStatePool(
            self.flow.cache_shapes(),
            config.flow.num_steps,
            self.flow.num_branches,
            device=self.device,
            dtype=dtype,
        )
        self._voice_mel: dict[str, tuple[Voice, torch.Tensor]] = {}
        # (voice name, seed) -> (voice, pool caches, flow_cursor, codes, codes_start) after priming, LRU order
        self._primed: OrderedDict[tuple[str, int], tuple] = OrderedDict()
        self._primed_lock = threading.Lock()  # opens on different lanes may run at once
        self.num_primed_hits = 0
        # Lane 0 runs on the caller's stream; `add_lane` adds others. Each holds its per-chunk tensor
        # functions, which `use_cuda_graphs` swaps for graph-replaying wrappers.
        self._lanes = [_Lane(self._plain_fns())]
        self._graph_options: tuple[int, bool] | None = None  # (max_graphs, bucket_shapes) once graphs are on
        self._gate = threading.Condition()  # lane calls in progress against a pool growth (`_exclusive`)
        self._busy = 0
        self._growing = False
        self._bucket_shapes = False
        self._code_buckets = sorted(set(config.stream.chunk_schedule_codes) | {2**i for i in range(13)})
        base, schedule = self.left_context + self.right_context, config.stream.chunk_schedule_codes
        # windows of scheduled chunks: the first holds nothing back, later ones re-vocode the held overlap
        self._window_buckets = sorted(
            {base + _F * schedule[0]}
            | {base + self._overlap_frames + _F * k for k in schedule[1:]}
            | {2**i for i in range(16)}
        )

    def _enable_triton_kernels(self, requested: bool | None) -> bool:
        """Fused anti-aliased activations in BigVGAN; in the estimator chunk attention, fused LayerNorm +
        linear (+ GELU, residual) and fused channel norm + Mish (CUDA + Triton).

        None: on wherever they can run. The PyTorch modules stay the reference; tests on the GPU machine
        (bench/vocoder_profile.py) check the kernels against them.
        """
        available = HAS_TRITON and self.device.type == "cuda"
        if requested and not available:
            raise ValueError("triton_kernels=True needs a CUDA device and Triton")
        enabled = available if requested is None else requested
        if enabled:
            fuse_activations(self.generator)
            for module in self.flow.estimator.modules():
                if isinstance(module, (ChunkTransformer, CausalBlock, CausalConv1d)):
                    module.use_triton = True
            self.flow.estimator.channels_last = True
        return enabled

    def use_cuda_graphs(self, *, max_graphs: int | None = None, bucket_shapes: bool = False) -> None:
        """Replay CUDA graphs of the per-chunk encoder, flow solve and BigVGAN per input shape.

        Worth it where shapes repeat (the first chunk of a stream, steady-state steps of a fixed schedule);
        shapes seen once stay eager. On CPU the same static-buffer path runs without graphs (tests).
        `bucket_shapes` pads every step to ROW_BUCKETS rows and bucketed code counts, so fewer shapes are
        captured at the cost of padding; with `warm_up` it bounds what must be captured before traffic.
        max_graphs (per function and lane) None: 128 with bucket_shapes (a bounded set), else 32.
        """
        if max_graphs is None:
            max_graphs = 128 if bucket_shapes else 32
        self._graph_options = (max_graphs, bucket_shapes)
        self._bucket_shapes = bucket_shapes
        for lane in self._lanes:
            self._graph_lane(lane)

    def _plain_fns(self) -> tuple[Callable, Callable, Callable]:
        return tuple(  # type: ignore[return-value]
            _pdl_scoped(fn, self.pdl) for fn in (self.flow.encoder, self._solve_from_pool, self.generator)
        )

    def _graph_lane(self, lane: _Lane) -> None:
        """Graph-replaying functions for `lane` (their own memory pool: lanes replay at the same time)."""
        assert self._graph_options is not None
        max_graphs, bucket_shapes = self._graph_options
        pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        lane.graphed = [GraphedFunction(fn, max_graphs=max_graphs, pool=pool) for fn in self._plain_fns()]
        lane.encode, lane.flow_step, lane.generate = lane.graphed
        if bucket_shapes and lane.scratch_slot is None:
            with self._exclusive():
                lane.scratch_slot = self.pool.allocate()
        lane.pool_generation = self.pool.generation

    def add_lane(self, priority: int = -1) -> int:
        """A lane whose steps may run on another thread while lane 0's run: on CUDA a stream of its own at
        `priority` (lower is more urgent, PyTorch clamps it to the device's range), so a small urgent step
        (a stream's first chunk) is scheduled ahead of a large step in flight instead of waiting for it.
        Its graphs are separate (captured by `warm_up(..., lane=)` or on second sighting). Returns the lane's
        index for `step`, `finish_many` and `warm_up`."""
        stream = torch.cuda.Stream(self.device, priority=priority) if self.device.type == "cuda" else None
        lane = _Lane(self._plain_fns(), stream)
        if self._graph_options is not None:
            self._graph_lane(lane)
        self._lanes.append(lane)
        return len(self._lanes) - 1

    @property
    def num_lanes(self) -> int:
        """Lanes: 1 + those `add_lane` added."""
        return len(self._lanes)

    @property
    def _graphed(self) -> list[GraphedFunction]:
        """Lane 0's graphed functions (encoder, flow solve, BigVGAN); empty without graphs."""
        return self._lanes[0].graphed

    @property
    def _num_scratch_slots(self) -> int:
        return sum(lane.scratch_slot is not None for lane in self._lanes)

    def _check_lane(self, index: int) -> int:
        if not 0 <= index < len(self._lanes):
            raise ValueError(f"lane must be in [0, {len(self._lanes)}), got {index}")
        return index

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """No lane call runs inside the block (the state pool may be reallocated in it)."""
        with self._gate:
            while self._growing:
                self._gate.wait()
            self._growing = True
            while self._busy:
                self._gate.wait()
        try:
            yield
        finally:
            with self._gate:
                self._growing = False
                self._gate.notify_all()

    @contextlib.contextmanager
    def _in_lane(self, index: int, sessions: Sequence[VocoderSession] = ()) -> Iterator[_Lane]:
        """Run the block on lane `index` (its stream current); with several lanes, wait for the lane's work
        before leaving, so a session's next call may be on another lane."""
        lane = self._lanes[self._check_lane(index)]
        with lane.lock:
            with self._gate:  # counted as a lane call in progress: a pool growth waits for none
                while self._growing:
                    self._gate.wait()
                self._busy += 1
            try:
                if self.device.type != "cuda":
                    yield lane
                    return
                stream = lane.stream or torch.cuda.current_stream(self.device)
                for s in sessions:  # tensors made on another lane's stream: the allocator must not reuse
                    if s.lane != index:  # their memory there while this stream may still read them
                        s.mel.record_stream(stream)
                        s.speaker.record_stream(stream)
                        s.lane = index
                with torch.cuda.stream(stream):
                    yield lane
                    if len(self._lanes) > 1:
                        stream.synchronize()
            finally:
                with self._gate:
                    self._busy -= 1
                    self._gate.notify_all()

    def reserve_sessions(self, num_sessions: int) -> None:
        """Allocate flow state for `num_sessions` open sessions now. The state pool otherwise doubles when
        full, and each growth drops the captured flow graphs (they read the pool's tensors), which are
        then captured again under load."""
        with self._exclusive():
            self.pool.reserve(num_sessions + self._num_scratch_slots)

    def warm_up(
        self, rows: Sequence[int], *, voice: str = "default", seed: int = 0, push_sizes: Sequence[int] = (1,),
        lane: int = 0, schedule: Sequence[int] | None = None,
    ) -> dict[str, float]:
        """Capture, before any traffic, the graphs of the steps that `r` streams in lockstep take through
        the chunk schedule, for every r in `rows` (with `bucket_shapes`, give the ROW_BUCKETS to cover).

        Warm-up streams open, take their codes in pushes of each size in `push_sizes` (1: the codes arrive
        one per step, as when the vocoder keeps up) and finish; shapes are captured on their first
        sighting here. One length runs the whole schedule and its repeating last chunk; the others end
        so that the tail a finish computes takes every (bucketed) size it can take. Needs
        `use_cuda_graphs()`. `lane`: the lane whose graphs to capture (the streams still open on lane 0).
        `schedule`: the chunk schedule the streams follow (None: `chunk_schedule_codes`).
        Returns the graphs captured, the steps run and the seconds it took.
        """
        if not self._graphed:
            raise RuntimeError("warm_up captures graphs: call use_cuda_graphs() first")
        graphed = self._lanes[self._check_lane(lane)].graphed
        if not rows or min(rows) < 1 or not push_sizes or min(push_sizes) < 1:
            raise ValueError(f"rows and push_sizes must be non-empty and >= 1, got {rows}, {push_sizes}")
        if schedule is not None and not self.is_low_latency:
            raise ValueError("a warm-up schedule needs low latency")
        schedule = tuple(schedule if schedule is not None else self.config.stream.chunk_schedule_codes)
        open_schedule = schedule if self.is_low_latency else None
        # A finish integrates and vocodes the n codes after the last chunk's end (the lookahead plus up to
        # a chunk - 1): one tail per distinct (flow shape, BigVGAN window) that n gives.
        last_tail = LOOKAHEAD_CODES + schedule[-1] - 1
        tails: dict[tuple[int, int], int] = {}
        for n in range(LOOKAHEAD_CODES, last_tail + 1):
            window = self.left_context + self.right_context + self._overlap_frames + _F * n
            tails.setdefault((self._bucket_codes(n), self._bucket_window(window)), n)
        full_run = sum(schedule) + schedule[-1] + LOOKAHEAD_CODES  # its tail is the lookahead alone
        lengths = [full_run] + [sum(schedule) + n for n in sorted(tails.values()) if n != LOOKAHEAD_CODES]
        codes = [(7919 * i + 13) % NUM_AUDIO_CODES for i in range(max(lengths))]  # shapes ignore the values
        self.reserve_sessions(self.num_open_sessions + max(rows))
        graphs_before, t0, steps = self.graph_stats["num_graphs"], time.perf_counter(), 0
        saved = [g.capture_after_calls for g in graphed]
        for g in graphed:
            g.capture_after_calls = 1
        try:
            if lane == 0:  # the priming of a (voice, seed) not seen before, as a request with a new seed runs it
                cold_seed = next(n for n in itertools.count(seed + 1) if (voice, n) not in self._primed)
                self.close(self.open(voice, seed=cold_seed))
                self._primed.pop((voice, cold_seed), None)
            for r, size, num_codes in itertools.product(sorted(set(rows)), push_sizes, lengths):
                sessions = [self.open(voice, seed=seed, schedule=open_schedule) for _ in range(r)]
                try:
                    for i in range(0, num_codes, size):
                        self.step([(s, codes[i : i + size]) for s in sessions], lane=lane)
                        steps += 1
                    self.finish_many(sessions, lane=lane)
                finally:
                    for s in sessions:
                        self.close(s)
        finally:
            for g, n in zip(graphed, saved):
                g.capture_after_calls = n
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {
            "graphs_captured": self.graph_stats["num_graphs"] - graphs_before,
            "steps": steps,
            "seconds": time.perf_counter() - t0,
        }

    @property
    def graph_stats(self) -> dict[str, int]:
        """Captured graphs, replays and eager calls over all graphed functions of every lane (zeros without
        graphs)."""
        graphed = [g for lane in self._lanes for g in lane.graphed]
        return {
            "num_graphs": sum(g.num_graphs for g in graphed),
            "num_replays": sum(g.num_replays for g in graphed),
            "num_eager_calls": sum(g.num_eager_calls for g in graphed),
        }

    def freeze_graphs(self) -> None:
        """Capture no new shape on any lane from now on: shapes not captured yet run eagerly. Bounds the
        graphs' memory by what the warm-up captured, for a replica under a memory cap (a capture at run time
        could fail there)."""
        if not self._graphed:
            raise RuntimeError("freeze_graphs needs use_cuda_graphs()")
        for lane in self._lanes:
            for g in lane.graphed:
                g.freeze()

    @classmethod
    def from_preset(
        cls,
        name: str,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str | None = None,
        seed: int = 0,
        voices_dir: str | Path | None = None,
        flow_checkpoint: str | Path | None = None,
        bigvgan_checkpoint: str | Path | None = None,
        config: VocoderConfig | None = None,
        triton_kernels: bool | None = None,
        channels_last: bool | None = None,
    ) -> StreamingVocoder:
        """Build `tiny` or `full` (random deterministic weights from `seed` unless checkpoints are given).

        dtype None means float32; triton_kernels None means on with CUDA and Triton; channels_last (BigVGAN's
        data channels-last, `mel_vocoder.use_channels_last`) None means with the Triton kernels. Checkpoints are
        safetensors state dicts (flow: FlowDecoder keys;
        BigVGAN: generator keys). `config` overrides the preset (e.g. other Euler steps or chunking).
        """
        cfg = config if config is not None else VocoderConfig.preset(name)
        cfg.validate()
        torch_dtype = resolve_dtype(dtype)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            flow = FlowDecoder(cfg.flow)
        if flow_checkpoint is not None:
            if Path(flow_checkpoint).suffix != ".safetensors":
                raise ValueError(f"flow checkpoint must be .safetensors, got {flow_checkpoint}")
            try:
                flow.load_state_dict(read_safetensors(flow_checkpoint, "flow checkpoint"), strict=True)
            except RuntimeError as exc:
                raise ValueError(
                    f"flow checkpoint {flow_checkpoint} does not match the config: {exc}"
                ) from None
        generator = build_generator(cfg.bigvgan, checkpoint=bigvgan_checkpoint, seed=seed)
        voices = VoiceLibrary(voices_dir if voices_dir is not None else DEFAULT_VOICES_DIR)
        return cls(
            cfg, flow, generator, voices, device=device, dtype=torch_dtype, triton_kernels=triton_kernels,
            channels_last=channels_last,
        )

    # ---------------------------------------------------------------- sessions

    def open(
        self, voice: str = "default", *, seed: int = 0, lane: int = 0, schedule: Sequence[int] | None = None
    ) -> VocoderSession:
        """Start a stream conditioned on `voice`; noise is a function of (seed, frame) only."""
        return self.open_many([(voice, seed)], lane=lane, schedule=schedule)[0]

    def open_many(
        self, specs: Sequence[tuple[str, int]], *, lane: int = 0, schedule: Sequence[int] | None = None
    ) -> list[VocoderSession]:
        """Batched `open` for (voice, seed) pairs (extension of the contract): one priming forward.

        Priming (the flow over the voice's prompt codes) is a function of (voice, seed) alone, so its
        result is kept for the last `PRIMED_CACHE_SIZE` pairs and copied into the next session of the same
        pair instead of being computed again (`num_primed_hits` counts those). `lane`: where the priming
        runs (`add_lane`). `schedule` (low latency): the chunk sizes the sessions follow; None picks
        `schedule_for_open(len(specs))`.
        """
        self._check_lane(lane)
        voices = [self.voices.get(name) for name, _ in specs]
        for _, seed in specs:
            check_seed(seed)
        if schedule is None:
            chosen = self.schedule_for_open(len(specs))
        else:
            if not self.is_low_latency:
                raise ValueError(f"a schedule needs low latency, got {schedule!r}")
            chosen = check_schedule(schedule, self.overlap_samples, "schedule")
        slots = self._take_slots(len(specs))
        try:
            return self._open_in_lane(voices, specs, slots, lane, chosen)
        except BaseException:
            for slot in slots:  # nothing was handed out: the slots go back
                self.pool.release(slot)
            raise

    def _take_slots(self, count: int) -> list[int]:
        """`count` pool slots, taken before any lane call: a pool growth happens while no lane runs (another
        lane's step may read the pool), as often as it takes, and two opens on different lanes cannot both
        count on the same free slot."""
        while (slots := self.pool.take(count)) is None:
            self.reserve_sessions(max(2 * self.pool.capacity, self.pool.num_used + count))
        return slots

    def _open_in_lane(
        self, voices: list[Voice], specs: Sequence[tuple[str, int]], slots: list[int], lane: int,
        chosen: tuple[int, ...],
    ) -> list[VocoderSession]:
        sessions = []
        with torch.inference_mode(), self._in_lane(lane):
            for v, (_, seed), slot in zip(voices, specs, slots, strict=True):
                self.pool.zero(slot)
                p = v.num_prompt_codes
                mel_start = max(0, _F * p - self.left_context)
                emb = to_device(v.speaker_embedding[None].to(self.dtype), self.device)
                sessions.append(
                    VocoderSession(
                        voice=v,
                        seed=seed,
                        slot=slot,
                        speaker=self.flow.speaker_condition(emb)[0],
                        codes=[int(c) for c in v.prompt_codes.tolist()],
                        codes_start=0,
                        num_codes=p,
                        flow_cursor=0,
                        mel=self._prompt_mel(v)[:, mel_start:],
                        mel_start=mel_start,
                        emitted_frames=_F * p,
                        lane=lane,
                        schedule=chosen,
                        owner=id(self),
                    )
                )
            with self._primed_lock:
                cold = [s for s in sessions if not self._restore_primed(s)]
            # Prime the flow over the prompt now, so later steps carry only new frames.
            self._advance_flow(cold, [max(0, s.num_prompt_codes - LOOKAHEAD_CODES) for s in cold],
                               self._lanes[lane])
            with self._primed_lock:
                for s in cold:
                    self._keep_primed(s)
        return sessions

    def _restore_primed(self, s: VocoderSession) -> bool:
        """Copy a kept priming of (voice, seed) into `s`; False when none is kept."""
        entry = self._primed.get((s.voice.name, s.seed))
        if entry is None or entry[0] is not s.voice:  # unknown, or the voice was reloaded since
            return False
        self._primed.move_to_end((s.voice.name, s.seed))
        _, caches, flow_cursor, codes, codes_start = entry
        self.pool.restore(s.slot, caches)
        if self.device.type == "cuda":  # another lane's open may drop this entry before the copy has run
            for saved in caches:
                saved.record_stream(torch.cuda.current_stream(self.device))
        s.flow_cursor, s.codes, s.codes_start = flow_cursor, list(codes), codes_start
        self.num_primed_hits += 1
        return True

    def _keep_primed(self, s: VocoderSession) -> None:
        if PRIMED_CACHE_SIZE < 1:
            return
        key = (s.voice.name, s.seed)
        self._primed[key] = (s.voice, self.pool.snapshot(s.slot), s.flow_cursor, tuple(s.codes), s.codes_start)
        self._primed.move_to_end(key)
        while len(self._primed) > PRIMED_CACHE_SIZE:
            self._primed.popitem(last=False)

    def push(self, session: VocoderSession, codes: Sequence[int]) -> np.ndarray:
        """Add codes; return the PCM that became final (float32, may be empty)."""
        return self.step([(session, codes)])[0]

    def finish(self, session: VocoderSession) -> np.ndarray:
        """Flush the rest of the stream and close the session."""
        return self.finish_many([session])[0]

    def finish_many(self, sessions: Sequence[VocoderSession], *, lane: int = 0) -> list[np.ndarray]:
        """Batched `finish` (extension of the contract), on `lane` (`add_lane`)."""
        self._check_sessions(sessions)
        with self._in_lane(lane, sessions) as on:
            out = self._run(on, list(sessions), finishing=[True] * len(sessions))
        for s in sessions:
            self.close(s)
        return out

    def close(self, session: VocoderSession) -> None:
        """Drop a session without producing more audio (abort); idempotent."""
        if not isinstance(session, VocoderSession):
            raise TypeError(f"expected a VocoderSession, got {type(session).__name__}")
        if session.owner != id(self):
            raise ValueError("session was opened by another vocoder")
        if not session.is_closed:
            session.is_closed = True
            self.pool.release(session.slot)

    def schedule_for_open(self, num_new: int = 1) -> tuple[int, ...]:
        """The chunk schedule of sessions opened now, `num_new` at once: the light-load one while the open
        sessions, these included, stay within `light_load_max_sessions`, else `chunk_schedule_codes` (exact
        mode: that too, unused)."""
        main, *light = self.schedules
        if light and self.num_open_sessions + num_new <= self.config.stream.light_load_max_sessions:
            return light[0]
        return main

    @property
    def schedules(self) -> list[tuple[int, ...]]:
        """The chunk schedules sessions may follow: the main one, then the light-load one if configured."""
        stream = self.config.stream
        light = stream.light_load_schedule_codes
        return [tuple(stream.chunk_schedule_codes)] + ([tuple(light)] if light is not None else [])

    @property
    def codes_for_two_chunks(self) -> int:
        """Codes a stream must have before its second chunk can be computed (its first two chunks plus the
        encoder lookahead and BigVGAN's right context), the most over the schedules: a producer should send
        these without delay."""
        stream = self.config.stream
        right_codes = _codes_covering(self.right_context)
        if self.is_low_latency:
            return LOOKAHEAD_CODES + right_codes + max(s[0] + s[min(1, len(s) - 1)] for s in self.schedules)
        return LOOKAHEAD_CODES + right_codes + stream.first_chunk_codes + stream.chunk_codes

    def check_products(self, rows: Sequence[int] = CHECK_ROWS) -> list[ProductCheck]:
        """The engine's start-up product check (runtime/matmul_check.py) over the flow's matrices: each
        distinct shape of its linear layers (code encoder and estimator) times random activations in the
        vocoder's dtype at each of `rows`, against float32, with the layer's bias where it has one (the layer
        then runs as one addmm, which cuBLASLt may serve with other kernels than the plain product: a shape
        of biased and unbiased layers is checked both ways). Raises MatmulCheckError naming every wrong
        product; returns the checks. (BigVGAN's convolutions run through cuDNN and are not checked.)"""
        linears = [(name, m) for name, m in self.flow.named_modules() if isinstance(m, torch.nn.Linear)]
        plain = distinct_matrices((name, m.weight.detach()) for name, m in linears if m.bias is None)
        biased = distinct_matrices((name, m.weight.detach()) for name, m in linears if m.bias is not None)
        biases = {name: m.bias.detach() for name, m in linears if name in biased}
        with torch.inference_mode():
            return verify_products(plain | biased, rows, dtype=self.dtype, who="The vocoder", biases=biases)

    @property
    def num_open_sessions(self) -> int:
        """Sessions opened and not yet finished or closed."""
        return self.pool.num_used - self._num_scratch_slots

    def bucket_rows(self, n: int) -> int:
        """Batch rows a step runs with: n; with `bucket_shapes` the smallest of ROW_BUCKETS (then
        multiples of 64) that holds n, so few shapes are captured and padding stays under a third."""
        return row_bucket(n) if self._bucket_shapes else n

    def _bucket_codes(self, n: int) -> int:
        """Codes (or code-length of frames) a step runs with: n; with `bucket_shapes` the smallest of
        the chunk schedule's sizes and the powers of two that holds n."""
        if not self._bucket_shapes:
            return n
        return next((b for b in self._code_buckets if b >= n), n)

    def _bucket_window(self, frames: int) -> int:
        """BigVGAN window (frames) of a batch of fully left-padded rows: `frames`; with `bucket_shapes`
        the smallest window of a scheduled chunk (with and without a held overlap) or power of two that
        holds it, so stream tails of any length reuse the graphs of scheduled chunks."""
        if not self._bucket_shapes:
            return frames
        return next((w for w in self._window_buckets if w >= frames), frames)

    def step(
        self,
        work: list[tuple[VocoderSession, Sequence[int]]],
        *,
        max_chunks: int | None = None,
        finish: Collection[VocoderSession] = (),
        lane: int = 0,
    ) -> list[np.ndarray]:
        """Push codes to several sessions and run them as one batch; PCM per work item, in order.

        `max_chunks`: compute at most this many chunks per session (None: every chunk its codes allow).
        The codes of the chunks left out stay in the session for a later step (with or without new codes),
        so a scheduler can keep every step to one chunk per stream, in the shapes the warm-up captured;
        the audio is the same either way (chunk boundaries depend on the code count alone).
        `finish`: sessions of `work` whose stream ends here: their PCM is the rest of the stream (as
        `finish` gives it, after their codes are pushed) and they are closed, in the same batch as the
        others' chunks instead of a call of their own.
        `lane`: which lane runs it (`add_lane`; 0 is the caller's stream).
        """
        if max_chunks is not None and max_chunks < 1:
            raise ValueError(f"max_chunks must be >= 1 or None, got {max_chunks}")
        sessions = [s for s, _ in work]
        self._check_sessions(sessions)
        self._check_lane(lane)
        ending_ids = {id(s) for s in finish}
        if not ending_ids <= {id(s) for s in sessions}:
            raise ValueError("finish names a session that is not in work")
        checked = [check_codes(codes) for _, codes in work]  # validate all before mutating any
        for (session, _), codes in zip(work, checked):
            session.codes.extend(codes)
            session.num_codes += len(codes)
        ending = [id(s) in ending_ids for s in sessions]
        with self._in_lane(lane, sessions) as on:
            out = self._run(on, sessions, finishing=ending, max_chunks=max_chunks)
        for s, ends in zip(sessions, ending):
            if ends:
                self.close(s)
        return out

    def next_chunk_codes(self, session: VocoderSession, pending: int = 0) -> int:
        """Codes the next chunk of `session` spans once `pending` more codes are pushed; 0 when that chunk
        cannot be computed yet (its codes or their lookahead are missing). Pure: nothing changes."""
        ends = self._chunk_ends(session, finishing=False, extra_codes=pending)
        return _codes_covering(ends[0] - session.emitted_frames) if ends else 0

    def unvocoded_codes(self, session: VocoderSession, pending: int = 0) -> int:
        """Codes pushed (plus `pending`) whose audio has not been computed: what a finish would vocode now."""
        return session.num_codes + pending - _codes_covering(session.emitted_frames)

    def decode_whole(self, voice: str, codes: Sequence[int], *, seed: int = 0) -> np.ndarray:
        """Reference: the whole utterance in one pass (no caches, no windows)."""
        v = self.voices.get(voice)
        check_seed(seed)
        gen = check_codes(codes)
        if not gen:
            return _EMPTY.copy()
        p = v.num_prompt_codes
        all_codes = torch.tensor(
            [v.prompt_codes.tolist() + gen], dtype=torch.long, device=self.device
        )  # [1, N]
        n = all_codes.shape[1]
        with torch.inference_mode():
            mu = self.flow.encoder(all_codes, torch.tensor([n], device=self.device))  # [1, 80, 4N]
            speaker = self.flow.speaker_condition(v.speaker_embedding[None].to(self.device, self.dtype))
            cond = torch.zeros_like(mu)
            cond[0, :, : _F * p] = self._prompt_mel(v).to(mu.dtype)
            noise = frame_noise(seed, 0, _F * n, device=self.device, kernel=self.triton_kernels)[None]
            mel, _ = self.flow.solve(mu, speaker, cond, noise)
            full_mel = torch.cat([self._prompt_mel(v).to(mel.dtype), mel[0, :, _F * p :]], dim=1)[None]
            wav = vocode(self.generator, full_mel)[0, _F * p * HOP_LENGTH :]
        return wav.float().cpu().numpy()

    # ---------------------------------------------------------------- internals

    def _check_sessions(self, sessions: Iterable[VocoderSession]) -> None:
        seen: set[int] = set()
        for s in sessions:
            if not isinstance(s, VocoderSession):
                raise TypeError(f"expected a VocoderSession, got {type(s).__name__}")
            if s.owner != id(self):  # its slot is a row of another vocoder's pool: here it would be another's
                raise ValueError("session was opened by another vocoder")
            if s.is_closed:
                raise ValueError("session is closed (finished or aborted)")
            if id(s) in seen:
                raise ValueError("the same session appears twice in one step")
            seen.add(id(s))

    def _prompt_mel(self, voice: Voice) -> torch.Tensor:
        kept = self._voice_mel.get(voice.name)
        if kept is None or kept[0] is not voice:  # first use, or the voice was replaced under its name
            kept = (voice, voice.prompt_mel.T.contiguous().to(self.device, torch.float32))  # [80, 4P]
            self._voice_mel[voice.name] = kept
        return kept[1]

    def _chunk_ends(self, s: VocoderSession, finishing: bool, extra_codes: int = 0) -> list[int]:
        """Absolute frames at which the chunks this step computes end, in order (empty: nothing yet);
        `extra_codes`: as if that many more codes had been pushed."""
        if finishing:  # the chunks a step would still compute from the codes pushed, then the tail
            end = _F * s.num_codes
            if end <= s.emitted_frames:
                return []
            scheduled = self._chunk_ends(s, False, extra_codes) if self.is_low_latency else []
            return [e for e in scheduled if e < end] + [end]
        final_frames = _F * max(0, s.num_codes + extra_codes - LOOKAHEAD_CODES)
        stream = self.config.stream
        if self.is_low_latency:
            return scheduled_chunk_ends(s.emitted_frames, s.num_chunks, final_frames, s.schedule, self.right_context)
        target = final_frames - self.right_context
        need = stream.first_chunk_codes if s.is_first_chunk_pending else stream.chunk_codes
        return [target] if target - s.emitted_frames >= _F * need else []

    def _run(
        self, lane: _Lane, sessions: list[VocoderSession], finishing: list[bool], max_chunks: int | None = None
    ) -> list[np.ndarray]:
        """Chunks of `sessions` (all the rest of the stream where `finishing`) in one batch."""
        plans = [self._chunk_ends(s, True) if ends else self._chunk_ends(s, False)[:max_chunks]
                 for s, ends in zip(sessions, finishing)]
        ready = [i for i, ends in enumerate(plans) if ends]
        out = [_EMPTY] * len(sessions)
        if not ready:
            return out
        with torch.inference_mode():
            # The flow integrates up to the last chunk's end plus BigVGAN's right context, not to every code
            # it could: its shapes then follow the chunk schedule whatever the pushes' sizes were (the
            # warm-up's shapes), and the codes past that end wait for the next chunk. Same mel either way.
            flow_targets = [
                sessions[i].num_codes if finishing[i]
                else min(sessions[i].num_codes - LOOKAHEAD_CODES, _codes_covering(plans[i][-1] + self.right_context))
                for i in ready
            ]
            self._advance_flow([sessions[i] for i in ready], flow_targets, lane)
            pcm = self._vocode([sessions[i] for i in ready], [plans[i] for i in ready], lane)
        for i, wav in zip(ready, pcm):
            out[i] = wav
        return out

    def _solve_from_pool(
        self,
        mu: torch.Tensor,
        speaker: torch.Tensor,
        cond: torch.Tensor,
        noise: torch.Tensor,
        slots: torch.Tensor,
        valid: torch.Tensor,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Pure per-chunk flow step (graphable): read caches of `slots`, integrate, return the new caches.

        -> mel [B, 80, T] and per conv layer the caches of all Euler steps [K, branches*B, C, ctx].
        """
        per_layer = self.pool.read_steps(slots)  # [K, branches*B, C, ctx] per layer
        caches = [[layer[k] for layer in per_layer] for k in range(self.config.flow.num_steps)]
        mel, new_caches = self.flow.solve(mu, speaker, cond, noise, caches, valid)
        return mel, [torch.stack(layer) for layer in zip(*new_caches)]

    def _advance_flow(self, sessions: list[VocoderSession], targets: list[int], lane: _Lane) -> None:
        """Encoder + Euler integration for code positions [flow_cursor, target) of each session, batched."""
        work = [(s, t) for s, t in zip(sessions, targets) if t > s.flow_cursor]
        if not work:
            return
        starts = [max(s.codes_start, s.flow_cursor - self.history_codes) for s, _ in work]
        # codes past target + lookahead cannot change frames before the target: left out of the window
        windows = [s.codes[w - s.codes_start : t + LOOKAHEAD_CODES - s.codes_start] for (s, t), w in zip(work, starts)]
        n_max = self._bucket_codes(max(len(w) for w in windows))
        rows = self.bucket_rows(len(work))  # padding rows: code 0, all valid, output unused
        codes_np = np.zeros((rows, n_max), dtype=np.int64)
        for row, w in enumerate(windows):
            codes_np[row, : len(w)] = w
        # Host inputs go through pinned memory (runtime.transfer.to_device): a pageable copy would wait for
        # the device to drain first (and in one process with the engine, for its queued steps too).
        codes = to_device(torch.from_numpy(codes_np), self.device)
        lengths = [len(w) for w in windows] + [n_max] * (rows - len(work))
        num_valid = to_device(torch.tensor(lengths), self.device)
        mu_all = lane.encode(codes, num_valid)[: len(work)]  # [B, 80, 4 * n_max]

        new_frames = [_F * (t - s.flow_cursor) for s, t in work]
        t_max = _F * self._bucket_codes(max(new_frames) // _F)
        # Row b's new frames sit at mu_all[b, :, 4 * (cursor_b - start_b) + j]; padding rows repeat the last.
        offsets = to_device(torch.tensor([_F * (s.flow_cursor - w) for (s, _), w in zip(work, starts)]),
                            self.device)
        idx = (offsets[:, None] + torch.arange(t_max, device=self.device)).clamp(max=mu_all.shape[2] - 1)
        mu = torch.gather(mu_all, 2, idx[:, None, :].expand(-1, mu_all.shape[1], -1))  # [B, 80, T]
        cond = torch.zeros_like(mu)
        for row, (s, t) in enumerate(work):  # only sessions still inside their prompt (priming)
            f0, prompt_frames = _F * s.flow_cursor, _F * s.num_prompt_codes
            if f0 < prompt_frames:
                end = min(_F * t, prompt_frames)
                cond[row, :, : end - f0] = self._prompt_mel(s.voice)[:, f0:end].to(cond.dtype)
        seeds = [s.seed for s, _ in work]
        noise = batch_frame_noise(seeds, [_F * s.flow_cursor for s, _ in work], t_max, device=self.device,
                                  kernel=self.triton_kernels)
        speaker = torch.stack([s.speaker for s, _ in work])  # [B, 80]
        slots = to_device(torch.tensor([s.slot for s, _ in work]), self.device)
        valid = to_device(torch.tensor(new_frames), self.device)
        if lane.graphed and self.pool.generation != lane.pool_generation:
            lane.graphed[1].reset()  # the pool grew: graphs read its old tensors
            lane.pool_generation = self.pool.generation
        pad = self.bucket_rows(len(work)) - len(work)
        if pad:  # rows of zeros on the scratch slot, so the batch keeps a captured shape
            mu, cond, noise = (torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) for x in (mu, cond, noise))
            speaker = torch.cat([speaker, speaker.new_zeros(pad, speaker.shape[1])])
            slots = torch.cat([slots, slots.new_full((pad,), lane.scratch_slot)])
            valid = torch.cat([valid, valid.new_full((pad,), t_max)])
        mel, stacked = lane.flow_step(mu, speaker, cond, noise, slots, valid)  # mel [B, 80, T]
        self.pool.write_steps(slots, stacked)
        mel = mel.float()  # one conversion for all rows

        for row, (s, t) in enumerate(work):
            f0, f1 = _F * s.flow_cursor, _F * t
            first_gen = max(f0, _F * s.num_prompt_codes)  # prompt frames keep the real prompt mel
            if f1 > first_gen:
                assert s.mel_end == first_gen, (s.mel_end, first_gen)
                s.mel = torch.cat([s.mel, mel[row, :, first_gen - f0 : f1 - f0]], dim=1)
            s.flow_cursor = t
            keep_from = max(s.codes_start, t - self.history_codes)
            s.codes = s.codes[keep_from - s.codes_start :]
            s.codes_start = keep_from

    def _vocode(self, sessions: list[VocoderSession], plans: list[list[int]], lane: _Lane) -> list[np.ndarray]:
        """BigVGAN over each chunk's window; returns per session the samples that leave now.

        A chunk [a, e) (frames) whose session holds back h samples is vocoded over
        [a - ceil(h / 480) - left, e + right) (clipped to the mel history) and yields samples
        [480 a - h, 480 e): the held ones are recomputed and crossfaded, the last `overlap_samples` are held
        unless the chunk ends the stream (exact mode: h = 0 and nothing is held).
        """
        # (session index, first returned sample, chunk end frame, window start frame, window stop frame)
        rows: list[tuple[int, int, int, int, int]] = []
        for si, (s, ends) in enumerate(zip(sessions, plans)):
            a = s.emitted_frames
            for k, e in enumerate(ends):
                held = len(s.held) if k == 0 else self.overlap_samples
                start = max(s.mel_start, a - self._overlap_frames * (held > 0) - self.left_context)
                stop = min(s.mel_end, e + self.right_context)
                assert stop >= e, (stop, e)
                rows.append((si, a * HOP_LENGTH - held, e, start, stop))
                a = e
        # A window whose left edge lies a whole field before its first returned sample cannot feel that
        # edge, so such rows share one right-aligned (left-padded) batch; the right edge, which low-latency
        # chunks do feel, is then each row's own. Other rows run in groups of equal length (no padding).
        free: list[int] = []
        groups: dict[int, list[int]] = {}
        for r, (_, out0, _, start, stop) in enumerate(rows):
            if (
                self.left_context >= self.exact_left_context
                and start == out0 // HOP_LENGTH - self.left_context
            ):
                free.append(r)
            else:
                groups.setdefault(stop - start, []).append(r)
        batches = ([free] if free else []) + list(groups.values())
        pcm: list[np.ndarray] = [_EMPTY] * len(rows)
        for batch in batches:
            t_max = max(rows[r][4] - rows[r][3] for r in batch)
            if free and batch is batches[0]:  # left padding is free here: round up to a known window
                t_max = self._bucket_window(t_max)
            size = self.bucket_rows(len(batch))  # rows past the batch are silence, dropped
            mel = torch.zeros(size, sessions[0].mel.shape[0], t_max, device=self.device)  # [B, 80, T]
            for row, r in enumerate(batch):
                s, (_, _, _, start, stop) = sessions[rows[r][0]], rows[r]
                mel[row, :, t_max - (stop - start) :] = s.mel[:, start - s.mel_start : stop - s.mel_start]
            wav = _to_host(lane.generate(mel.to(self.dtype))[:, 0, :])  # [B, T * 480]
            assert wav.shape[1] == t_max * HOP_LENGTH, (wav.shape, t_max)
            for row, r in enumerate(batch):
                _, out0, end, start, stop = rows[r]
                shift = (t_max - (stop - start) - start) * HOP_LENGTH  # absolute sample -> column
                pcm[r] = wav[row, out0 + shift : end * HOP_LENGTH + shift]
        parts: list[list[np.ndarray]] = [[] for _ in sessions]
        for (si, _, end, _, _), new in zip(rows, pcm):
            s = sessions[si]
            is_stream_end = end == _F * s.num_codes and s.flow_cursor == s.num_codes
            hold = 0 if is_stream_end else self.overlap_samples
            ready, s.held = join_chunk(s.held, new, self._fade_in, self._fade_out, hold)
            parts[si].append(ready)
            s.num_samples_emitted += len(ready)
            s.emitted_frames = end
            s.num_chunks += 1
        for s in sessions:
            keep_from = max(s.mel_start, s.emitted_frames - self._overlap_frames - self.left_context)
            s.mel = s.mel[:, keep_from - s.mel_start :]
            s.mel_start = keep_from
        return [p[0] if len(p) == 1 else np.concatenate(p) for p in parts]


def _to_host(x: torch.Tensor) -> np.ndarray:
    """A float32 numpy copy of x. From a GPU through page-locked memory: a pageable copy of a 256-stream
    step's PCM (66 MB) ran at ~1.5 GB/s on the H200 machine (bench/results/vocoder-flowcl-h200/). The pinned
    block returns to PyTorch's host cache once the array is dropped (callers copy what they keep)."""
    x = x.float()
    if x.device.type != "cuda":
        return x.cpu().numpy()
    host = torch.empty(x.shape, dtype=torch.float32, pin_memory=True)
    host.copy_(x, non_blocking=True)
    torch.cuda.current_stream(x.device).synchronize()
    return host.numpy()


def build_for_serving(
    preset: str,
    *,
    cuda_graphs: bool = False,
    bucket_shapes: bool = False,
    reserved_sessions: int = 0,
    warmup_rows: Sequence[int] = (),
    chunk_schedule_codes: Sequence[int] | None = None,
    light_load_schedule_codes: Sequence[int] | None = None,
    light_load_max_sessions: int = 1,
    fast_lane_code_budget: int | None = None,
    memory_cap_bytes: int | None = None,
    graphs_after_warmup: bool = True,
    eager_warmup_rows: Sequence[int] = (),
    check_matmuls: bool | None = None,
    **from_preset: object,
) -> tuple[StreamingVocoder, dict[str, float]]:
    """A vocoder ready for traffic, as the vocoder deployment and bench/pipeline.py build it.

    `from_preset` kwargs build it (`chunk_schedule_codes` replaces the preset's low-latency chunk
    schedule; `light_load_schedule_codes` and `light_load_max_sessions` set the light-load one, see
    `StreamConfig`); then CUDA graphs (optionally with bucketed shapes), flow state for
    `reserved_sessions`, the default voice's priming (seed 0), and a `warm_up` over `warmup_rows`, and
    for the light-load schedule over those of them that light-load sessions alone can fill
    (`bucket_rows(light_load_max_sessions)` at most: in a step with other sessions, a light-load chunk
    pads to the main schedule's shapes).
    `fast_lane_code_budget`: a second lane at stream priority -1, above lane 0's (`add_lane`), for the batcher's
    fast lane, warmed up over the `warmup_rows` whose first chunks fit that budget.
    `memory_cap_bytes` caps this process's allocator on the vocoder's device before anything is built
    (runtime/device_memory.py; CUDA only). `graphs_after_warmup` False: `freeze_graphs()` after the warm-up,
    so shapes it did not capture run eagerly instead of being captured under traffic (needs `warmup_rows`).
    `eager_warmup_rows` (with `graphs_after_warmup` False): after the freeze, the same warm-up over these row
    counts, which runs their steps eagerly, so the first eager step of each shape under traffic does not pay
    for compiling and tuning its kernels (figures under "eager_"-prefixed keys).
    `check_matmuls`: run `check_products` first and refuse to build on a wrong product (None: on CUDA only,
    as the engine's `check_matmuls`).
    Returns the vocoder and the warm-up's figures (empty without one; lanes' and schedules' figures added up).
    """
    if (bucket_shapes or warmup_rows) and not cuda_graphs:
        raise ValueError("bucket_shapes and warmup_rows need cuda_graphs")
    if not graphs_after_warmup and not warmup_rows:
        raise ValueError("graphs_after_warmup=False needs warmup_rows (else no graph would ever be captured)")
    if eager_warmup_rows and graphs_after_warmup:
        raise ValueError("eager_warmup_rows needs graphs_after_warmup=False (else its steps would be captured)")
    cap_device_memory(str(from_preset.get("device", "cpu")), memory_cap_bytes)
    if chunk_schedule_codes is not None or light_load_schedule_codes is not None:
        cfg = from_preset.get("config") or VocoderConfig.preset(preset)
        assert isinstance(cfg, VocoderConfig)
        from_preset["config"] = cfg.with_schedules(chunk_schedule_codes, light_load_schedule_codes,
                                                   light_load_max_sessions)
    voc = StreamingVocoder.from_preset(preset, **from_preset)  # type: ignore[arg-type]
    if check_matmuls or (check_matmuls is None and voc.device.type == "cuda"):
        voc.check_products()
    if cuda_graphs:
        voc.use_cuda_graphs(bucket_shapes=bucket_shapes)
    if fast_lane_code_budget is not None:
        voc.add_lane(priority=-1)
    voc.reserve_sessions(reserved_sessions)
    warm = _warm_up_lanes(voc, warmup_rows, fast_lane_code_budget)
    voc.close(voc.open("default", seed=0))  # keeps the most common priming (warm_up's streams use it too)
    if not graphs_after_warmup:
        voc.freeze_graphs()
        if eager_warmup_rows:  # frozen: these steps run eagerly
            eager = _warm_up_lanes(voc, eager_warmup_rows, fast_lane_code_budget)
            warm.update({f"eager_{key}": value for key, value in eager.items()})
    return voc, warm


def _warm_up_lanes(voc: StreamingVocoder, warmup_rows: Sequence[int], fast_lane_code_budget: int | None
                   ) -> dict[str, float]:
    """`warm_up` over `warmup_rows` for each chunk schedule, on lane 0 and, for the rows whose first chunks fit
    `fast_lane_code_budget`, on the fast lane (see `build_for_serving`) -> the figures added up."""
    stream = voc.config.stream
    warm: dict[str, float] = {}
    for index, schedule in enumerate(voc.schedules if voc.is_low_latency else [None]):
        rows = list(warmup_rows)
        if index:  # the light-load schedule: steps of light-load sessions alone
            rows = [r for r in rows if r <= voc.bucket_rows(stream.light_load_max_sessions)]
        first = schedule[0] if schedule is not None else stream.first_chunk_codes
        fast_rows = [r for r in rows if fast_lane_code_budget is not None and r * first <= fast_lane_code_budget]
        for lane, lane_rows in ((0, rows), (1, fast_rows)):
            if lane_rows:
                figures = voc.warm_up(lane_rows, lane=lane, schedule=schedule)
                warm = {key: warm.get(key, 0) + value for key, value in figures.items()}
    return warm

