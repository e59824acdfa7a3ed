"""Model-step benchmark: prefill of one prompt and decode steps at several batch sizes on the paged KV cache.

    python bench/engine.py --preset tiny --device cpu
    python bench/engine.py --preset full --random-weights --device cuda --dtype bfloat16
    python bench/engine.py --preset full --random-weights --device cuda --fast   # + the fast path (docs/gpu.md)

Outputs are verified before anything is timed (paged logits == no-cache reference, finite logits, greedy
tokens reproducible); then the script prints ONE JSON line. Decode rows report achieved GB/s (weight
bytes read per step / step time) against the device's memory-bandwidth roofline when it is known.

To add a faster variant (CUDA graphs, a Triton attention kernel, FP8 weights), register a function in
`VARIANTS` that returns a `step(attn) -> logits` callable for a prepared decode batch; each variant
becomes extra rows in "decode" with its own "variant" name. `--fast` adds, on the same model in the same
run, everything in bench/fast_bench.py (copy-bandwidth roofline, Triton kernel checks, float32 and bf16
greedy equality, decode CUDA graphs bf16/FP8, prefill, FP8 drift, the 24 GB profile) under "fast_path",
and the issue's targets against the measurements under "done_when".
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.attention import AttentionMetadata
from runtime.config import MODALITY_PAD_ID, ModelConfig, Row
from runtime.kv_cache import KVCache, allocate_kv_cache, kv_bytes_per_block
from runtime.model import MossSpeechForCausalLM, build_model, split_rows

# Peak HBM bandwidth in GB/s (vendor figures) for the roofline ratio; unknown devices report null.
PEAK_GBPS = {"H200": 4800.0, "H100 80GB HBM3": 3350.0, "H100 PCIe": 2000.0, "A100-SXM4-80GB": 2039.0,
             "A800": 2039.0, "RTX 4090": 1008.0, "L40S": 864.0}
# Dense bf16 tensor-core peak in TFLOP/s (vendor figures) for the prefill compute roofline.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "A800": 312.0}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BenchError(RuntimeError):
    """Verification failed: the numbers would be meaningless, so nothing is timed."""


def nearest_rank(ordered: list[float], q: float) -> float:
    """The q-quantile (0 < q <= 1) of sorted samples by the nearest-rank method: the ceil(q * n)-th smallest."""
    return ordered[min(len(ordered), max(1, math.ceil(q * len(ordered)))) - 1]


@dataclass(frozen=True)
class Timing:
    """Repetition times of one measured operation, in milliseconds."""

    samples_ms: list[float]

    @property
    def median_ms(self) -> float:
        """Median repetition time."""
        return statistics.median(self.samples_ms)

    @property
    def p10_ms(self) -> float:
        """10th percentile (nearest rank) repetition time."""
        return nearest_rank(sorted(self.samples_ms), 0.1)

    @property
    def p90_ms(self) -> float:
        """90th percentile (nearest rank) repetition time."""
        return nearest_rank(sorted(self.samples_ms), 0.9)


def time_fn(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> Timing:
    """Run `fn` `warmup` times untimed, then `reps` times timed (CUDA events on cuda)."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return Timing(samples)


class BlockPool:
    """Sequential block ids for the benchmark's sequences."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.next_block = 0

    def table(self, num_positions: int) -> list[int]:
        """A fresh block table covering `num_positions`."""
        needed = math.ceil(num_positions / self.cache.block_size)
        if self.next_block + needed > self.cache.num_blocks:
            raise BenchError(f"KV cache too small: need {self.next_block + needed} blocks")
        table = list(range(self.next_block, self.next_block + needed))
        self.next_block += needed
        return table


def make_rows(length: int, seed: int) -> list[Row]:
    """A prompt of text and audio rows (deterministic)."""
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(0, 151643, (length,), generator=gen).tolist()
    audio = torch.randint(0, 16384, (length,), generator=gen).tolist()
    return [(MODALITY_PAD_ID, a) if i % 3 == 2 else (t, 512) for i, (t, a) in enumerate(zip(text, audio))]


def run_step(
    model: MossSpeechForCausalLM, cache: KVCache, work: list[tuple[list[Row], int, list[int]]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One paged step; work = (rows so far, new rows, block table) per sequence."""
    device = cache.k.device
    new_rows = [row for rows, n, _ in work for row in rows[len(rows) - n :]]
    tokens, is_audio = split_rows(new_rows)
    attn = AttentionMetadata.build(
        [n for _, n, _ in work], [len(r) for r, _, _ in work], [t for _, _, t in work], cache.block_size, device
    )
    return model(tokens.to(device), is_audio.to(device), attn.positions(device), cache, attn)


