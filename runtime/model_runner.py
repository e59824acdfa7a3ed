"""Turns a `SchedulerOutput` into one flat forward pass and samples the next rows.

`prepare` reads the sequences (block tables, rows) and builds every tensor the step needs, so
the engine can run it under its lock and then `execute` the forward without it.

Two forward paths compute the same function: the plain `model.forward` (default), and with
`fast_path` the fused-weight `FastForward` (runtime/fast_forward.py), whose decode-only steps go
through `DecodeGraphRunner` (CUDA graphs per batch-size bucket on CUDA, the same padded eager
call elsewhere) and whose one-sequence prefill chunks go through `PrefillGraphRunner` (CUDA graphs
per row-count bucket).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from runtime.attention import AttentionMetadata
from runtime.config import Row
from runtime.fused import FusedWeights
from runtime.kv_cache import KVCache
from runtime.modality import TEXT_MODE
from runtime.model import MossSpeechForCausalLM, split_rows
from runtime.sampling import LaunchedRows, RequestSampler, SamplingParams, launch_next_rows
from runtime.scheduler import SchedulerOutput
from runtime.sequence import PENDING_ROW
from runtime.transfer import to_device

# Decode steps for the graph runner keep their inputs on the host and move them in one copy
# (`DecodeGraphRunner.run_host`); False: device tensors per input, as before (bench/engine_loop.py A/B).
STAGED_DECODE_INPUTS = True
# the sampling settings of `run_largest_step`'s rows (text, audio): upstream's defaults, top-k and penalties on
DEFAULT_CHANNELS = (SamplingParams(), SamplingParams())


@dataclass
class ModelInput:
    """One step's flat batch, ready for the forward pass."""

    tokens: torch.Tensor  # [N] selected token per row
    is_audio: torch.Tensor  # [N] True where the row embeds its audio token
    positions: torch.Tensor  # [N]
    attn: AttentionMetadata
    sample_indices: torch.Tensor  # [K] index into the S sequences of those that sample this step
    sample_request_ids: list[str]  # [K]
    samplers: list[RequestSampler]  # [K]
    # a decode step for the graph runner: the tensors above stay on the host (`DecodeGraphRunner.run_host`
    # moves them in one copy) and every sequence samples (sample_indices = 0..S-1)
    host_decode: bool = False
    # (flat row index, request id) of the rows that are PENDING_ROW: their inputs come from a `RowFeed`
    pending_rows: list[tuple[int, str]] = field(default_factory=list)

    @property
    def needs_text_logits(self) -> bool:
        """Whether a row of this step samples in text mode; if none does, its text logits go unread
        (audio-mode rows overwrite their text token with MODALITY_PAD, runtime/sampling.py)."""
        return any(s.mode == TEXT_MODE for s in self.samplers)


@dataclass
class RowFeed:
    """Inputs of a step's rows that were sampled on the device and not read yet: row `dst[i]` of the step
    embeds `tokens[src[i]]` (`is_audio` likewise); `dst`, `src` None: rows 0..n-1 take 0..n-1."""

    tokens: torch.Tensor  # [S] long, on the device
    is_audio: torch.Tensor  # [S] bool
    dst: torch.Tensor | None = None  # [n] long
    src: torch.Tensor | None = None  # [n] long

    def apply(self, tokens: torch.Tensor, is_audio: torch.Tensor) -> None:
        """Write the fed rows into a step's `tokens` / `is_audio` (device tensors, in place, no wait)."""
        if self.dst is None:
            n = self.tokens.shape[0]
            tokens[:n].copy_(self.tokens)
            is_audio[:n].copy_(self.is_audio)
        else:
            assert self.src is not None
            tokens.index_copy_(0, self.dst, self.tokens.index_select(0, self.src))
            is_audio.index_copy_(0, self.dst, self.is_audio.index_select(0, self.src))


