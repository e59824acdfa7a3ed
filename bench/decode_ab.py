"""A/B of decode-step options: CUDA graphs of the full random-weight model, timed in interleaved rounds.

    PYTHONUNBUFFERED=1 python bench/decode_ab.py \\
        --variant "bf16/1/one_row=mixed,pdl=wait,parallel_tails=1" \\
        --variant "bf16/1/one_row=mixed2,pdl=wait,parallel_tails=1" --out bench/results/decode-ab.json

A variant is `weights/batch/options`: weights "bf16" or "fp8" (every matrix, as `with_fp8(..., "all")`),
the decode batch, and `FastForward` keyword options (ints and "1"/"0" booleans converted), or kernel options
set while that variant's graph is captured (`gemv_fold`: runtime/kernels/gemv.py OPTIONS["fold"]).
`ops_skip=add_rmsnorm+silu_mul` makes a ceiling variant: the named ops launch nothing (add_rmsnorm hands back
its input, silu_mul the gate half), so its logits are wrong and are not compared; its time bounds what fusing
those ops away could save. Each variant gets
its own graph over the same KV cache (512-token contexts) and inputs. Before timing, its logits are compared
with the first variant of the same weights and batch (launch options must leave them bit-identical;
another one-row mode rounds differently: max abs difference and top-1 agreement are reported). Timings:
median of `--reps` replays per round after `--warmup` untimed ones; rounds alternate the order; the
reported figure is the median of the rounds. bench/engine.py stays the run the README quotes; this is for
deciding what it should time.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fast_tools import (
    DecodeSetup,
    copy_bandwidth_gbps,
    emit,
    log,
    logit_compare,
    time_interleaved,
)
from runtime import fp8 as fp8_mod
from runtime.cuda_graph import DecodeGraphRunner
from runtime.fast_forward import FastForward
from runtime.fast_ops import TritonOps
from runtime.kernels import gemv as gemv_mod
from runtime.kernels import paged_attention as attn_mod
from runtime.kv_cache import kv_bytes_per_block

INT_OPTIONS = ("pdl_max_rows", "attn_max_parts", "attn_split_two_below")
BOOL_OPTIONS = ("parallel_tails", "fused_rope", "float_logits", "attn_split_two", "attn_dynamic_parts")
# kernel options set while a variant's graph is captured: runtime.kernels.gemv.OPTIONS["fold"] (0, 1, 2, "table"),
# runtime.kernels.paged_attention.OPTIONS["split_two"] (1 / 0: 2 key partitions at 16-31 streams or none)
# OPTIONS["max_parts"] (attn_max_parts: at most this many key partitions) and OPTIONS["dynamic_parts"]
# (attn_dynamic_parts 1 / 0: partitions of each sequence's context or of the table's span), OPTIONS["launch"]
# (attn_launch=BN:W:S, the decode kernel's key tile, warps and stages wherever keys are not split),
# runtime.fp8.OPTIONS["act_quant"] (fp8_act_quant=triton / torch: how FP8 products of > 16 rows quantize x)
# and OPTIONS["weight_only"] (fp8_weight_only=table / off: the weight-only kernel for the 17-64-row products
# its table names, or `torch._scaled_mm` for all), runtime.kernels.gemv.OPTIONS["l2_slice"] (gemv_l2_slice=N:
# the one-row GEMV asks L2 for the first N bytes of each program's weights before its PDL wait; -1 all, 0 none)
# and paged_attention.OPTIONS["l2_kv"] (attn_l2=1 / 0: split-key attention asks L2 for its first key's rows)
KERNEL_OPTIONS = {"gemv_fold": (gemv_mod.OPTIONS, "fold"), "attn_split_two": (attn_mod.OPTIONS, "split_two"),
                  "attn_max_parts": (attn_mod.OPTIONS, "max_parts"),
                  "attn_dynamic_parts": (attn_mod.OPTIONS, "dynamic_parts"),
                  "attn_split_two_below": (attn_mod.OPTIONS, "split_two_below"),
                  "attn_launch": (attn_mod.OPTIONS, "launch"), "fp8_act_quant": (fp8_mod.OPTIONS, "act_quant"),
                  "fp8_weight_only": (fp8_mod.OPTIONS, "weight_only"), "gemv_l2_slice": (gemv_mod.OPTIONS, "l2_slice"),
                  "attn_l2": (attn_mod.OPTIONS, "l2_kv")}


def skipping_ops(names: list[str]) -> TritonOps:
    """TritonOps whose `names` (add_rmsnorm, silu_mul) launch no kernel: a ceiling, not a computation."""
    ops = TritonOps()
    stand_ins = {"add_rmsnorm": lambda x, residual, weight, eps: (x, x if residual is None else residual),
                 "silu_mul": lambda gate_up: gate_up[:, : gate_up.shape[1] // 2]}
    for name in names:
        if name not in stand_ins:
            raise ValueError(f"ops_skip: {name!r} is not one of {sorted(stand_ins)}")
        setattr(ops, name, stand_ins[name])
    return ops


def parse_variant(text: str) -> tuple[str, int, dict]:
    """"bf16/1/one_row=mixed,pdl=wait,parallel_tails=1" -> ("bf16", 1, {"one_row": "mixed", ...})."""
    parts = text.split("/")
    if len(parts) != 3 or parts[0] not in ("bf16", "fp8") or not parts[1].isdigit():
        raise ValueError(f"variant {text!r}: expected weights/batch/options, weights bf16 or fp8")
    options: dict = {}
    for item in filter(None, parts[2].split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"variant {text!r}: option {item!r} is not key=value")
        if value == "none" and key == "attn_max_parts":
            options[key] = None
        elif key == "attn_launch":
            options[key] = tuple(int(v) for v in value.split(":"))
        elif key in INT_OPTIONS or key in ("gemv_l2_slice", "attn_l2") or (key == "gemv_fold" and value.isdigit()):
            options[key] = int(value)
        elif key in BOOL_OPTIONS:
            options[key] = value == "1"
        else:
            options[key] = value
    return parts[0], int(parts[1]), options


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", action="append", required=True, help="weights/batch/options (repeat)")
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="block-table width of the graphs (default: context + 64); serving's configs use 4096")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="untimed replays before each variant's timed ones")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    specs = [parse_variant(v) for v in args.variant]
    device = torch.device("cuda")
    result: dict = {"bench": "decode_ab", "command": shlex.join(["python", "bench/decode_ab.py", *argv]),
                    "device_name": torch.cuda.get_device_name(device), "torch": torch.__version__,
                    "copy_gbps": round(copy_bandwidth_gbps(device), 1), "context_len": args.context_len,
                    "max_model_len": args.max_model_len or args.context_len + 64}
    batches = sorted({s[1] for s in specs})
    setup = DecodeSetup(batches, args.context_len, fp8=any(s[0] == "fp8" for s in specs))
    config, weights, cache, inputs, ctx = setup.config, setup.weights, setup.cache, setup.inputs, setup.context_len
    ops = TritonOps()
    log("model ready")

    runners, logits, rows = [], [], []
    for text, (w, b, options) in zip(args.variant, specs, strict=True):
        options = dict(options)
        fallback = options.pop("ops_fallback", "")  # ops run on PyTorch in this variant, "+"-separated
        skipped = options.pop("ops_skip", "")  # ops that launch nothing in this variant (a ceiling), "+"-separated
        variant_ops = TritonOps(fallback=fallback.split("+")) if fallback else ops
        if skipped:
            variant_ops = skipping_ops(skipped.split("+"))
        kernel_options = [(KERNEL_OPTIONS[k], v) for k, v in options.items() if k in KERNEL_OPTIONS]
        before = [(table, key, table[key]) for (table, key), _ in kernel_options]
        for (table, key), value in kernel_options:
            table[key] = value
        try:
            runner = DecodeGraphRunner(
                FastForward(weights[w], variant_ops, **{k: v for k, v in options.items() if k not in KERNEL_OPTIONS}),
                cache, max_model_len=args.max_model_len or ctx + 64, buckets=[b])
            runner.capture()
        finally:
            for table, key, value in before:
                table[key] = value
        out = tuple(t.clone() for t in runner.run(*inputs[b]))
        # (a ceiling variant's values run unnormalised through 40 layers: only their shapes are checked)
        assert all(o.shape[0] == b and (skipped or bool(torch.isfinite(o).all())) for o in out), text
        base = next(i for i, s in enumerate(specs) if s[:2] == (w, b) and "ops_skip=" not in args.variant[i])
        row: dict = {"variant": text, "weights": w, "batch": b, "options": options,
                     "one_row": runner.forward.one_row, "pdl": runner.forward.pdl,
                     "matrix_bytes": weights[w].matrix_bytes()}
        if skipped:
            row["ceiling_without"] = skipped.split("+")
        elif base != len(runners):
            row["vs"] = args.variant[base]
            # (widened: a variant may return float32 logits where its base returns bf16, `float_logits`)
            row["logits_equal"] = all(torch.equal(x.float(), y.float()) for x, y in zip(out, logits[base], strict=True))
            row["logits_vs"] = logit_compare(out, logits[base])
        runners.append(runner)
        logits.append(out)
        rows.append(row)
    log(f"captured {len(runners)} graphs")

    # keyed by position: the same variant may be given twice (a duplicate baseline)
    timed = time_interleaved({str(i): r.graphs[r.buckets[0]].replay for i, r in enumerate(runners)}, args.warmup,
                             args.reps, args.rounds)
    kv_per_token = kv_bytes_per_block(config, 1, torch.bfloat16)
    for i, row in enumerate(rows):
        ts = timed[str(i)]["round_medians_ms"]
        med = statistics.median(ts)
        moved = row["matrix_bytes"] + row["batch"] * (ctx + 1) * kv_per_token
        row.update({"median_ms": round(med, 4), "rounds_ms": [round(t, 4) for t in ts],
                    "copy_fraction": round(moved / (med / 1e3) / 1e9 / result["copy_gbps"], 3)})
        log(f"{row['variant']}: {med:.4f} ms " + json.dumps({k: row[k] for k in ("rounds_ms", "copy_fraction")}))
    result["variants"] = rows
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