def greedy_decode(model: MossSpeechForCausalLM, cache: KVCache, pool: BlockPool, prompt: list[Row], steps: int) -> list[Row]:
    """Greedy rows after `prompt` (every other row forced to audio so both embedding tables are used)."""
    rows = list(prompt)
    table = pool.table(len(prompt) + steps)
    text, audio = run_step(model, cache, [(rows, len(rows), table)])
    for i in range(steps):
        a = int(audio[0].argmax())
        rows.append((MODALITY_PAD_ID, a) if i % 2 == 0 else (int(text[0].argmax()), a))
        text, audio = run_step(model, cache, [(rows, 1, table)])
    return rows[len(prompt) :]


def verify(model: MossSpeechForCausalLM, cache: KVCache, dtype: torch.dtype, prompt_len: int) -> dict:
    """Paged prefill vs reference, shapes, finiteness and greedy reproducibility; raises BenchError."""
    config = model.config
    pool = BlockPool(cache)
    prompt = make_rows(prompt_len, seed=1)
    text, audio = run_step(model, cache, [(prompt, prompt_len, pool.table(prompt_len))])
    if text.shape != (1, config.vocab_size) or audio.shape != (1, config.audio_vocab_size):
        raise BenchError(f"logits shapes {tuple(text.shape)}, {tuple(audio.shape)}")
    if not (torch.isfinite(text).all() and torch.isfinite(audio).all()):
        raise BenchError("non-finite logits")
    ref_text, ref_audio = model.reference_forward(prompt)
    diff = max(float((text[0] - ref_text[-1]).abs().max()), float((audio[0] - ref_audio[-1]).abs().max()))
    scale = max(float(ref_text[-1].abs().max()), float(ref_audio[-1].abs().max()), 1.0)
    tolerance = 1e-3 * scale if dtype == torch.float32 else 0.1 * scale
    if diff > tolerance:
        raise BenchError(f"paged logits differ from the reference by {diff:.3g} (tolerance {tolerance:.3g})")
    short = prompt[:32]
    first = greedy_decode(model, cache, pool, short, steps=8)
    second = greedy_decode(model, cache, pool, short, steps=8)
    if first != second:
        raise BenchError(f"greedy decode not reproducible: {first} vs {second}")
    return {"paged_vs_reference_max_abs_diff": diff, "tolerance": tolerance, "greedy_rows": first}


def eager_variant(model: MossSpeechForCausalLM, cache: KVCache, tokens: torch.Tensor, is_audio: torch.Tensor,
                  positions: torch.Tensor) -> Callable[[AttentionMetadata], object]:
    """The plain PyTorch forward on the paged cache."""
    return lambda attn: model(tokens, is_audio, positions, cache, attn)


VARIANTS: dict[str, Callable[..., Callable[[AttentionMetadata], object]]] = {"eager": eager_variant}


def weight_bytes_per_step(model: MossSpeechForCausalLM, batch: int) -> int:
    """Bytes of weights one decode step reads: every matrix and norm, but only `batch` embedding rows."""
    total = 0
    for name, p in model.named_parameters():
        if name in ("model.embed_tokens.weight", "model.audio_embed.weight"):
            continue
        total += p.numel() * p.element_size()
    return total + batch * model.config.hidden_size * next(model.parameters()).element_size()


