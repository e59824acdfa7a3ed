"""FP8 KV cache on the GPU: kernel checks, greedy tokens, drift against the bf16 cache, decode-step times.

    python bench/kv_fp8.py --out bench/results/kv-fp8-h200/kv-fp8.json

One process, the full random-weight model with bf16 weights, in this order; nothing is timed unless every
check before it holds (the script exits 1 with the JSON written):
1. the device's copy rate (the roofline of this run);
2. the FP8-cache kernel checks of bench/fast_checks.py (`_check_fp8_kv`);
3. greedy tokens: the plain model on an FP8 cache against the fast path (eager prefill, then the decode
   graph) on another, the same random weights in float32 (as bench/fast_bench.py checks the paths): both
   quantize the same way, so the tokens must be equal;
4. drift: a `--prompt-len` prompt prefilled into a bf16 and an FP8 cache by the fast path, then
   `--drift-steps` decode steps through each cache's graph, both fed the bf16 run's greedy rows: top-1
   agreement and max |log p| difference of the prefill's last-row logits and of every step's, text and
   audio heads;
5. decode-step times of the serving default `FastForward` over a bf16 cache and an FP8 cache quantized from
   it (same values up to the quantization), whole and audio-only steps, for each batch x context of
   `--points`, timed in interleaved rounds (`--rounds` of `--reps` replays); the KV bytes each step reads
   and the fraction of the copy rate reached by weights + KV. `--ab-option NAME` adds the FP8 cache's steps
   captured with runtime.kernels.paged_attention OPTIONS[NAME] off (e.g. `fp8_mid`, the forty-third
   session's launches), and how far their audio logits are from the FP8 steps'.
The attention sweep (before step 3; `--sweep-only` stops after it) times the kernel alone per launch, and
with `--sweep-parts` per partition count too (bench/results/kv-fp8-split-h200/).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import math
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fast_checks import _check_fp8_kv, _diff, fp8_cache
from bench.fast_tools import (
    Blocks,
    copy_bandwidth_gbps,
    emit,
    graph_stepper,
    greedy,
    greedy_report,
    log,
    logit_compare,
    make_rows,
    overridden,
    plain_inputs,
    plain_stepper,
    time_interleaved,
)
from runtime.config import MODALITY_PAD_ID, ModelConfig
from runtime.cuda_graph import DecodeGraphRunner
from runtime.fast_forward import FastForward, StepInputs
from runtime.fast_ops import TritonOps
from runtime.fused import fuse_model_weights
from runtime.kv_cache import FP8_KV_DTYPE, KVCache, allocate_kv_cache, kv_bytes_per_block
from runtime.model import build_model

BLOCK_SIZE = 16


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", default="1x512,64x512,128x512,64x2048", help="batch x context of each timed step")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--drift-steps", type=int, default=32)
    p.add_argument("--greedy-steps", type=int, default=24)
    p.add_argument("--sweep-points", default="1x512,64x512,128x512,64x2048")
    p.add_argument("--sweep-only", action="store_true", help="stop after the attention kernel sweep")
    p.add_argument("--sweep-parts", default="auto",
                   help="key partitions the sweep tries per point (comma list; auto: decode_num_parts's choice)")
    p.add_argument("--sweep-launches", default="",
                   help="more launches for the sweep, key tile:warps:stages each, comma-separated (e.g. 16:1:2)")
    p.add_argument("--ab-option", default="",
                   help="also time the FP8 cache's steps captured with this paged_attention OPTIONS switch off "
                        "(variant 'fp8:NAME=off'; e.g. fp8_mid)")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def option_off(name: str | None) -> contextlib.AbstractContextManager:
    """runtime.kernels.paged_attention OPTIONS[name] set False inside the block (None: nothing changes)."""
    from runtime.kernels import paged_attention as pa

    if name is None:
        return contextlib.nullcontext()
    if name not in pa.OPTIONS:
        raise ValueError(f"no paged_attention option {name!r}")
    return overridden(pa.OPTIONS, **{name: False})


def fill_quantized(src: KVCache, dst: KVCache) -> None:
    """dst (FP8) := src's values quantized, layer by layer (bounded temporaries)."""
    assert dst.k_scale is not None and dst.v_scale is not None
    for i in range(src.num_layer_instances):
        k8, v8, scales = fp8_cache(src.k[i], src.v[i])
        dst.k[i].copy_(k8)
        dst.v[i].copy_(v8)
        dst.k_scale[i].copy_(scales["k_scale"])
        dst.v_scale[i].copy_(scales["v_scale"])


