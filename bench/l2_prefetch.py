"""Does an L2 prefetch on a side branch shorten the decode step? (runtime/kernels/l2_prefetch.py)

    PYTHONUNBUFFERED=1 python bench/l2_prefetch.py --out bench/results/l2-prefetch-h200.json

1. Mechanism, one matrix (the o projection's shape, 4096 x 4096 bf16, 32 MiB), each case one CUDA graph:
   L2 flushed (a 256 MiB write), then either nothing, a prefetch of the matrix, or a prefetch of another
   matrix, then a spin of the same length in all three, then the one-row GEMV. If the prefetch works, the
   graph with it is faster than the one without by up to the matrix's DRAM time.
2. The decode step of the full random-weight model (512-token context), one CUDA graph per variant:
   the serving default (bf16 `mixed`, FP8 `gemv`, both with PDL and the audio tail on a second stream)
   against the same with `FastForward(l2_prefetch=...)`. Logits of every variant are checked equal to
   the variant without prefetch (a cache hint changes no value) before anything is timed; timings are
   medians of 30 replays, repeated over rounds in interleaved order, reported per round and as the median.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fast_tools import Blocks, copy_bandwidth_gbps, log, make_rows, plain_inputs, time_ms
from runtime.config import ModelConfig
from runtime.cuda_graph import DecodeGraphRunner
from runtime.fast_forward import FastForward
from runtime.fast_ops import TritonOps
from runtime.fused import fuse_model_weights, with_fp8
from runtime.kernels import l2_prefetch
from runtime.kv_cache import allocate_kv_cache, kv_bytes_per_block
from runtime.model import build_model


@dataclass
class Variant:
    forward: FastForward
    batch: int
    matrix_bytes: int
    base: str  # the variant without prefetch whose logits this one must equal
    programs: int  # prefetch programs per launch


def graph_of(fn) -> torch.cuda.CUDAGraph:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def mechanism(device: torch.device, spin_cycles: list[int]) -> list[dict]:
    from runtime.kernels.gemv import NONE, gemv
    from runtime.kernels.l2_prefetch import prefetch_l2

    w = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    other = torch.randn_like(w)
    x = torch.randn(1, 4096, device=device, dtype=torch.bfloat16)
    flush = torch.empty(256 * 2**20, device=device, dtype=torch.uint8)
    want = gemv(x, w, prologue=NONE)[0].clone()
    rows = []
    for cycles in spin_cycles:
        row: dict = {"spin_cycles": cycles}
        for case in ("none", "bulk", "line", "bulk_other", "bulk_half"):
            def run(case=case, cycles=cycles):
                flush.sum()  # reads 256 MiB: evicts the matrix from L2 without leaving dirty lines
                if case in ("bulk", "line"):
                    prefetch_l2(w, mode=case)
                elif case == "bulk_other":
                    prefetch_l2(other, mode="bulk")
                elif case == "bulk_half":
                    prefetch_l2(w, w.numel(), mode="bulk")  # first half of the bytes
                if cycles:
                    torch.cuda._sleep(cycles)
                return gemv(x, w, prologue=NONE)[0]

            g = graph_of(run)
            g.replay()
            torch.cuda.synchronize()
            out = gemv(x, w, prologue=NONE)[0]
            assert torch.equal(out, want)
            row[case + "_us"] = round(time_ms(g.replay, 5, 50)["median_ms"] * 1e3, 2)
        rows.append(row)
        log(f"mechanism {json.dumps(row)}")
    return rows


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--bf16-specs", default="o,o+gate_up:8,o+gate_up:16,o+gate_up:32")
    p.add_argument("--fp8-specs", default="o,o+gate_up:16,o+gate_up:32,o+gate_up:48")
    p.add_argument("--batched", default="8,64", help="batch sizes also timed with the first bf16 spec")
    p.add_argument("--spin-cycles", default="0,20000")
    p.add_argument("--programs", default="8", help="prefetch programs per launch; each value a separate set")
    p.add_argument("--skip-mechanism", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    device = torch.device("cuda")
    result: dict = {"bench": "l2_prefetch", "command": shlex.join(["python", "bench/l2_prefetch.py", *argv]),
                    "device_name": torch.cuda.get_device_name(device), "torch": torch.__version__,
                    "copy_gbps": round(copy_bandwidth_gbps(device), 1)}
    if not args.skip_mechanism:
        result["mechanism"] = {}
        for n in args.programs.split(","):
            l2_prefetch.PROGRAMS = int(n)
            result["mechanism"][n] = mechanism(device, [int(c) for c in args.spin_cycles.split(",")])

    model = build_model(ModelConfig.preset("full"), seed=0, device=device, dtype=torch.bfloat16)
    config = model.config
    weights = fuse_model_weights(model)
    fp8 = with_fp8(weights, "all")
    ops = TritonOps()
    bs, ctx = 16, args.context_len
    batched = [int(b) for b in args.batched.split(",") if b]
    max_b = max([1, *batched])
    per_seq = (ctx + 32) // bs + 1
    cache = allocate_kv_cache(config, (max_b + 4) * per_seq, bs, device, torch.bfloat16)
    cache.k.normal_(0, 1)
    cache.v.normal_(0, 1)
    log("model ready")

    bf16_specs = ["off", *[s for s in args.bf16_specs.split(",") if s]]
    fp8_specs = ["off", *[s for s in args.fp8_specs.split(",") if s]]
    programs = [int(n) for n in args.programs.split(",")]
    variants: dict[str, Variant] = {}
    for spec in bf16_specs:
        for mode in (("bulk", "line") if spec == "o" else ("bulk",)):
            for n in (programs if spec != "off" else programs[:1]):
                name = f"bf16_b1_{spec}" + ("" if mode == "bulk" else f"_{mode}") + (f"_p{n}" if spec != "off" else "")
                variants[name] = Variant(FastForward(weights, ops, l2_prefetch=spec, l2_prefetch_mode=mode), 1,
                                         weights.matrix_bytes(), "bf16_b1_off", n)
    for spec in fp8_specs:
        variants[f"fp8_b1_{spec}"] = Variant(FastForward(fp8, ops, l2_prefetch=spec), 1, fp8.matrix_bytes(),
                                             "fp8_b1_off", programs[0])
    for b in batched:
        for spec in ("off", bf16_specs[1]):
            variants[f"bf16_b{b}_{spec}"] = Variant(
                FastForward(weights, ops, l2_prefetch=spec, l2_prefetch_max_rows=b), b, weights.matrix_bytes(),
                f"bf16_b{b}_off", programs[0])

    blocks = Blocks()
    inputs = {}
    for b in sorted({v.batch for v in variants.values()}):
        tables = [blocks.take(ctx + 1, bs) for _ in range(b)]
        tok, aud, pos, attn = plain_inputs(make_rows(b, 100 + b), [(1, ctx + 1, t) for t in tables], bs, device)
        inputs[b] = (tok, aud, pos, attn.slot_mapping, torch.tensor(tables, dtype=torch.int32, device=device),
                     torch.full((b,), ctx + 1, dtype=torch.int32, device=device))
    runners, logits = {}, {}
    for name, v in variants.items():
        b = v.batch
        l2_prefetch.PROGRAMS = v.programs  # baked into the graph at capture
        r = DecodeGraphRunner(v.forward, cache, max_model_len=ctx + 64, buckets=[b])
        r.capture()
        runners[name] = r
        logits[name] = tuple(t.clone() for t in r.run(*inputs[b]))
        assert all(torch.isfinite(t).all() for t in logits[name]), name
    log(f"captured {len(runners)} graphs")
    checks = {name: {"vs": base, "equal": all(torch.equal(a, c) for a, c in zip(logits[name], logits[base],
                                                                                  strict=True))}
              for name, v in variants.items() if (base := v.base) != name}
    result["logits_equal_to_no_prefetch"] = checks
    bad = [n for n, c in checks.items() if not c["equal"]]
    if bad:
        result["error"] = f"logits differ with prefetch: {bad}"
        log(result["error"])
    else:
        timings: dict[str, list[float]] = {n: [] for n in variants}
        order = list(variants)
        for rnd in range(args.rounds):
            for name in (order if rnd % 2 == 0 else order[::-1]):
                r = runners[name]
                timings[name].append(time_ms(r.graphs[r.buckets[0]].replay, 3, args.reps)["median_ms"])
            log(f"round {rnd}: " + ", ".join(f"{n} {timings[n][-1]:.3f}" for n in order))
        rows = []
        for name, v in variants.items():
            med, b, wbytes = statistics.median(timings[name]), v.batch, v.matrix_bytes
            kv = b * (ctx + 1) * kv_bytes_per_block(config, 1, torch.bfloat16)
            rows.append({"variant": name, "batch": b, "prefetch_programs": v.programs, "median_ms": round(med, 4),
                         "rounds_ms": [round(t, 4) for t in timings[name]],
                         "copy_fraction": round((wbytes + kv) / (med / 1e3) / 1e9 / result["copy_gbps"], 3)})
        result["decode"] = rows
        for row in rows:
            log(f"decode {json.dumps(row)}")
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(result))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