def prefill_flops(config: ModelConfig, prompt_len: int) -> float:
    """Matmul FLOPs of one prefill: every layer instance's projections and MLP for all rows, causal
    attention scores and values, and both heads for the last row only."""
    h, d = config.hidden_size, config.head_dim
    q_dim, kv_dim = config.num_attention_heads * d, config.num_key_value_heads * d
    per_row = 2 * (h * q_dim + 2 * h * kv_dim + q_dim * h + 3 * h * config.intermediate_size)
    attention = 2 * 2 * q_dim * prompt_len * (prompt_len + 1) / 2  # QK^T and PV over the causal triangle
    heads = 2 * h * (config.vocab_size + config.audio_vocab_size)
    return config.num_layer_instances * (per_row * prompt_len + attention) + heads


def device_name(device: torch.device) -> str:
    """Human-readable device name for the JSON line."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def peak_gbps(name: str) -> float | None:
    """Known peak memory bandwidth of the named device, None when unknown."""
    return next((v for k, v in PEAK_GBPS.items() if k in name), None)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=["tiny", "full"], default="tiny")
    p.add_argument("--random-weights", action="store_true", help="required for full: no checkpoint is read")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default float32 on cpu, bfloat16 on cuda")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--variants", default="eager", help=f"comma list of {sorted(VARIANTS)}")
    p.add_argument("--warmup", type=int, default=None, help="default 5 on cuda, 1 on cpu")
    p.add_argument("--reps", type=int, default=None, help="default 30 on cuda, 5 on cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also append the JSON line to this file")
    p.add_argument("--fast", action="store_true",
                   help="cuda: also measure the fast path (bench/fast_bench.py) on the same model in the same run")
    p.add_argument("--fast-batch-sizes", default="1,8,32,64,128")
    p.add_argument("--launch-variants", default="pdl,tails2,pdl+tails2",
                   help="--fast: launch options timed beside the plain graphs (bench/fast_bench.py)")
    p.add_argument("--max-model-len", type=int, default=1024, help="fast path: block-table width of the graphs")
    p.add_argument("--rounds", type=int, default=3,
                   help="fast path: interleaved rounds of --reps replays per decode graph (bench/fast_bench.py)")
    p.add_argument("--skip-24gb-profile", action="store_true")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.fast and not args.device.startswith("cuda"):
        p.error("--fast needs a cuda device (Triton kernels, CUDA graphs)")
    if args.preset == "full" and not args.random_weights:
        p.error("--preset full needs --random-weights (this benchmark never reads a checkpoint)")
    return args


def main(argv: list[str]) -> dict:
    """Build, verify, time; print and return the JSON result."""
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    on_cuda = device.type == "cuda"
    warmup = args.warmup if args.warmup is not None else (5 if on_cuda else 1)
    reps = args.reps if args.reps is not None else (30 if on_cuda else 5)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    config = ModelConfig.preset(args.preset)

    model = build_model(config, seed=args.seed, device=device, dtype=dtype)  # built in place on the device
    block = args.block_size
    per_seq_blocks = math.ceil((max(args.prompt_len, args.context_len) + 1) / block)
    num_blocks = (max(batch_sizes) + 4) * per_seq_blocks + 16
    cache = allocate_kv_cache(config, num_blocks, block, device, dtype)
    verification = verify(model, cache, dtype, args.prompt_len)

    # Prefill: one prompt of prompt_len rows into fresh blocks (the same blocks each repetition).
    pool = BlockPool(cache)
    prompt = make_rows(args.prompt_len, seed=2)
    tokens, is_audio = (t.to(device) for t in split_rows(prompt))
    table = pool.table(args.prompt_len)
    prefill_attn = AttentionMetadata.build([args.prompt_len], [args.prompt_len], [table], block, device)
    positions = prefill_attn.positions(device)
    prefill = time_fn(lambda: model(tokens, is_audio, positions, cache, prefill_attn), device, warmup, reps)

    # Decode: batch B, each sequence with context_len rows already cached (contents irrelevant to speed;
    # the blocks hold the verification / prefill data or zeros), one new row at position context_len.
    decode_rows = []
    for b in batch_sizes:
        pool = BlockPool(cache)
        tables = [pool.table(args.context_len + 1) for _ in range(b)]
        rows = make_rows(b, seed=3 + b)
        tok, aud = (t.to(device) for t in split_rows(rows))
        pos = torch.full((b,), args.context_len, dtype=torch.long, device=device)
        query_lens, seq_lens = [1] * b, [args.context_len + 1] * b
        attn = AttentionMetadata.build(query_lens, seq_lens, tables, block, device)
        build_time = time_fn(
            lambda q=query_lens, s=seq_lens, t=tables: AttentionMetadata.build(q, s, t, block, device),
            device, warmup, reps,
        )
        wbytes = weight_bytes_per_step(model, b)
        kv_read = b * (args.context_len + 1) * kv_bytes_per_block(config, 1, dtype)
        for variant in args.variants.split(","):
            step = VARIANTS[variant](model, cache, tok, aud, pos)
            timing = time_fn(lambda step=step, attn=attn: step(attn), device, warmup, reps)
            seconds = timing.median_ms / 1e3
            decode_rows.append({
                "variant": variant, "batch": b, "context_len": args.context_len,
                "median_ms": round(timing.median_ms, 3), "p90_ms": round(timing.p90_ms, 3),
                "tokens_per_s": round(b / seconds, 1),
                "weight_gbps": round(wbytes / seconds / 1e9, 1),
                "weight_plus_kv_gbps": round((wbytes + kv_read) / seconds / 1e9, 1),
                "metadata_build_median_ms": round(build_time.median_ms, 3),
            })

    name = device_name(device)
    peak = peak_gbps(name) if on_cuda else None
    peak_tflops = next((v for k, v in PEAK_TFLOPS.items() if k in name), None) if on_cuda else None
    tflops = prefill_flops(config, args.prompt_len) / (prefill.median_ms / 1e3) / 1e12
    for row in decode_rows:
        row["weight_roofline_fraction"] = round(row["weight_gbps"] / peak, 3) if peak else None
    result = {
        "bench": "engine",
        "command": shlex.join(["python", sys.argv[0], *argv]),
        "preset": args.preset, "device": str(device), "device_name": name, "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__, "num_params": sum(p.numel() for p in model.parameters()),
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "kv_bytes_per_token": kv_bytes_per_block(config, 1, dtype), "block_size": block,
        "warmup": warmup, "reps": reps, "peak_gbps": peak, "verification": verification,
        "prefill": {"prompt_len": args.prompt_len, "median_ms": round(prefill.median_ms, 3),
                    "p90_ms": round(prefill.p90_ms, 3),
                    "tokens_per_s": round(args.prompt_len / (prefill.median_ms / 1e3), 1),
                    "tflops": round(tflops, 3),
                    "tflops_roofline_fraction": round(tflops / peak_tflops, 3) if peak_tflops else None},
        "decode": decode_rows,
    }
    if args.fast:
        from bench.fast_bench import run_fast, summarize

        del cache
        torch.cuda.empty_cache()
        fast_args = argparse.Namespace(
            batch_sizes=args.fast_batch_sizes, context_len=args.context_len, prompt_len=args.prompt_len,
            block_size=block, max_model_len=args.max_model_len, reps=reps, skip_profile=args.skip_24gb_profile,
            launch_variants=args.launch_variants, rounds=args.rounds,
        )
        result["fast_path"] = run_fast(model, fast_args)
        result["done_when"] = summarize(result["fast_path"])
        print(json.dumps(result["done_when"], indent=1), file=sys.stderr)
    line = json.dumps(result)
    print(line)
    if args.out is not None:
        with args.out.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
    return result


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except BenchError as exc:
        print(f"verification failed: {exc}", file=sys.stderr)
        sys.exit(1)