def drift(fast: FastForward, caches: dict[str, KVCache], prompt: list, steps: int) -> dict:
    """Prefill `prompt` into both caches, then `steps` decode steps through each cache's graph fed the bf16
    run's greedy rows -> logit comparisons (FP8 against bf16) of the prefill and of the decode steps."""
    device = caches["bf16"].k.device
    table = Blocks().take(len(prompt) + steps + 1, BLOCK_SIZE)
    tok, aud, pos, attn = plain_inputs(prompt, [(len(prompt), len(prompt), table)], BLOCK_SIZE, device)
    step_in = StepInputs.from_metadata(tok, aud, pos, attn)
    prefill = {name: tuple(x.clone() for x in fast(step_in, cache)) for name, cache in caches.items()}
    runners = {name: DecodeGraphRunner(fast, cache, max_model_len=len(prompt) + steps + 16, buckets=[1],
                                       audio_only=False) for name, cache in caches.items()}
    for r in runners.values():
        r.capture()
    rows = list(prompt)
    text, audio = (x[-1:] for x in prefill["bf16"])
    got: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {name: [] for name in caches}
    tables = torch.tensor([table], dtype=torch.int32, device=device)
    for i in range(steps):
        a = int(audio[0].argmax())
        rows.append((MODALITY_PAD_ID, a) if i % 2 == 0 else (int(text[0].argmax()), a))
        tok, aud, pos, attn = plain_inputs(rows[-1:], [(1, len(rows), table)], BLOCK_SIZE, device)
        seq_lens = torch.tensor([len(rows)], dtype=torch.int32, device=device)
        for name, r in runners.items():
            got[name].append(tuple(x.clone() for x in r.run(tok, aud, pos, attn.slot_mapping, tables, seq_lens)))
        text, audio = got["bf16"][-1]
    decode = {name: tuple(torch.cat([s[j] for s in v]) for j in (0, 1)) for name, v in got.items()}
    return {"prefill": logit_compare(prefill["fp8"], prefill["bf16"]),
            "decode": logit_compare(decode["fp8"], decode["bf16"]), "decode_steps": steps,
            "finite": all(bool(torch.isfinite(x).all()) for v in (*prefill.values(), *decode.values()) for x in v)}


SWEEP_LAUNCHES = [None, (64, 4, 2), (64, 4, 1), (32, 1, 2), (128, 4, 2)]


def attention_sweep(device: torch.device, args: argparse.Namespace) -> list[dict]:
    """The decode attention alone over a bf16 cache and the FP8 copy of it, per point of `--sweep-points`, each
    launch (key tile, warps, stages; None: `decode_launch`'s choice for that cache): us per call in a CUDA
    graph over 40 layer caches (no L2 reuse), each variant checked first against the PyTorch op on the same
    cache (rel_l2 < 2e-2). The kernel is serving's: with unsplit keys `paged_decode_attention_rope` (q/k norm,
    RoPE, the store and attention), else `paged_decode_attention`."""
    gen = torch.Generator(device=device).manual_seed(7)
    out = []
    extra = [tuple(int(x) for x in item.split(":")) for item in args.sweep_launches.split(",") if item]
    for point in args.sweep_points.split(","):
        b, ctx = (int(x) for x in point.split("x"))
        row = _sweep_point(device, gen, b, ctx, args.sweep_parts.split(","), SWEEP_LAUNCHES + extra)
        log(f"sweep {point}: " + ", ".join(f"{k} {v}" for k, v in row.items() if isinstance(v, float)))
        out.append(row)
        torch.cuda.empty_cache()
    return out


