"""CUDA graphs of the decode step, one per batch-size bucket (as nano-vllm does).

A decode step (one new row per sequence) of b sequences runs in the smallest bucket B >= b: the inputs
are copied into static buffers, rows b..B-1 are padding (slot -1: nothing stored; context 1 over block
0: read and thrown away), the bucket's graph is replayed and the first b rows of its logits returned.
The whole step (embedding, all 40 layer instances with their KV stores and paged attention, both norms
and heads) is one replay, so a step costs no per-kernel launch overhead. Sampling runs right after it
on the returned logits. Without CUDA (`use_graphs=False`) the same padded path runs eagerly, which is
what CPU tests check.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from runtime.fast_forward import FastForward, StepInputs, max_blocks_for
from runtime.kv_cache import KVCache
from runtime.transfer import to_device

if TYPE_CHECKING:
    from runtime.model_runner import RowFeed

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
# What a bucket's rows past the step's batch hold: slot -1 (no K/V stored), a context of 1, zeros elsewhere.
PADDING = {"tokens": 0, "is_audio": False, "positions": 0, "slot_mapping": -1, "seq_lens": 1, "block_tables": 0}


def capture_step(
    forward: FastForward, step: StepInputs, kv_cache: KVCache, pool: tuple[int, int] | None, *, text: bool = True,
) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor | None, torch.Tensor]]:
    """Warm `forward(step, text=text)` up on a side stream, then capture it into a graph sharing `pool`
    -> (graph, its static (text, audio) logits; text None when `text` is False)."""
    device = kv_cache.k.device
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):  # compile / autotune kernels and create library handles outside capture
            forward(step, kv_cache, text=text)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: another thread of this process (a vocoder, say) may use CUDA meanwhile.
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        outputs = forward(step, kv_cache, text=text)
    return graph, outputs


class DecodeGraphRunner:
    """Runs decode steps through per-bucket CUDA graphs (or eagerly with the same padding)."""

    def __init__(
        self, forward: FastForward, kv_cache: KVCache, *, max_model_len: int,
        buckets: Sequence[int] = DEFAULT_BUCKETS, use_graphs: bool | None = None, audio_only: bool = True,
    ) -> None:
        """`audio_only`: also capture each bucket's audio-only step (`FastForward(text=False)`: no text
        head, for steps whose rows all sample in audio mode), which `run(text=False)` replays."""
        self.forward = forward
        self.audio_only = audio_only
        self.kv_cache = kv_cache
        self.device = kv_cache.k.device
        self.buckets = sorted({int(b) for b in buckets})
        assert self.buckets and self.buckets[0] >= 1
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.max_blocks = max_blocks_for(max_model_len, kv_cache.block_size)
        self.max_context = self.max_blocks * kv_cache.block_size
        largest = self.buckets[-1]
        dev = self.device
        # The inputs a replay reads live in one device buffer (typed views of it), so `run_host` fills a host
        # mirror and moves a step's inputs with one copy; the block tables come last, so a step copies only
        # the prefix its bucket reads.
        fields = (("tokens", torch.long, (largest,)), ("positions", torch.long, (largest,)),
                  ("slot_mapping", torch.long, (largest,)), ("seq_lens", torch.int32, (largest,)),
                  ("is_audio", torch.bool, (largest,)), ("block_tables", torch.int32, (largest, self.max_blocks)))
        offsets, size = {}, 0
        for name, dtype, shape in fields:
            offsets[name] = size
            size += -(-math.prod(shape) * dtype.itemsize // 16) * 16  # 16-byte aligned
        self._inputs = torch.zeros(size, dtype=torch.uint8, device=dev)
        pinned = dev.type == "cuda"
        self._host = torch.zeros(size, dtype=torch.uint8, pin_memory=pinned) if pinned else self._inputs
        self._host_np: dict[str, np.ndarray] = {}
        for name, dtype, shape in fields:
            start, n = offsets[name], math.prod(shape) * dtype.itemsize
            setattr(self, name, self._inputs[start:start + n].view(dtype).view(shape))
            self._host_np[name] = self._host[start:start + n].view(dtype).view(shape).numpy()
        self._tables_offset = offsets["block_tables"]
        # marks the last host-to-device copy of `run_host` (the mirror is not rewritten before it has run)
        self._staged = torch.cuda.Event() if pinned else None
        self._staged_pending = False
        self._reset_padding(0)
        for name, pad in PADDING.items():  # the host mirror starts as padding too
            self._host_np[name][:] = pad
        self.query_start = torch.arange(largest + 1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(largest, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.audio_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # bucket -> audio-only step
        self.audio_outputs: dict[int, torch.Tensor] = {}

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, batch: int) -> int:
        """Smallest bucket that holds `batch` sequences."""
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"decode batch {batch} outside 1..{self.max_batch}")
        return self.buckets[bisect.bisect_left(self.buckets, batch)]

    def _step(self, bucket: int) -> StepInputs:
        return StepInputs(
            tokens=self.tokens[:bucket], is_audio=self.is_audio[:bucket], positions=self.positions[:bucket],
            slot_mapping=self.slot_mapping[:bucket], block_tables=self.block_tables[:bucket],
            seq_lens=self.seq_lens[:bucket], query_start=self.query_start[: bucket + 1],
            logits_indices=self.logits_indices[:bucket], max_query_len=1,
            num_parts=self.forward.decode_num_parts(bucket, self.max_context, fp8=self.kv_cache.quantized),
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's graph, largest first, sharing one memory pool (no-op without graphs)."""
        if not self.use_graphs:
            return
        self._reset_padding(0)
        pool = None
        for bucket in reversed(self.buckets):
            graph, self.outputs[bucket] = capture_step(self.forward, self._step(bucket), self.kv_cache, pool)
            pool = graph.pool()
            self.graphs[bucket] = graph
            if self.audio_only:
                graph, (_, self.audio_outputs[bucket]) = capture_step(
                    self.forward, self._step(bucket), self.kv_cache, pool, text=False)
                self.audio_graphs[bucket] = graph
        torch.cuda.synchronize(self.device)

    def _reset_padding(self, start: int) -> None:
        """The static inputs' rows from `start` on hold PADDING."""
        for name, pad in PADDING.items():
            getattr(self, name)[start:].fill_(pad)

    @torch.inference_mode()
    def run(
        self, tokens: torch.Tensor, is_audio: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
        block_tables: torch.Tensor, seq_lens: torch.Tensor, *, text: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One decode step of b sequences -> (text_logits [b, Vt], audio_logits [b, Va]) (dtype: FastForward's).

        tokens, is_audio, positions, slot_mapping, seq_lens: [b]; block_tables [b, w] (w <= max blocks).
        `text=False`: an audio-only step (text logits None; the cache is written exactly as by a whole step).
        The returned logits live in the graph's static output: read them before the next `run`.
        """
        batch = tokens.shape[0]
        bucket = self.bucket_for(batch)
        width = self._check_width(block_tables.shape[1])
        self.tokens[:batch].copy_(tokens)
        self.is_audio[:batch].copy_(is_audio)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(slot_mapping)
        self.block_tables[:batch, :width].copy_(block_tables)
        self.seq_lens[:batch].copy_(seq_lens)
        self._reset_padding(batch)
        return self._replay(batch, bucket, text)

    def _check_width(self, width: int) -> int:
        """A step's block-table width, if the static table holds it."""
        if width > self.max_blocks:
            raise ValueError(f"block table of {width} blocks exceeds max_model_len ({self.max_blocks} blocks)")
        return width

    def _replay(self, batch: int, bucket: int, text: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Replay (or run eagerly) the bucket's step on the inputs in place -> the first `batch` rows."""
        if not text and bucket in self.audio_graphs:
            self.audio_graphs[bucket].replay()
            return None, self.audio_outputs[bucket][:batch]
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            text_logits, audio = self.outputs[bucket]
        else:
            text_logits, audio = self.forward(self._step(bucket), self.kv_cache, text=text)
        return (text_logits[:batch] if text and text_logits is not None else None), audio[:batch]

    @torch.inference_mode()
    def run_host(
        self, tokens: Sequence[int] | np.ndarray, is_audio: Sequence[bool] | np.ndarray,
        positions: Sequence[int] | np.ndarray, slot_mapping: Sequence[int] | np.ndarray,
        block_tables: Sequence[Sequence[int]], seq_lens: Sequence[int], *, text: bool = True,
        feed: RowFeed | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """`run` from host data (what the model runner has; block tables may differ in length): the step's
        inputs and the bucket's padding rows are written into a pinned host mirror of the input buffer and
        reach the GPU in one non-blocking copy, instead of a copy per tensor from pageable memory (each of
        which holds the host until it is done) plus a copy and a fill per static buffer on the GPU.
        `feed` then overwrites the rows whose inputs are on the device (`model_runner.RowFeed`)."""
        batch = len(seq_lens)
        bucket = self.bucket_for(batch)
        self._check_width(max(len(t) for t in block_tables))
        if self._staged_pending:
            self._staged.synchronize()  # the previous step's copy has read the mirror (normally long since)
        h = self._host_np
        for name, values in (("tokens", tokens), ("is_audio", is_audio), ("positions", positions),
                             ("slot_mapping", slot_mapping), ("seq_lens", seq_lens)):
            h[name][:batch] = values
            h[name][batch:] = PADDING[name]
        tables = h["block_tables"]
        tables[:bucket] = PADDING["block_tables"]
        for i, table in enumerate(block_tables):
            tables[i, :len(table)] = table
        if self._host is not self._inputs:
            end = self._tables_offset + bucket * self.max_blocks * 4
            self._inputs[:end].copy_(self._host[:end], non_blocking=True)
            self._staged.record()
            self._staged_pending = True
        if feed is not None:
            feed.apply(self.tokens, self.is_audio)
        return self._replay(batch, bucket, text)


# Prefill chunk buckets: every 64 rows up to 512, every 128 up to 1024, every 256 up to 2048, so a chunk pays
# for at most 63 rows or 25 % of padding. A prefill at these sizes is compute-bound, so padding rows cost as
# much as real ones; with doubling buckets a 512-token prompt behind a 128-token cached system prompt
# (384 new rows) ran as 512 rows. All graphs share one memory pool (the largest bucket's).
DEFAULT_PREFILL_BUCKETS = (*range(64, 513, 64), *range(640, 1025, 128), *range(1280, 2049, 256))


class PrefillGraphRunner:
    """CUDA graphs of a one-sequence prefill chunk (fresh prompt or a chunk after earlier pages), one per
    row-count bucket.

    A chunk of n rows runs in the smallest bucket B >= n as two sequences: the real one (rows 0..n-1,
    context `seq_len`) and a padding sequence of B - n rows (slot -1: nothing stored; context B - n over
    block 0: read and thrown away). Prefill is launch-bound in eager mode (hundreds of launches for
    ~12 ms of GPU work); one replay removes the host from the critical path.
    """

    def __init__(
        self, forward: FastForward, kv_cache: KVCache, *, max_model_len: int,
        buckets: Sequence[int] | None = None, use_graphs: bool | None = None, max_chunk_rows: int | None = None,
    ) -> None:
        """`buckets`: row counts to capture (None: DEFAULT_PREFILL_BUCKETS), kept up to the most rows a chunk can
        have, `max_model_len` or `max_chunk_rows` (the step budget), which becomes the top bucket where it falls
        between two: a bucket beyond it would be captured as a sequence longer than the block table holds
        (its kernel reads past the table), and never replayed."""
        self.forward = forward
        self.kv_cache = kv_cache
        self.device = kv_cache.k.device
        wanted = {int(b) for b in (DEFAULT_PREFILL_BUCKETS if buckets is None else buckets)}
        cap = min(max(wanted), max_model_len, max_chunk_rows or max_model_len)
        self.buckets = sorted({b for b in wanted if b < cap} | {cap})
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.max_blocks = max_blocks_for(max_model_len, kv_cache.block_size)
        largest, dev = self.buckets[-1], self.device
        self.tokens = torch.zeros(largest, dtype=torch.long, device=dev)  # [Nmax]
        self.is_audio = torch.zeros(largest, dtype=torch.bool, device=dev)
        self.positions = torch.zeros(largest, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(2, self.max_blocks, dtype=torch.int32, device=dev)  # [2, W]
        self.seq_lens = torch.ones(2, dtype=torch.int32, device=dev)  # [2]
        self.query_start = torch.zeros(3, dtype=torch.int32, device=dev)  # [3]
        self.logits_indices = torch.zeros(2, dtype=torch.long, device=dev)  # [2]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, n: int) -> int:
        """The bucket a chunk of n rows runs in: the smallest one >= n."""
        if not 1 <= n <= self.max_rows:
            raise ValueError(f"prefill chunk of {n} rows outside 1..{self.max_rows}")
        return self.buckets[bisect.bisect_left(self.buckets, n)]

    def _step(self, bucket: int) -> StepInputs:
        return StepInputs(
            tokens=self.tokens[:bucket], is_audio=self.is_audio[:bucket], positions=self.positions[:bucket],
            slot_mapping=self.slot_mapping[:bucket], block_tables=self.block_tables, seq_lens=self.seq_lens,
            query_start=self.query_start, logits_indices=self.logits_indices, max_query_len=bucket,
        )

    def _fill(self, n: int, bucket: int, seq_len: int) -> None:
        dev = self.device
        self.seq_lens.copy_(to_device(torch.tensor([seq_len, bucket - n], dtype=torch.int32), dev))
        self.query_start.copy_(to_device(torch.tensor([0, n, bucket], dtype=torch.int32), dev))
        self.logits_indices.copy_(to_device(torch.tensor([n - 1, bucket - 1], dtype=torch.long), dev))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, in one memory pool (no-op without graphs)."""
        if not self.use_graphs:
            return
        pool = None
        for bucket in reversed(self.buckets):
            self.slot_mapping.fill_(-1)
            self._fill(bucket, bucket, bucket)
            graph, self.outputs[bucket] = capture_step(self.forward, self._step(bucket), self.kv_cache, pool)
            pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def run(
        self, tokens: torch.Tensor, is_audio: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
        block_table: torch.Tensor, seq_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """n new rows of one sequence (its context `seq_len` includes them) -> logits of its last row,
        ([1, Vt], [1, Va]) (dtype: FastForward's: float32 from the one-row GEMV heads), views of the static
        output (read before the next `run`)."""
        n = tokens.shape[0]
        bucket = self.bucket_for(n)
        if block_table.shape[0] > self.max_blocks:
            raise ValueError(f"block table of {block_table.shape[0]} blocks exceeds {self.max_blocks}")
        self.tokens[:n].copy_(tokens)
        self.is_audio[:n].copy_(is_audio)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.tokens[n:bucket].zero_()
        self.is_audio[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.slot_mapping[n:bucket].fill_(-1)
        self.block_tables[0, : block_table.shape[0]].copy_(block_table)
        self._fill(n, bucket, seq_len)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            text, audio = self.outputs[bucket]
        else:
            text, audio = self.forward(self._step(bucket), self.kv_cache)
        return text[:1], audio[:1]
