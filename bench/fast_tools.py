"""Helpers of bench/fast_bench.py: timing, rows, block ids, step functions, kernel profiles, GEMV timings."""
from __future__ import annotations

import contextlib
import functools
import json
import math
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.engine import Timing, time_fn
from runtime.attention import AttentionMetadata
from runtime.config import MODALITY_PAD_ID, Row
from runtime.cuda_graph import DecodeGraphRunner
from runtime.fast_forward import FastForward, StepInputs
from runtime.fp8 import linear, quantize_weight
from runtime.kv_cache import KVCache
from runtime.model import MossSpeechForCausalLM, split_rows

Logits = tuple[torch.Tensor, torch.Tensor]
# [N, K] of the full model's layer matrices and heads
MATRIX_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
                 "audio_head": (16512, 4096), "text_head": (151680, 4096)}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def emit(result: dict, out: Path | None) -> None:
    """Print the result as one JSON line; also write it, indented, to `out` when given."""
    print(json.dumps(result))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")


def bench_result(bench: str, argv: list[str], device: torch.device, *, copy: bool = True, **fields: object) -> dict:
    """A bench's JSON head: its name, the exact command (`python bench/<bench>.py ARGS`), the device, torch's
    version and, with `copy`, the copy bandwidth measured now; then `fields`."""
    head: dict = {"bench": bench, "command": shlex.join(["python", f"bench/{bench}.py", *argv]),
                  "device_name": torch.cuda.get_device_name(device), "torch": torch.__version__}
    if copy:
        head["copy_gbps"] = round(copy_bandwidth_gbps(device), 1)
    return head | fields