def _sweep_point(device: torch.device, gen: torch.Generator, b: int, ctx: int, parts_list: list[str],
                 launches: list[tuple | None]) -> dict:
    from bench.fast_tools import graph_us_per_call
    from runtime.fast_ops import TorchOps, rope_tables
    from runtime.kernels import paged_attention as pa

    heads, kv, dim, layers = 32, 8, 128, 40
    width = math.ceil((ctx + 1) / BLOCK_SIZE)
    k16 = [torch.randn(b * width, BLOCK_SIZE, kv, dim, device=device, generator=gen).to(torch.bfloat16)
           for _ in range(layers)]
    v16 = [torch.randn_like(k) for k in k16]
    fp8 = [fp8_cache(k, v) for k, v in zip(k16, v16, strict=True)]
    tables = torch.arange(b * width, device=device, dtype=torch.int32).view(b, width)
    seq_lens = torch.full((b,), ctx + 1, dtype=torch.int32, device=device)
    pos = seq_lens.long() - 1
    slots = tables.long()[:, -1] * BLOCK_SIZE + pos % BLOCK_SIZE
    qkv = torch.randn(b, (heads + 2 * kv) * dim, device=device, generator=gen).to(torch.bfloat16)
    q = qkv[:, : heads * dim].reshape(b, heads, dim).contiguous()  # the unsplit kernel's q rows
    norm = torch.ones(dim, device=device, dtype=torch.bfloat16)
    rope = (qkv, norm, norm, *rope_tables(8192, dim, 1e6, torch.bfloat16, device), pos, slots)
    auto_parts = pa.decode_num_parts(b, kv, width * BLOCK_SIZE)
    row: dict = {"batch": b, "context_len": ctx, "parts": auto_parts, "fused_rope": auto_parts == 1,
                 "kv_bytes_bf16": 2 * b * (ctx + 1) * kv * dim * 2}

    def call(i: int, quant: bool, launch: tuple | None, parts: int, fused: bool) -> torch.Tensor:
        kw = {} if launch is None else dict(zip(("block_n", "num_warps", "num_stages"), launch, strict=True))
        k, v, sc = fp8[i] if quant else (k16[i], v16[i], {})
        if fused:
            return pa.paged_decode_attention_rope(*rope, k, v, tables, seq_lens, parts, heads, 1e-6, **sc, **kw)
        return pa.paged_decode_attention(q, k, v, tables, seq_lens, parts, **sc, **kw)

    k8, v8, sc = fp8[0]
    want: dict[tuple[bool, bool], torch.Tensor] = {}
    for parts_s in parts_list:
        parts = auto_parts if parts_s == "auto" else int(parts_s)
        # the unsplit grid fuses the q/k RoPE and the store, as served (so does a split one given explicitly:
        # the kernel takes any partition count; the step fuses up to FUSED_ROPE_MAX_PARTS)
        fused = parts == 1 or parts_s != "auto"
        tag = "" if parts_s == "auto" else f"p{parts}/"
        for quant, (k, v, scales) in ((False, (k16[0], v16[0], {})), (True, (k8, v8, sc))):
            if (quant, fused) in want:
                continue
            if fused:
                want[quant, fused] = TorchOps.decode_attention_rope(
                    *rope, k.clone(), v.clone(), tables, seq_lens, 1, heads, 1e-6,
                    **{name: t.clone() for name, t in scales.items()})
            else:
                want[quant, fused] = TorchOps.decode_attention(q, k, v, tables, seq_lens, 1, **scales)
        for quant in (False, True):
            for launch in launches:
                key = f"{'fp8' if quant else 'bf16'}/{tag}{launch}"
                try:
                    d = _diff(call(0, quant, launch, parts, fused), want[quant, fused])
                    if not (d["rel_l2"] < 2e-2 and d["finite"]):
                        row[key] = {"wrong": d}
                        continue
                    row[key] = round(graph_us_per_call([functools.partial(call, i, quant, launch, parts, fused)
                                                        for i in range(layers)]), 2)
                except Exception as exc:  # noqa: BLE001 - reported in the JSON
                    row[key] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return row


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    device = torch.device("cuda")
    result: dict = {"bench": "kv_fp8", "command": shlex.join(["python", "bench/kv_fp8.py", *argv]),
                    "device_name": torch.cuda.get_device_name(device), "torch": torch.__version__}
    copy_gbps = copy_bandwidth_gbps(device)
    result["copy_gbps"] = round(copy_gbps, 1)
    log(f"copy bandwidth {copy_gbps:.0f} GB/s")

    def stop(why: str) -> int:
        result["stopped"] = why
        log(f"STOPPED: {why}")
        emit(result, args.out)
        return 1

    checks = _check_fp8_kv(device)
    result["kernel_checks"] = checks
    for c in checks:
        log(f"check {c['kernel']}: ok={c['ok']}")
    if not all(c["ok"] for c in checks):
        return stop("an FP8-cache kernel check failed")

    result["attention_sweep"] = attention_sweep(device, args)
    if args.sweep_only:
        emit(result, args.out)
        return 0

    model = build_model(ModelConfig.preset("full"), seed=0, device=device, dtype=torch.bfloat16)
    config = model.config
    weights = fuse_model_weights(model)
    ops = TritonOps()
    fast = FastForward(weights, ops)  # the serving default on this device
    result["weight_matrix_bytes"] = weights.matrix_bytes()

    # 3. greedy tokens, plain model against the fast path, each on its own FP8 cache: in float32 (the same
    # random weights), where the two paths' roundings cannot tip a near-tie as bf16's do (bench/fast_bench.py
    # float32_checks: its bf16 greedy tokens differ between the paths with bf16 caches too)
    prompt = make_rows(args.prompt_len, 1)
    model32 = copy.deepcopy(model).float()
    fast32 = FastForward(fuse_model_weights(model32), ops)
    plain_c, fast_c = (allocate_kv_cache(config, 8, BLOCK_SIZE, device, FP8_KV_DTYPE) for _ in range(2))
    runner = DecodeGraphRunner(fast32, fast_c, max_model_len=128, buckets=[1], audio_only=False)
    runner.capture()
    short, table = prompt[:32], Blocks().take(64, BLOCK_SIZE)
    want = greedy(plain_stepper(model32, plain_c, table), short, args.greedy_steps)
    result["greedy_fp8_kv_float32"] = greedy_report(want, greedy(graph_stepper(fast32, runner, fast_c, table), short,
                                                                 args.greedy_steps))
    log(f"float32 greedy plain == fast on FP8 caches: {result['greedy_fp8_kv_float32']['equal']}")
    del model32, fast32, plain_c, fast_c, runner
    torch.cuda.empty_cache()
    if not result["greedy_fp8_kv_float32"]["equal"]:
        return stop("float32 greedy tokens differ between the plain and the fast path on FP8 caches")

    # 4. drift against the bf16 cache
    small = (args.prompt_len + args.drift_steps) // BLOCK_SIZE + 2
    caches = {"bf16": allocate_kv_cache(config, small, BLOCK_SIZE, device, torch.bfloat16),
              "fp8": allocate_kv_cache(config, small, BLOCK_SIZE, device, FP8_KV_DTYPE)}
    result["drift"] = drift(fast, caches, prompt, args.drift_steps)
    log(f"drift {result['drift']}")
    del caches
    if not result["drift"]["finite"]:
        return stop("non-finite logits")

    # 5. decode-step times over a bf16 cache and its FP8 copy
    points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
    most = max(b * math.ceil((ctx + 1) / BLOCK_SIZE) for b, ctx in points)
    c16 = allocate_kv_cache(config, most, BLOCK_SIZE, device, torch.bfloat16)
    c16.k.normal_(0, 1)
    c16.v.normal_(0, 1)
    c8 = allocate_kv_cache(config, most, BLOCK_SIZE, device, FP8_KV_DTYPE)
    fill_quantized(c16, c8)
    caches = {"bf16": c16, "fp8": c8}
    log(f"caches: {most} blocks each")
    rows = []
    for b, ctx in points:
        blocks = Blocks()  # every point's sequences start at block 0: the contents are random anyway
        tables = [blocks.take(ctx + 1, BLOCK_SIZE) for _ in range(b)]
        tok, aud, pos, attn = plain_inputs(make_rows(b, 100 + b), [(1, ctx + 1, t) for t in tables], BLOCK_SIZE,
                                           device)
        run_args = (tok, aud, pos, attn.slot_mapping, torch.tensor(tables, dtype=torch.int32, device=device),
                    torch.full((b,), ctx + 1, dtype=torch.int32, device=device))
        fns, logits, runners = {}, {}, {}  # the runners own the graphs' static inputs: keep them alive
        variants = [(name, cache, None) for name, cache in caches.items()]
        if args.ab_option:
            variants.append((f"fp8:{args.ab_option}=off", caches["fp8"], args.ab_option))
        for name, cache, off in variants:
            r = runners[name] = DecodeGraphRunner(fast, cache, max_model_len=ctx + 32, buckets=[b])
            with option_off(off):  # the launch choices are made while the graphs are captured
                r.capture()
            logits[name] = tuple(x.clone() for x in r.run(*run_args))
            fns[name], fns[f"{name}:audio"] = r.graphs[b].replay, r.audio_graphs[b].replay
        entry: dict = {"batch": b, "context_len": ctx, "fp8_vs_bf16": logit_compare(logits["fp8"], logits["bf16"]),
                       "finite": all(bool(torch.isfinite(x).all()) for v in logits.values() for x in v)}
        if args.ab_option:
            entry["ab_audio_logits_vs_fp8"] = _diff(logits[f"fp8:{args.ab_option}=off"][1], logits["fp8"][1])
        if not entry["finite"]:
            return stop(f"non-finite logits at {b} x {ctx}")
        times = time_interleaved(fns, 3, args.reps, args.rounds)
        for name, t in times.items():
            dtype = torch.bfloat16 if name.startswith("bf16") else FP8_KV_DTYPE
            kv = b * (ctx + 1) * kv_bytes_per_block(config, 1, dtype)
            w = weights.audio_only_matrix_bytes() if name.endswith(":audio") else weights.matrix_bytes()
            gbps = (w + kv) / (t["median_ms"] / 1e3) / 1e9
            entry[name] = {**t, "kv_read_bytes": kv, "weight_plus_kv_gbps": round(gbps, 1),
                           "copy_fraction": round(gbps / copy_gbps, 3)}
        log(f"decode {b} x {ctx}: " + ", ".join(f"{k} {entry[k]['median_ms']:.3f} ms" for k in times))
        rows.append(entry)
        del fns, runners, r
        torch.cuda.empty_cache()
    result["decode"] = rows
    result["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
