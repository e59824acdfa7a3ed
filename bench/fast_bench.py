"""GPU speed of the fast path vs the plain eager forward, measured side by side in one run.

    PYTHONUNBUFFERED=1 python bench/fast_bench.py --out bench/results/engine-h200.json

Order: copy bandwidth (the roofline), kernel checks (bench/fast_checks.py), fast vs plain logits and
greedy tokens on the full random-weight model, then timings: decode steps (plain eager, fast eager,
fast CUDA graph, FP8 graph) at several batch sizes with a 512-token context, 512-token prefill,
FP8 GEMV kernels, FP8 logit drift, and the 24 GB profile in a subprocess (bench/profile_24gb.py).
Nothing is timed unless the checks pass.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fast_checks import failed_ops, run_kernel_checks
from runtime.attention import AttentionMetadata
from runtime.config import MODALITY_PAD_ID, ModelConfig, Row
from runtime.cuda_graph import DecodeGraphRunner
from runtime.fast_forward import FastForward, StepInputs
from runtime.fast_ops import TritonOps
from runtime.fp8 import linear, quantize_weight
from runtime.fused import fuse_model_weights, with_fp8
from runtime.kv_cache import allocate_kv_cache, kv_bytes_per_block
from runtime.model import build_model, split_rows


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def time_ms(fn: Callable[[], object], warmup: int, reps: int) -> dict:
    """Median / p10 / p90 of `reps` CUDA-event-timed calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b))
    samples.sort()
    return {"median_ms": round(statistics.median(samples), 4), "p10_ms": round(samples[len(samples) // 10], 4),
            "p90_ms": round(samples[min(len(samples) - 1, math.ceil(0.9 * len(samples)) - 1)], 4)}


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


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-sizes", default="1,8,32,64,128")
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--skip-profile", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    bf16 = torch.bfloat16
    result: dict = {"bench": "fast_path", "command": shlex.join(["python", "bench/fast_bench.py", *argv]),
                    "device_name": torch.cuda.get_device_name(device), "torch": torch.__version__}
    copy_gbps = copy_bandwidth_gbps(device)
    result["copy_gbps"] = round(copy_gbps, 1)
    log(f"copy bandwidth {copy_gbps:.0f} GB/s")

    if not args.skip_profile:  # first, while this process holds almost no GPU memory
        proc = subprocess.run([sys.executable, str(Path(__file__).with_name("profile_24gb.py"))],
                              capture_output=True, text=True, timeout=300, check=False)
        sys.stderr.write(proc.stderr[-3000:])
        result["profile_24gb"] = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {
            "error": proc.stderr[-2000:]}

    checks = run_kernel_checks(device)
    result["kernel_checks"] = checks
    for c in checks:
        log(f"check {c['kernel']}: ok={c['ok']} {json.dumps({k: v for k, v in c.items() if k != 'kernel'})}")
    failed = failed_ops(checks)
    result["fallback_ops"] = sorted(failed)
    if failed:
        log(f"FAILED CHECKS -> PyTorch fallback for {sorted(failed)}")
    ops = TritonOps(fallback=failed - {"fp8_gemv"})
    fp8_small = "scaled_mm" if "fp8_gemv" in failed else "triton"

    config = ModelConfig.preset("full")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    bs = args.block_size
    model = build_model(config, seed=0, device=device, dtype=bf16)
    per_seq = math.ceil((max(args.context_len, args.prompt_len) + 16) / bs)
    num_blocks = 2 * (max(batch_sizes) + 8) * per_seq
    cache = allocate_kv_cache(config, num_blocks, bs, device, bf16)
    cache.k.normal_(0, 1)
    cache.v.normal_(0, 1)
    weights = fuse_model_weights(model)
    fast = FastForward(weights, ops)
    result["weight_matrix_bytes_bf16"] = weights.matrix_bytes()
    log(f"model built; matrices {weights.matrix_bytes() / 1e9:.2f} GB; cache {num_blocks} blocks")

    # --- correctness on the full model: prefill logits and greedy tokens, fast vs plain ---
    blocks = Blocks()
    prompt = make_rows(args.prompt_len, 1)
    t_a, t_b = blocks.take(args.prompt_len, bs), blocks.take(args.prompt_len, bs)
    tok, aud, pos, attn = plain_inputs(prompt, [(len(prompt), len(prompt), t_a)], bs, device)
    plain_out = model(tok, aud, pos, cache, attn)
    tok, aud, pos, attn = plain_inputs(prompt, [(len(prompt), len(prompt), t_b)], bs, device)
    fast_out = fast(StepInputs.from_metadata(tok, aud, pos, attn), cache)
    result["prefill_fast_vs_plain"] = logit_compare(fast_out, plain_out)
    log(f"prefill fast vs plain {result['prefill_fast_vs_plain']}")

    runner = DecodeGraphRunner(fast, cache, max_model_len=args.max_model_len, buckets=batch_sizes)
    t0 = time.perf_counter()
    runner.capture()
    result["graph_capture_s"] = round(time.perf_counter() - t0, 2)
    log(f"captured {batch_sizes} in {result['graph_capture_s']} s")

    def plain_step(table: list[int]):
        def step(rows: list[Row], n: int):
            tok, aud, pos, attn = plain_inputs(rows[len(rows) - n:], [(n, len(rows), table)], bs, device)
            return model(tok, aud, pos, cache, attn)
        return step

    def graph_step(table: list[int]):
        def step(rows: list[Row], n: int):
            tok, aud, pos, attn = plain_inputs(rows[len(rows) - n:], [(n, len(rows), table)], bs, device)
            if n > 1:
                return fast(StepInputs.from_metadata(tok, aud, pos, attn), cache)
            tables = torch.tensor([table], dtype=torch.int32, device=device)
            seq_lens = torch.tensor([len(rows)], dtype=torch.int32, device=device)
            return runner.run(tok, aud, pos, attn.slot_mapping, tables, seq_lens)
        return step

    short = prompt[:32]
    want = greedy(plain_step(blocks.take(64, bs)), short, 16)
    got = greedy(graph_step(blocks.take(64, bs)), short, 16)
    result["greedy"] = {"steps": 16, "plain": want, "fast_graph": got, "equal": want == got,
                        "first_mismatch": next((i for i, (x, y) in enumerate(zip(want, got)) if x != y), None)}
    log(f"greedy fast graph == plain: {want == got} (first mismatch {result['greedy']['first_mismatch']})")

    # --- decode timings ---
    ctx = args.context_len
    decode = []
    fp8_weights = with_fp8(weights, "all")
    fast8 = FastForward(fp8_weights, ops, fp8_small_batch=fp8_small)
    runner8 = DecodeGraphRunner(fast8, cache, max_model_len=args.max_model_len, buckets=batch_sizes)
    runner8.capture()
    result["weight_matrix_bytes_fp8"] = fp8_weights.matrix_bytes()
    log("fp8 graphs captured")
    for b in batch_sizes:
        blk = Blocks(blocks.next)
        tables = [blk.take(ctx + 1, bs) for _ in range(b)]
        rows = make_rows(b, 100 + b)
        tok, aud, pos, attn = plain_inputs(rows, [(1, ctx + 1, t) for t in tables], bs, device)
        step_in = StepInputs.from_metadata(tok, aud, pos, attn, num_parts=fast.decode_num_parts(b, ctx + 1))
        t_tables = torch.tensor(tables, dtype=torch.int32, device=device)
        s_lens = torch.full((b,), ctx + 1, dtype=torch.int32, device=device)
        runner.run(tok, aud, pos, attn.slot_mapping, t_tables, s_lens)
        g_logits = tuple(x.clone() for x in runner.run(tok, aud, pos, attn.slot_mapping, t_tables, s_lens))
        p_logits = model(tok, aud, pos, cache, attn)
        runner8.run(tok, aud, pos, attn.slot_mapping, t_tables, s_lens)
        f8_logits = tuple(x.clone() for x in runner8.run(tok, aud, pos, attn.slot_mapping, t_tables, s_lens))
        kv_bytes = b * (ctx + 1) * kv_bytes_per_block(config, 1, bf16)
        entry = {"batch": b, "context_len": ctx, "kv_read_bytes": kv_bytes,
                 "graph_vs_plain": logit_compare(g_logits, p_logits),
                 "fp8_vs_bf16": logit_compare(f8_logits, g_logits)}
        bucket = runner.bucket_for(b)
        variants = {
            "plain_eager": (functools.partial(model, tok, aud, pos, cache, attn), weights.matrix_bytes()),
            "fast_eager": (functools.partial(fast, step_in, cache), weights.matrix_bytes()),
            "fast_graph": (runner.graphs[bucket].replay, weights.matrix_bytes()),
            "fast_graph_fp8": (runner8.graphs[bucket].replay, fp8_weights.matrix_bytes()),
        }
        for name, (fn, wbytes) in variants.items():
            reps = args.reps if "graph" in name else max(5, args.reps // 3)
            t = time_ms(fn, 3, reps)
            sec = t["median_ms"] / 1e3
            gbps = (wbytes + kv_bytes) / sec / 1e9
            entry[name] = {**t, "weight_plus_kv_gbps": round(gbps, 1),
                           "copy_fraction": round(gbps / copy_gbps, 3), "tokens_per_s": round(b / sec, 1)}
        log(f"decode B={b}: " + ", ".join(f"{k} {entry[k]['median_ms']:.3f} ms" for k in variants))
        decode.append(entry)
    result["decode"] = decode

    # --- prefill ---
    blk = Blocks(blocks.next)
    table = blk.take(args.prompt_len, bs)
    tok, aud, pos, attn = plain_inputs(prompt, [(len(prompt), len(prompt), table)], bs, device)
    step_in = StepInputs.from_metadata(tok, aud, pos, attn)
    flops = 2 * (weights.matrix_bytes() // 2 - config.hidden_size * (config.vocab_size + config.audio_vocab_size)) \
        * args.prompt_len
    prefill = {"prompt_len": args.prompt_len, "matmul_flops": flops}
    for name, fn in {"plain_eager": lambda: model(tok, aud, pos, cache, attn),
                     "fast_eager": lambda: fast(step_in, cache),
                     "fast_eager_fp8": lambda: fast8(step_in, cache)}.items():
        t = time_ms(fn, 3, 10)
        prefill[name] = {**t, "tflops": round(flops / (t["median_ms"] / 1e3) / 1e12, 1)}
        log(f"prefill {name}: {t['median_ms']:.3f} ms")
    prefill["fp8_vs_bf16"] = logit_compare(fast8(step_in, cache), fast(step_in, cache))
    result["prefill"] = prefill

    # --- FP8 GEMV kernels vs bf16 cuBLAS at 1 row, per matrix shape ---
    gemv = []
    for name, (n, k) in {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
                         "down": (4096, 12288), "text_head": (151680, 4096)}.items():
        w = torch.randn(n, k, device=device, dtype=bf16) * 0.02
        w8 = quantize_weight(w)
        x = torch.randn(1, k, device=device, dtype=bf16)
        row = {"matrix": name, "n": n, "k": k}
        for kname, fn, nbytes in (
            ("bf16_cublas", functools.partial(linear, x, w), n * k * 2),
            ("fp8_triton", functools.partial(linear, x, w8, small_batch_kernel="triton"), n * k),
            ("fp8_scaled_mm", functools.partial(linear, x, w8, small_batch_kernel="scaled_mm"), n * k),
        ):
            t = time_ms(fn, 5, 50)["median_ms"]
            row[kname] = {"median_us": round(t * 1e3, 1), "gbps": round(nbytes / (t / 1e3) / 1e9, 1)}
        gemv.append(row)
        log(f"gemv {row}")
    result["fp8_gemv_1row"] = gemv

    line = json.dumps(result)
    print(line)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