@contextlib.contextmanager
def overridden(options: dict[str, Any], **values: Any) -> Iterator[None]:
    """Set keys of a module's options dict (runtime.fp8.OPTIONS, flow_fused.SPLIT_OPTIONS, ...) for the block,
    then put the old values back."""
    saved = {key: options[key] for key in values}
    options.update(values)
    try:
        yield
    finally:
        options.update(saved)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, asserting the shape and that every value is finite."""
    assert got.shape == want.shape and bool(torch.isfinite(got).all())
    return (got.float() - want).abs().max().item() / want.abs().max().item()


def sweep_tiles(tiles_list: list[tuple], calls_for: Callable[[tuple], list[Callable[[], torch.Tensor]]],
                want: torch.Tensor, nbytes: int | None = None, tol: float = 1e-2) -> list[dict]:
    """Each candidate's calls (`calls_for(tiles)`): the first one's output checked against `want` (relative
    error under `tol`), then all timed back to back in one CUDA graph -> per candidate {"tiles", "us",
    "rel_err"} (and "gbps" of `nbytes` per call), or {"tiles", "error"} for one that failed or did not build."""
    tried = []
    for tiles in tiles_list:
        fns = calls_for(tiles)
        try:
            err = rel_err(fns[0](), want)
            assert err < tol, err
            us = graph_us_per_call(fns)
        except Exception as exc:  # noqa: BLE001 - a tile that does not compile or fit is reported
            tried.append({"tiles": tiles, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            continue
        entry = {"tiles": tiles, "us": round(us, 2), "rel_err": round(err, 5)}
        if nbytes is not None:
            entry["gbps"] = round(nbytes / us / 1e3, 1)
        tried.append(entry)
    return tried


def _summary(samples_ms: list[float]) -> dict:
    """Median / p10 / p90 (nearest rank, as `time_ms`) of timed calls."""
    timing = Timing(samples_ms)
    return {"median_ms": round(timing.median_ms, 4), "p10_ms": round(timing.p10_ms, 4),
            "p90_ms": round(timing.p90_ms, 4)}


def _timing_device(device: torch.device | None) -> torch.device:
    """`device`, by default the current CUDA device."""
    return device if device is not None else torch.device("cuda", torch.cuda.current_device())


def time_ms(fn: Callable[[], object], warmup: int, reps: int, device: torch.device | None = None) -> dict:
    """Median / p10 / p90 of `reps` timed calls after `warmup` untimed ones: CUDA events on a CUDA device (by
    default the current one), wall clock on the CPU."""
    return _summary(time_fn(fn, _timing_device(device), warmup, reps).samples_ms)


def time_interleaved(
    fns: dict[str, Callable[[], object]], warmup: int, reps: int, rounds: int, device: torch.device | None = None
) -> dict[str, dict]:
    """`time_ms` of each function in `rounds` rounds, the order reversed every other round, so that a drift of
    the device over the sequence (clocks, heat) reaches every function alike -> per name: median / p10 / p90
    of all its timed calls pooled, and each round's median (`round_medians_ms`)."""
    dev = _timing_device(device)
    names = list(fns)
    samples: dict[str, list[float]] = {n: [] for n in names}
    medians: dict[str, list[float]] = {n: [] for n in names}
    for rnd in range(rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            got = time_fn(fns[name], dev, warmup, reps)
            samples[name] += got.samples_ms
            medians[name].append(round(got.median_ms, 4))
    return {n: {**_summary(samples[n]), "round_medians_ms": medians[n]} for n in names}


def copy_bandwidth_gbps(device: torch.device, gib: float = 4.0) -> float:
    """Device-to-device copy rate, bytes read + written (the memory roofline of this run)."""
    n = int(gib * 2**30) // 2
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = time_ms(lambda: dst.copy_(src), 3, 20)["median_ms"]
    return 2 * n * 2 / (t / 1e3) / 1e9


def make_rows(length: int, seed: int) -> list[Row]:
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(0, 151643, (length,), generator=gen).tolist()
    audio = torch.randint(0, 16384, (length,), generator=gen).tolist()
    return [(MODALITY_PAD_ID, a) if i % 3 == 2 else (t, 512) for i, (t, a) in enumerate(zip(text, audio))]


class Blocks:
    """Sequential block ids."""

    def __init__(self, start: int = 0) -> None:
        self.next = start

    def take(self, positions: int, block_size: int) -> list[int]:
        n = math.ceil(positions / block_size)
        self.next += n
        return list(range(self.next - n, self.next))


def plain_inputs(rows: list[Row], work: list[tuple[int, int, list[int]]], block_size: int, device: torch.device):
    """work = (query_len, seq_len, table) per sequence; rows are the N new rows."""
    tokens, is_audio = split_rows(rows)
    attn = AttentionMetadata.build([w[0] for w in work], [w[1] for w in work], [w[2] for w in work],
                                   block_size, device)
    return tokens.to(device), is_audio.to(device), attn.positions(device), attn


class DecodeSetup:
    """The full random-weight model ready for captured decode steps: fused bf16 weights (and their FP8 twins,
    every matrix, with `fp8`), a KV cache of random values and, per batch size, the graph runner's inputs
    for that many sequences of `context_len` earlier tokens (`inputs[b]`, as `DecodeGraphRunner.run` takes
    them). Shared by bench/decode_ab.py and bench/gemv_tune.py."""

    def __init__(self, batches: list[int], context_len: int = 512, fp8: bool = True, block_size: int = 16) -> None:
        from runtime.config import ModelConfig
        from runtime.fused import fuse_model_weights, with_fp8
        from runtime.kv_cache import allocate_kv_cache
        from runtime.model import build_model

        device = torch.device("cuda")
        self.context_len = context_len
        model = build_model(ModelConfig.preset("full"), seed=0, device=device, dtype=torch.bfloat16)
        self.config = model.config
        self.weights = {"bf16": fuse_model_weights(model)}
        if fp8:
            self.weights["fp8"] = with_fp8(self.weights["bf16"], "all")
        per_seq = (context_len + 32) // block_size + 1
        self.cache = allocate_kv_cache(self.config, (sum(batches) + 4) * per_seq, block_size, device,
                                       torch.bfloat16)
        self.cache.k.normal_(0, 1)
        self.cache.v.normal_(0, 1)
        blocks = Blocks()
        self.inputs = {}
        for b in sorted(set(batches)):
            tables = [blocks.take(context_len + 1, block_size) for _ in range(b)]
            tok, aud, pos, attn = plain_inputs(make_rows(b, 100 + b), [(1, context_len + 1, t) for t in tables],
                                               block_size, device)
            self.inputs[b] = (tok, aud, pos, attn.slot_mapping, torch.tensor(tables, dtype=torch.int32, device=device),
                              torch.full((b,), context_len + 1, dtype=torch.int32, device=device))


def greedy(step: Callable[[list[Row], int], tuple[torch.Tensor, torch.Tensor]], prompt: list[Row], n: int):
    rows = list(prompt)
    text, audio = step(rows, len(rows))
    for i in range(n):
        a = int(audio[0].argmax())
        rows.append((MODALITY_PAD_ID, a) if i % 2 == 0 else (int(text[0].argmax()), a))
        text, audio = step(rows, 1)
    return rows[len(prompt):]


def logit_compare(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """Top-1 agreement and max |log p| difference per head (b is the reference)."""
    res = {}
    for name, x, y in (("text", a[0], b[0]), ("audio", a[1], b[1])):
        lx, ly = x.float().log_softmax(-1), y.float().log_softmax(-1)
        res[name] = {"top1_agree": float((x.argmax(-1) == y.argmax(-1)).float().mean()),
                     "max_abs_logprob_diff": float((lx - ly).abs().max()),
                     "max_abs_logit_diff": float((x - y).abs().max()), "rows": int(x.shape[0])}
    return res



def plain_stepper(model: MossSpeechForCausalLM, cache: KVCache, table: list[int]):
    """step(rows, n) through the plain model: the last n rows are new."""
    bs, device = cache.block_size, cache.k.device

    def step(rows: list[Row], n: int) -> Logits:
        tok, aud, pos, attn = plain_inputs(rows[len(rows) - n:], [(n, len(rows), table)], bs, device)
        return model(tok, aud, pos, cache, attn)
    return step


def graph_stepper(fast: FastForward, runner: DecodeGraphRunner, cache: KVCache, table: list[int]):
    """step(rows, n): prefill through the fast path (eager), decode rows through the graph runner."""
    bs, device = cache.block_size, cache.k.device

    def step(rows: list[Row], n: int) -> Logits:
        tok, aud, pos, attn = plain_inputs(rows[len(rows) - n:], [(n, len(rows), table)], bs, device)
        if n > 1:
            return fast(StepInputs.from_metadata(tok, aud, pos, attn), cache)
        tables = torch.tensor([table], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([len(rows)], dtype=torch.int32, device=device)
        return runner.run(tok, aud, pos, attn.slot_mapping, tables, seq_lens)
    return step


def greedy_report(want: list[Row], got: list[Row]) -> dict:
    return {"steps": len(want), "plain": want, "fast": got, "equal": want == got,
            "first_mismatch": next((i for i, (x, y) in enumerate(zip(want, got)) if x != y), None)}


def kernel_table(fn: Callable[[], object], steps: int = 3, top: int = 16) -> dict:
    """GPU time per step by kernel name (torch.profiler / CUPTI), largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0.0)
        rows.append({"name": e.key[:100], "us_per_step": round(t / steps, 1), "calls_per_step": e.count / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return {"total_us_per_step": round(sum(r["us_per_step"] for r in rows), 1),
            "launches_per_step": sum(r["calls_per_step"] for r in rows), "top": rows[:top]}


def graph_us_per_call(calls: list[Callable[[], object]], stream: torch.cuda.Stream | None = None) -> float:
    """Capture the calls back to back in one CUDA graph; replay time / number of calls, in us. `stream`: warm
    up and capture on it (default: warm up on the current stream, capture on PyTorch's capture stream)."""
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # None: the current stream
        for c in calls:
            c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for c in calls:
            c()
    return time_ms(graph.replay, 3, 20)["median_ms"] * 1e3 / len(calls)


def fastest(entries: list[dict]) -> dict | None:
    """The timed entry (one with "us") of least time, or None when none was timed."""
    timed = [e for e in entries if "us" in e]
    return min(timed, key=lambda e: e["us"]) if timed else None


def gemv_microbench(device: torch.device) -> list[dict]:
    """One-row products per matrix shape inside CUDA graphs (weights rotated so L2 holds none of them)."""
    from runtime.kernels.gemv import gemv

    out = []
    shapes = {name: MATRIX_SHAPES[name] for name in ("qkv", "o", "gate_up", "down", "text_head")}
    for name, (n, k) in shapes.items():
        copies = 2 if n > 100000 else 4
        ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        w8s = [quantize_weight(w) for w in ws]
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        calls = 4 * copies
        kinds = {
            "bf16_cublas": ([functools.partial(F.linear, x, ws[i % copies]) for i in range(calls)], 2),
            "bf16_triton_gemv": ([functools.partial(gemv, x, ws[i % copies]) for i in range(calls)], 2),
            "fp8_triton_gemv": ([functools.partial(gemv, x, w8s[i % copies].weight, scale=w8s[i % copies].scale)
                                 for i in range(calls)], 1),
            "fp8_triton_dot": ([functools.partial(linear, x, w8s[i % copies], small_batch_kernel="triton")
                                for i in range(calls)], 1),
            "fp8_scaled_mm": ([functools.partial(linear, x, w8s[i % copies], small_batch_kernel="scaled_mm")
                               for i in range(calls)], 1),
        }
        row: dict = {"matrix": name, "n": n, "k": k}
        for kind, (fns, elem) in kinds.items():
            try:
                us = graph_us_per_call(fns)
                row[kind] = {"us": round(us, 1), "gbps": round(n * k * elem / (us / 1e6) / 1e9, 1)}
            except Exception as exc:  # noqa: BLE001 - reported in the JSON
                row[kind] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        out.append(row)
        del ws, w8s
    return out


def decode_attention_sweep(cache: KVCache, batch_sizes: list[int], context_len: int, start_block: int) -> list[dict]:
    """Decode-attention kernel configs (key tile, warps, stages) at each batch size, in CUDA graphs over all
    layer instances (no L2 reuse); KV bytes read per call / time."""
    from runtime.kernels.paged_attention import decode_num_parts, paged_decode_attention

    device = cache.k.device
    layers, _, bs, kv, dim = cache.k.shape
    out = []
    configs = [(64, 4, 2), (32, 4, 2), (128, 8, 2), (64, 4, 3), (128, 4, 3), (64, 8, 2), (32, 2, 3)]
    for b in batch_sizes:
        width = math.ceil((context_len + 1) / bs)
        tables = (start_block + torch.arange(b * width, device=device, dtype=torch.int32)).view(b, width)
        seq_lens = torch.full((b,), context_len + 1, dtype=torch.int32, device=device)
        q = torch.randn(b, 4 * kv, dim, device=device, dtype=cache.k.dtype)
        parts = decode_num_parts(b, kv, width * bs)
        nbytes = 2 * b * (context_len + 1) * kv * dim * cache.k.element_size()
        row: dict = {"batch": b, "parts": parts, "kv_bytes_per_call": nbytes}
        for bn, warps, stages in configs:
            calls = [functools.partial(paged_decode_attention, q, cache.k[i], cache.v[i], tables, seq_lens, parts,
                                       block_n=bn, num_warps=warps, num_stages=stages) for i in range(layers)]
            key = f"bn{bn}_w{warps}_s{stages}"
            try:
                us = graph_us_per_call(calls)
                row[key] = {"us": round(us, 2), "gbps": round(nbytes / (us / 1e6) / 1e9, 1)}
            except Exception as exc:  # noqa: BLE001 - reported in the JSON
                row[key] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        out.append(row)
    return out


def compile_microbench(device: torch.device) -> list[dict]:
    """Does torch.compile pay for the small fused ops? Eager PyTorch ops vs torch.compile of the same
    functions vs the hand-written Triton kernels, per call inside CUDA graphs, at 1 and 512 rows. (The
    Triton q/k kernel also stores K/V into the cache; the compiled one only normalizes and rotates.)"""
    from runtime.fast_ops import TorchOps, TritonOps, rope_tables
    from runtime.layers import apply_rotary

    ref, tri = TorchOps(), TritonOps()
    bf16 = torch.bfloat16
    cos, sin = rope_tables(4096, 128, 1e6, bf16, device)

    def qk_norm_rope(qkv: torch.Tensor, qn: torch.Tensor, kn: torch.Tensor, pos: torch.Tensor):
        n = qkv.shape[0]
        q, k, _ = qkv.split([4096, 1024, 1024], dim=1)
        c, s = cos[pos], sin[pos]
        qf = q.reshape(n, 32, 128).float()
        kf = k.reshape(n, 8, 128).float()
        qr = qn * (qf * torch.rsqrt(qf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(bf16)
        kr = kn * (kf * torch.rsqrt(kf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(bf16)
        return apply_rotary(qr, c, s), apply_rotary(kr, c, s)

    compiled = {"add_rmsnorm": torch.compile(ref.add_rmsnorm, dynamic=False),
                "silu_mul": torch.compile(ref.silu_mul, dynamic=False),
                "qk_norm_rope": torch.compile(qk_norm_rope, dynamic=False)}
    out = []
    kc = torch.randn(64, 16, 8, 128, device=device).to(bf16)
    vc = torch.randn_like(kc)
    for n in (1, 512):
        x, res = torch.randn(n, 4096, device=device).to(bf16), torch.randn(n, 4096, device=device).to(bf16)
        w = torch.ones(4096, device=device, dtype=bf16)
        gu = torch.randn(n, 24576, device=device).to(bf16)
        qkv = torch.randn(n, 6144, device=device).to(bf16)
        qn = torch.ones(128, device=device, dtype=bf16)
        pos = torch.arange(n, device=device)
        slots = torch.arange(n, device=device)
        cases = {
            "add_rmsnorm": (functools.partial(ref.add_rmsnorm, x, res, w, 1e-6),
                            functools.partial(compiled["add_rmsnorm"], x, res, w, 1e-6),
                            functools.partial(tri.add_rmsnorm, x, res, w, 1e-6)),
            "silu_mul": (functools.partial(ref.silu_mul, gu), functools.partial(compiled["silu_mul"], gu),
                         functools.partial(tri.silu_mul, gu)),
            "qk_norm_rope": (functools.partial(qk_norm_rope, qkv, qn, qn, pos),
                             functools.partial(compiled["qk_norm_rope"], qkv, qn, qn, pos),
                             functools.partial(tri.qk_norm_rope_store, qkv, qn, qn, cos, sin, pos, slots, kc, vc,
                                               32, 8, 1e-6)),
        }
        for name, fns in cases.items():
            row: dict = {"op": name, "rows": n}
            for kind, fn in zip(("eager_torch", "torch_compile", "triton"), fns, strict=True):
                try:
                    t0 = time.perf_counter()
                    fn()
                    row[f"{kind}_first_call_s"] = round(time.perf_counter() - t0, 2)
                    row[f"{kind}_us"] = round(graph_us_per_call([fn] * 20), 2)
                except Exception as exc:  # noqa: BLE001 - reported in the JSON
                    row[f"{kind}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            out.append(row)
    return out