class ModelRunner:
    """Owns the model and the KV cache tensors; runs one scheduled step at a time."""

    def __init__(
        self, model: MossSpeechForCausalLM, kv_cache: KVCache, *, fast_path: bool = False,
        max_model_len: int = 4096, max_num_running: int = 64, weights: FusedWeights | None = None,
        audio_only_steps: bool = True, prefill_buckets: Sequence[int] | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        """`weights`: the fast path's fused (possibly FP8) weights when the caller made them already.
        `audio_only_steps` (fast path): decode steps in which no row samples in text mode skip the text head
        and what only feeds it (`FastForward(text=False)`); the sampled rows are the same either way.
        `prefill_buckets` (fast path on CUDA): the prefill graphs' row buckets (None: the runner's default), kept up
        to the largest chunk `max_model_len` and `max_num_batched_tokens` allow."""
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.k.device
        self.num_steps_by_path: Counter[str] = Counter()  # "plain", "fast", "graph", "prefill_graph"
        self.last_path = ""  # the path of the latest forward
        self.audio_only_steps = audio_only_steps
        self.num_audio_only_steps = 0  # forwards that skipped the text head
        self.fast = None
        self.graphs = None
        self.prefill_graphs = None
        if fast_path:
            from runtime.cuda_graph import DEFAULT_BUCKETS, DecodeGraphRunner, PrefillGraphRunner
            from runtime.fast_forward import FastForward
            from runtime.fused import fuse_model_weights

            self.fast = FastForward(weights if weights is not None else fuse_model_weights(model))
            buckets = sorted({b for b in DEFAULT_BUCKETS if b < max_num_running} | {max_num_running})
            self.graphs = DecodeGraphRunner(self.fast, kv_cache, max_model_len=max_model_len, buckets=buckets,
                                            audio_only=audio_only_steps)
            self.graphs.capture()  # no-op off CUDA
            if self.device.type == "cuda":  # off CUDA the plain fast call is simpler than padding
                self.prefill_graphs = PrefillGraphRunner(self.fast, kv_cache, max_model_len=max_model_len,
                                                         buckets=prefill_buckets,
                                                         max_chunk_rows=max_num_batched_tokens)
                self.prefill_graphs.capture()

    def prepare(self, out: SchedulerOutput) -> ModelInput:
        """Flatten the scheduled chunks (rows grouped by sequence, in chunk order)."""
        assert not out.is_empty
        rows: list[Row] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_indices: list[int] = []
        sample_request_ids: list[str] = []
        samplers: list[RequestSampler] = []
        pending_rows: list[tuple[int, str]] = []
        for i, chunk in enumerate(out.chunks):
            seq = chunk.seq
            end = chunk.start + chunk.num_tokens
            if seq.rows[end - 1] is PENDING_ROW:
                pending_rows.append((len(rows) + chunk.num_tokens - 1, seq.request_id))
            rows.extend(seq.rows[chunk.start : end])
            query_lens.append(chunk.num_tokens)
            seq_lens.append(end)
            block_tables.append(list(seq.block_table))
            if chunk.needs_sample:
                sample_indices.append(i)
                sample_request_ids.append(seq.request_id)
                samplers.append(seq.sampler)
        tokens, is_audio = split_rows(rows)  # [N], [N]
        host_decode = (STAGED_DECODE_INPUTS and self.graphs is not None and max(query_lens) == 1
                       and len(query_lens) <= self.graphs.max_batch and len(sample_indices) == len(query_lens))
        device = torch.device("cpu") if host_decode else self.device
        attn = AttentionMetadata.build(query_lens, seq_lens, block_tables, self.kv_cache.block_size, device,
                                       plain_tensors=self.fast is None)
        return ModelInput(
            tokens=to_device(tokens, device),
            is_audio=to_device(is_audio, device),
            positions=attn.positions(device),
            attn=attn,
            sample_indices=to_device(torch.tensor(sample_indices, dtype=torch.long), device),
            sample_request_ids=sample_request_ids,
            samplers=samplers,
            host_decode=host_decode,
            pending_rows=pending_rows,
        )

    @torch.inference_mode()
    def execute(self, inp: ModelInput) -> dict[str, Row]:
        """Forward the batch, then sample one row for each sequence that completed its known rows."""
        return self.sample(inp, self.forward(inp))

    @torch.inference_mode()
    def forward(self, inp: ModelInput, feed: RowFeed | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Launch the forward pass -> (text_logits [S, Vt], audio_logits [S, Va]); does not wait for the GPU.

        Text logits are None when the fast path skipped them (no row samples in text mode).
        `feed` gives the inputs of the step's PENDING_ROW rows (`inp.pending_rows`); running the same `inp`
        again (with its feed) recomputes the same step, the cache rows included.
        The logits may be views of a graph's static output: sample them before the next `forward`."""
        if inp.pending_rows and feed is None:
            raise ValueError(f"{len(inp.pending_rows)} row(s) of this step are pending and no feed gives them")
        return self._forward(inp, feed)

    @torch.inference_mode()
    def sample(self, inp: ModelInput, logits: tuple[torch.Tensor | None, torch.Tensor]) -> dict[str, Row | None]:
        """Sample the rows of `forward`'s logits (waits for the GPU when reading the sampled ids); None for a
        request whose logits had no valid draw (`LaunchedRows.complete`)."""
        return dict(zip(inp.sample_request_ids, self.launch_sample(inp, logits).complete()[0], strict=True))

    @torch.inference_mode()
    def launch_sample(
        self, inp: ModelInput, logits: tuple[torch.Tensor | None, torch.Tensor], keep: list[int] | None = None,
        *, next_inputs: bool = False,
    ) -> LaunchedRows:
        """Launch the sampling of `forward`'s logits without reading the ids (`LaunchedRows.complete` does).
        `keep`: the positions in `inp.samplers` to sample (None: all); `next_inputs`: also compute each new
        row's next-step input on the device (`LaunchedRows.next_tokens`, for a `RowFeed`)."""
        text_logits, audio_logits = logits
        samplers = inp.samplers
        if keep is not None and len(keep) < len(samplers):
            samplers = [samplers[k] for k in keep]
            index = to_device(torch.tensor(keep, dtype=torch.long), audio_logits.device)
            if not inp.host_decode:
                index = inp.sample_indices.index_select(0, index)
        elif not inp.host_decode:  # (a host decode step samples every sequence: nothing to select)
            index = inp.sample_indices
        else:
            index = None
        if index is not None:
            if text_logits is not None:
                text_logits = text_logits.index_select(0, index)  # [K, Vt]
            audio_logits = audio_logits.index_select(0, index)  # [K, Va]
        return launch_next_rows(text_logits, audio_logits, samplers, next_inputs=next_inputs)

    def run(self, out: SchedulerOutput) -> dict[str, Row]:
        """`prepare` then `execute`; returns the sampled row per request id."""
        return self.execute(self.prepare(out))

    @torch.inference_mode()
    def run_largest_step(self, num_rows: int, num_seqs: int) -> None:
        """Run the largest step the scheduler can form off the graphs: `num_rows` new rows over `num_seqs`
        fresh sequences (rows spread evenly, at least 2 each, so none is a decode row), every sequence
        sampling both channels; twice, the first step's logits and sampling alive during the second forward,
        as an asynchronous step leaves them (`run_step_shape`). Used by the engine at start-up (`EngineCore`),
        so that this step's activations either fit under the memory cap and stay reserved in the allocator,
        or fail there instead of in the middle of serving."""
        if not 2 <= 2 * num_seqs <= num_rows:
            raise ValueError(f"need 2 <= 2 x num_seqs <= num_rows, got {num_seqs} sequences of {num_rows} rows")
        self.run_step_shape([num_rows // num_seqs + (i < num_rows % num_seqs) for i in range(num_seqs)],
                            twice=True)

    def run_step_shape(self, query_lens: Sequence[int], context_lens: Sequence[int] | None = None, *,
                       twice: bool = False) -> str:
        """Run one step of this shape and sample it, with nothing of any request in it: sequence i has
        `context_lens[i]` tokens already in the cache (whatever its blocks hold) and `query_lens[i]` new rows;
        `twice`: a second forward while the first's logits and sampling are alive. Returns the path it took.
        Its K/V go to blocks 0, 1, ... (reused modulo the pool): call it before any sequence holds a block.
        The paths' step counts are left as they were."""
        context_lens = [0] * len(query_lens) if context_lens is None else list(context_lens)
        if len(context_lens) != len(query_lens) or min(query_lens, default=0) < 1 or min(context_lens) < 0:
            raise ValueError(f"need one context length >= 0 per query length >= 1, got {query_lens} and "
                             f"{context_lens}")
        block_size, num_blocks = self.kv_cache.block_size, self.kv_cache.num_blocks
        seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
        tables, next_block = [], 0
        for n in seq_lens:
            width = -(-n // block_size)
            tables.append([(next_block + j) % num_blocks for j in range(width)])
            next_block += width
        attn = AttentionMetadata.build(list(query_lens), seq_lens, tables, block_size, self.device,
                                       plain_tensors=self.fast is None)
        num_seqs, num_rows = len(query_lens), sum(query_lens)
        samplers = [RequestSampler([], *DEFAULT_CHANNELS, min_new_tokens=0, seed=i) for i in range(num_seqs)]
        inp = ModelInput(
            tokens=torch.zeros(num_rows, dtype=torch.long, device=self.device),
            is_audio=torch.zeros(num_rows, dtype=torch.bool, device=self.device),
            positions=attn.positions(self.device), attn=attn,
            sample_indices=torch.arange(num_seqs, device=self.device),
            sample_request_ids=[f"shape-step-{i}" for i in range(num_seqs)], samplers=samplers)
        counts, last_path = self.num_steps_by_path.copy(), self.last_path
        try:
            first = self.launch_sample(inp, self.forward(inp))
            path = self.last_path
            second = self.forward(inp) if twice else None  # alive while the first step's sampling completes
            first.complete()
            del second
        finally:
            self.num_steps_by_path, self.last_path = counts, last_path
        return path

    def _took(self, path: str) -> None:
        self.num_steps_by_path[path] += 1
        self.last_path = path

    def _forward(self, inp: ModelInput, feed: RowFeed | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        attn = inp.attn
        if feed is not None and not inp.host_decode:
            feed.apply(inp.tokens, inp.is_audio)
        if self.fast is None or self.graphs is None:
            self._took("plain")
            return self.model(inp.tokens, inp.is_audio, inp.positions, self.kv_cache, attn)
        from runtime.fast_forward import StepInputs, padded_block_tables

        batch = len(attn.query_lens)
        text = not self.audio_only_steps or inp.needs_text_logits
        if inp.host_decode or (max(attn.query_lens) == 1 and batch <= self.graphs.max_batch):
            self._took("graph")
            self.num_audio_only_steps += not text
            # Views of the graph's static outputs: `execute` reads them before the next step.
            if inp.host_decode:
                return self.graphs.run_host(
                    inp.tokens.numpy(), inp.is_audio.numpy(), inp.positions.numpy(), attn.slot_mapping.numpy(),
                    attn.block_tables, attn.seq_lens, text=text, feed=feed,
                )
            seq_lens = torch.tensor(attn.seq_lens, dtype=torch.int32)  # [S]
            return self.graphs.run(
                inp.tokens, inp.is_audio, inp.positions, attn.slot_mapping,
                to_device(padded_block_tables(attn.block_tables), self.device),
                to_device(seq_lens, self.device), text=text,
            )
        if (self.prefill_graphs is not None and batch == 1
                and attn.query_lens[0] <= self.prefill_graphs.max_rows):
            self._took("prefill_graph")
            table = torch.tensor(attn.block_tables[0], dtype=torch.int32)  # [W]
            return self.prefill_graphs.run(
                inp.tokens, inp.is_audio, inp.positions, attn.slot_mapping, to_device(table, self.device), attn.seq_lens[0]
            )
        self._took("fast")
        self.num_audio_only_steps += not text
        num_parts = (self.fast.decode_num_parts(batch, max(attn.seq_lens), fp8=self.kv_cache.quantized)
                     if max(attn.query_lens) == 1 else 1)
        step = StepInputs.from_metadata(inp.tokens, inp.is_audio, inp.positions, attn, num_parts=num_parts)
        return self.fast(step, self.kv_cache, text=text)
