"""Prefill with FP8 weights through the engine's prefill graphs: activations quantized by one Triton kernel
(runtime/kernels/fp8_act.py, the default) against the eager ops used before, with bf16 weights as the baseline.

    python bench/fp8_prefill.py --out bench/results/fp8-rows-h200/fp8-prefill.json

One process, full shape, random weights (every matrix FP8 for the FP8 variants, as `with_fp8(..., "all")`). A
prompt of `--rows` new tokens (no cached prefix) runs through a `PrefillGraphRunner` per variant. The two FP8
variants' logits must be bit-equal (the kernel gives the eager ops' bits); the FP8 logits are compared with
bf16's (top-1 agreement, max |log p| difference). Each graph is then timed in interleaved rounds.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fast_tools import (
    DecodeSetup,
    bench_result,
    emit,
    log,
    logit_compare,
    make_rows,
    overridden,
    plain_inputs,
    time_interleaved,
)
from runtime import fp8
from runtime.cuda_graph import PrefillGraphRunner
from runtime.fast_forward import FastForward
from runtime.fast_ops import TritonOps


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="384,512")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    device = torch.device("cuda")
    rows = [int(r) for r in args.rows.split(",")]
    setup = DecodeSetup([1], context_len=max(rows), fp8=True)
    cache, bs = setup.cache, setup.cache.block_size
    result = bench_result("fp8_prefill", argv, device, copy=False, cases=[])
    ops = TritonOps()
    max_len = max(rows) + 64
    for n in rows:
        table = list(range(cache.k.shape[1] - max_len // bs - 1, cache.k.shape[1] - 1))  # blocks past the decode ones
        prompt = make_rows(n, 7)
        tok, aud, pos, attn = plain_inputs(prompt, [(n, n, table)], bs, device)
        table_t = torch.tensor(table, dtype=torch.int32, device=device)
        runs, logits = {}, {}
        for name, weights, quant in (("bf16", "bf16", "triton"), ("fp8", "fp8", "triton"),
                                     ("fp8_eager_quant", "fp8", "torch")):
            with overridden(fp8.OPTIONS, act_quant=quant):  # read while the graph is captured
                runner = PrefillGraphRunner(FastForward(setup.weights[weights], ops), cache, max_model_len=max_len,
                                            buckets=[n])
                runner.capture()
            out = tuple(t.clone() for t in runner.run(tok, aud, pos, attn.slot_mapping, table_t, n))
            assert all(o.shape[0] == 1 and bool(torch.isfinite(o).all()) for o in out), name
            runs[name] = (runner, tok, aud, pos, attn.slot_mapping, table_t, n)
            logits[name] = out
        case: dict = {"rows": n,
                      "fp8_kernel_quant_equals_eager": all(torch.equal(a, b) for a, b in
                                                           zip(logits["fp8"], logits["fp8_eager_quant"], strict=True)),
                      "fp8_vs_bf16": logit_compare(logits["fp8"], logits["bf16"])}

        def replay(r: tuple) -> object:
            return r[0].run(*r[1:])

        timed = time_interleaved({k: (lambda r=r: replay(r)) for k, r in runs.items()}, 2, args.reps, args.rounds)
        case["median_ms"] = {k: round(v["median_ms"], 3) for k, v in timed.items()}
        case["round_medians_ms"] = {k: v["round_medians_ms"] for k, v in timed.items()}
        log(f"prefill {n} rows: {case['median_ms']} equal={case['fp8_kernel_quant_equals_eager']}")
        result["cases"].append(case)
        del runs
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
