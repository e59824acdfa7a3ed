"""Tile shapes of the one-row GEMV (runtime/kernels/gemv.py) for the four layer matrices, bf16 and FP8.

    python bench/gemv_tune.py --out bench/results/gemv-tune-h200.json
    python bench/gemv_tune.py --in-step --out bench/results/gemv-tune-step-h200.json
    python bench/gemv_tune.py --settings "fold=0;fold=1" --out sweep.json
    python bench/gemv_tune.py --in-step --set fold=1 --from-sweep sweep.json --seed-table --baseline fold=0 --out ...
    python bench/gemv_tune.py --ab "fold=0;fold=1" --modes fp8_gemv,bf16_mixed2 --out ...

Each matrix runs with the prologue the decode step gives it (QKV, gate/up and the heads: residual add +
RMSNorm; o: none; down: SiLU-mul). For every launch shape (BLOCK_N x BLOCK_K, warps) the output is first
checked against a float32 reference, then timed per call inside a CUDA graph of 16 calls over 4 weight
copies (2 for the text head), so L2 holds none of them. In the same run: `gemv()` as the serving path
calls it (the tile of its table, runtime/kernels/gemv.py TILES or TILES_FOLD), cuBLAS on the same bf16 matrix without
a prologue (the plain product), and the device copy rate (the memory roofline). Pipeline stages are not
swept: an earlier sweep of 1, 2 and 3 found them within 1% of each other everywhere. The kernel's launch
options (runtime/kernels/gemv.py OPTIONS) are as `--set` gives them, or each of `--settings` in turn.

`--in-step` tunes the table where it is used: the full random-weight model's one-stream decode step
(512-token context, CUDA graph, audio tail on its own stream as in serving, PDL as `--pdl`) is captured
and timed once per candidate tile of one matrix at a time (coordinate descent over the matrices, 8
candidate tiles each), for each of `--modes` (the GEMV's matrices of that one-row mode).

`--ab` times that same step under each setting of the GEMV options, in `--rounds` interleaved rounds
(median per setting), and compares each setting's logits with the first's (options that only change
scheduling must leave them bit-identical).
"""
from __future__ import annotations

import argparse
import functools
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
import triton

from bench.fast_tools import copy_bandwidth_gbps, emit, fastest, graph_us_per_call, log
from runtime.fast_ops import TorchOps
from runtime.fp8 import quantize_weight
from runtime.kernels.gemv import (
    NONE,
    OPTIONS,
    RMSNORM,
    SILU_MUL,
    _gemv_kernel,
    gemv,
    gemv_tile,
    prologue_launch,
)

MATRICES = {"qkv": (6144, 4096, RMSNORM), "o": (4096, 4096, NONE), "gate_up": (24576, 4096, RMSNORM),
            "down": (4096, 12288, SILU_MUL), "text_head": (151680, 4096, RMSNORM),
            "audio_head": (16512, 4096, RMSNORM)}
CALLS = 16


def shapes(wide: bool = False) -> list[tuple[int, int, int]]:
    """(BLOCK_N, BLOCK_K, warps): tiles of 2k-32k elements (`wide`, for the "fold" kernel: 2k-64k, also
    BLOCK_N 1-2 and BLOCK_K 4096), 8 warps from 16k elements up, and the same tiles with the other warp
    count from 8k up."""
    out = set()
    for bn in (1, 2, 4, 8, 16, 32) if wide else (4, 8, 16, 32):
        for bk in (256, 512, 1024, 2048, 4096) if wide else (256, 512, 1024, 2048):
            if 2048 <= bn * bk <= (65536 if wide else 32768):
                out.add((bn, bk, 8 if bn * bk >= 16384 else 4))
                if bn * bk >= 8192:
                    out.add((bn, bk, 4 if bn * bk >= 16384 else 8))
    return sorted(out)


def reference(x: torch.Tensor, w: torch.Tensor, prologue: int, res: torch.Tensor, nw: torch.Tensor) -> torch.Tensor:
    """float32 prologue(x) @ w.T (w already dequantized), through the reference ops of runtime/fast_ops.py."""
    xf = x.float()
    if prologue == RMSNORM:
        xf, _ = TorchOps.add_rmsnorm(xf, res.float(), nw.float(), 1e-6)
    elif prologue == SILU_MUL:
        xf = TorchOps.silu_mul(xf)
    return xf @ w.float().t()


def launch(x, res, nw, res_out, w, scale, out, prologue, bn, bk, warps, fold):
    n, k = w.shape
    _gemv_kernel[(triton.cdiv(n, bn),)](
        x, res, nw, res_out, w, scale if scale is not None else w, out, n, k, 1e-6,
        PROLOGUE=prologue, HAS_RES=prologue == RMSNORM, HAS_SCALE=scale is not None, USE_PDL=False,
        BLOCK_N=bn, BLOCK_K=bk, FOLD=fold, num_warps=warps, num_stages=1,
        **prologue_launch(prologue, k, w.element_size()))


CANDIDATES = [(4, 1024, 4), (8, 512, 4), (8, 1024, 4), (16, 256, 4), (16, 512, 4), (16, 1024, 8), (32, 256, 4),
              (32, 512, 8)]
STEP_MODES = {"fp8_gemv": ("fp8", "gemv"), "bf16_gemv": ("bf16", "gemv"), "bf16_mixed": ("bf16", "mixed"),
              "bf16_mixed2": ("bf16", "mixed2")}


def parse_settings(text: str) -> list[dict]:
    """"fold=0;fold=1" -> one dict of runtime.kernels.gemv.OPTIONS values each."""
    out = []
    for item in filter(None, text.split(";")):
        setting = {}
        for pair in filter(None, item.split(",")):
            key, _, value = pair.partition("=")
            if key not in OPTIONS:
                raise SystemExit(f"unknown GEMV option {key!r}; known: {sorted(OPTIONS)}")
            setting[key] = int(value) if value.isdigit() else value
        out.append(setting)
    return out


def _label(setting: dict) -> str:
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(setting.items())) or "default"


class StepBench:
    """The full random-weight model's one-stream decode step as serving captures it, for one mode."""

    def __init__(self, pdl: str) -> None:
        from bench.fast_tools import DecodeSetup

        self.pdl = pdl
        setup = DecodeSetup([1])
        self.config, self.weights, self.cache, self.context_len = (setup.config, setup.weights, setup.cache,
                                                                   setup.context_len)
        self.run_args = setup.inputs[1]

    def step(self, mode: str) -> tuple[float, tuple[torch.Tensor, ...]]:
        """Capture the step of `mode` (STEP_MODES) under the GEMV options in force; (median ms, logits)."""
        from bench.fast_tools import time_ms
        from runtime.cuda_graph import DecodeGraphRunner
        from runtime.fast_forward import FastForward
        from runtime.fast_ops import TritonOps

        weights, one_row = STEP_MODES[mode]
        fast = FastForward(self.weights[weights], TritonOps(), one_row=one_row, pdl=self.pdl)
        runner = DecodeGraphRunner(fast, self.cache, max_model_len=1024, buckets=[1], audio_only=False)
        runner.capture()
        logits = tuple(x.clone() for x in runner.run(*self.run_args))
        ms = time_ms(runner.graphs[1].replay, 3, 20)["median_ms"]
        del runner
        return ms, logits


def _drift(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> dict:
    return {"max_abs_logit_diff": max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True)),
            "top1_equal": all(torch.equal(x.argmax(-1), y.argmax(-1)) for x, y in zip(a, b, strict=True)),
            "finite": all(bool(torch.isfinite(x).all()) for x in a)}


def _rounds(bench: StepBench, mode: str, names: list[str], rounds: int, put: Callable[[str], None]
            ) -> tuple[dict[str, list[float]], dict[str, tuple[torch.Tensor, ...]]]:
    """Step times of `mode` under each name's setting (`put(name)` puts it in force before the capture), in
    `rounds` rounds whose order reverses every other round, and each name's logits from its first round."""
    times: dict[str, list[float]] = {name: [] for name in names}
    first: dict[str, tuple[torch.Tensor, ...]] = {}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            put(name)
            ms, logits = bench.step(mode)
            times[name].append(ms)
            first.setdefault(name, logits)
    return times, first


def _interleaved(bench: StepBench, mode: str, settings: dict[str, dict], rounds: int
                 ) -> tuple[dict[str, list[float]], dict[str, tuple[torch.Tensor, ...]]]:
    """`_rounds` over settings of the GEMV options (over those in force); the options are restored."""
    base = dict(OPTIONS)
    try:
        return _rounds(bench, mode, list(settings), rounds, lambda name: OPTIONS.update(base | settings[name]))
    finally:
        OPTIONS.update(base)


def _interleaved_tables(bench: StepBench, mode: str, tables: dict[str, dict], rounds: int
                        ) -> tuple[dict[str, list[float]], dict[str, tuple[torch.Tensor, ...]]]:
    """`_rounds` over tile tables: each named set of (key -> tile) entries is put into the table in force
    while its step is captured; the table is restored."""
    from runtime.kernels import gemv as gemv_mod

    live = gemv_mod.tiles()
    saved = dict(live)
    try:
        return _rounds(bench, mode, list(tables), rounds, lambda name: live.update(tables[name]))
    finally:
        live.clear()
        live.update(saved)


def ab_in_step(args: argparse.Namespace) -> dict:
    """Each `--ab` setting of the GEMV options, in interleaved rounds (order reversed every other round)."""
    settings = {_label(s): s for s in parse_settings(args.ab)}
    bench = StepBench(args.pdl)
    out: dict = {"context_len": bench.context_len, "pdl": args.pdl, "rounds": args.rounds, "modes": []}
    for mode in args.modes.split(","):
        times, first = _interleaved(bench, mode, settings, args.rounds)
        ref = first[next(iter(settings))]
        rows = [{"setting": label, "median_ms": round(statistics.median(t), 4), "round_ms": t,
                 **_drift(first[label], ref)} for label, t in times.items()]
        for row in rows:
            log(f"{mode}: {row}")
        out["modes"].append({"mode": mode, "settings": rows})
    return out


def _from_sweep(paths: str) -> dict[tuple[int, int, int], list[tuple[int, ...]]]:
    """Per table key, the tiles of sweeps (bench/gemv_tune.py JSON, comma-separated paths) run under the
    fold mode in force, fastest first: (BLOCK_N, BLOCK_K, warps) for mode 0, else with the mode appended;
    under "table", the sweeps of modes 1 and 2 ranked together."""
    mode = OPTIONS["fold"]
    runs: dict[tuple[int, int, int], list[tuple[float, tuple[int, ...]]]] = {}
    for path in paths.split(","):
        for row in json.loads(Path(path).read_text())["matrices"]:
            fold = int(row["options"].get("fold", 0))
            if fold != mode and not (mode == "table" and fold in (1, 2)):
                continue
            key = (1 if row["dtype"] == "fp8" else 2, row["n"], row["k"])
            runs.setdefault(key, []).extend(
                (e["us"], (e["block_n"], e["block_k"], e["warps"], *((fold,) if mode != 0 else ())))
                for e in row["shapes"] if "us" in e)
    return {key: list(dict.fromkeys(tile for _, tile in sorted(found))) for key, found in runs.items()}


def tune_in_step(args: argparse.Namespace) -> dict:
    """Coordinate descent on the tile table in force (runtime.kernels.gemv.tiles()), timing the captured
    one-stream decode step. With `--from-sweep`, each matrix tries the sweep's fastest tiles (else
    CANDIDATES), starting from the table in force or, with `--seed-table`, from the sweep's fastest. With
    `--baseline`, the tuned step is then timed against the step under those options (and their own table)
    in `--rounds` interleaved rounds."""
    from runtime.kernels import gemv as gemv_mod

    t_start = time.perf_counter()
    bench = StepBench(args.pdl)
    table = gemv_mod.tiles()
    seeds = _from_sweep(args.from_sweep) if args.from_sweep else {}
    if args.seed_table:
        for key, ranked in seeds.items():
            if ranked:
                table[key] = ranked[0]
    layer_keys = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]
    head_keys = [(bench.config.vocab_size, 4096), (bench.config.audio_vocab_size, 4096)]
    plan = {"fp8_gemv": [(1, *k) for k in layer_keys + head_keys], "bf16_gemv": [(2, *k) for k in layer_keys + head_keys],
            "bf16_mixed": [(2, 4096, 4096), (2, 4096, 12288)],
            "bf16_mixed2": [(2, 6144, 4096), (2, 4096, 4096), (2, 4096, 12288)]}
    out: dict = {"context_len": bench.context_len, "pdl": args.pdl, "options": dict(OPTIONS),
                 "start_table": {str(k): v for k, v in table.items()}, "modes": []}
    for name in args.modes.split(","):
        keys = plan[name]
        for key in keys:
            table.setdefault(key, gemv_tile(*key)[: 3 if OPTIONS["fold"] == 0 else 4])
        start_ms, ref = bench.step(name)
        best_ms = start_ms
        trials = []
        for key in keys:
            fallback = CANDIDATES if OPTIONS["fold"] == 0 else [(*c, 1) for c in CANDIDATES]
            for tile in (seeds.get(key) or fallback)[: args.candidates]:
                if tile == table[key] or time.perf_counter() - t_start > args.budget_s:
                    continue
                before = table[key]
                table[key] = tile
                ms, logits = bench.step(name)
                drift = _drift(logits, ref)
                trials.append({"key": list(key), "tile": list(tile), "step_ms": ms, **drift})
                if drift["finite"] and drift["max_abs_logit_diff"] < 1.0 and ms < best_ms:
                    best_ms = ms
                else:
                    table[key] = before
            log(f"{name} {key}: {table[key]} -> step {best_ms:.3f} ms")
        end_ms, end_logits = bench.step(name)
        entry = {"mode": name, "start_step_ms": start_ms, "best_step_ms": best_ms, "final_table_step_ms": end_ms,
                 "table": {str(k): list(table[k]) for k in keys}, "trials": trials}
        if args.confirm_rounds:
            start = {key: tuple(tile) for key, tile in out["start_table"].items()}
            start_tiles = {key: start[str(key)] for key in keys if str(key) in start}
            tuned_tiles = {key: table[key] for key in keys}
            rounds, first = _interleaved_tables(bench, name, {"start": start_tiles, "tuned": tuned_tiles},
                                                args.confirm_rounds)
            entry.update(start_median_ms=round(statistics.median(rounds["start"]), 4),
                         tuned_median_ms=round(statistics.median(rounds["tuned"]), 4), confirm_rounds_ms=rounds,
                         tuned_vs_start=_drift(first["tuned"], first["start"]))
            log(f"{name}: interleaved, start table {entry['start_median_ms']:.4f} ms, tuned {entry['tuned_median_ms']:.4f} ms")
        if args.baseline:
            baseline = parse_settings(args.baseline)[0]
            rounds, first = _interleaved(bench, name, {"tuned": {}, "baseline": baseline}, args.rounds)
            entry.update(baseline=_label(OPTIONS | baseline),
                         baseline_median_ms=round(statistics.median(rounds["baseline"]), 4),
                         tuned_median_ms=round(statistics.median(rounds["tuned"]), 4), rounds_ms=rounds,
                         baseline_vs_tuned=_drift(first["baseline"], end_logits))
            log(f"{name}: tuned {entry['tuned_median_ms']:.3f} ms vs baseline {entry['baseline']} "
                f"{entry['baseline_median_ms']:.3f} ms; {entry['baseline_vs_tuned']}")
        out["modes"].append(entry)
        log(f"{name}: first {start_ms:.3f} -> tuned {end_ms:.3f} ms")
    out["final_table"] = {str(k): list(v) for k, v in table.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--in-step", action="store_true", help="tune inside the decode step (see the docstring)")
    ap.add_argument("--ab", default="", help="A/B GEMV option settings inside the decode step, ';'-separated")
    ap.add_argument("--rounds", type=int, default=4, help="--ab / --baseline: interleaved rounds")
    ap.add_argument("--pdl", default="auto", help="--in-step / --ab: the PDL mode of the step")
    ap.add_argument("--modes", default="fp8_gemv,bf16_mixed2", help=f"--in-step / --ab: of {sorted(STEP_MODES)}")
    ap.add_argument("--dtypes", default="bf16,fp8", help="sweep: the weight types")
    ap.add_argument("--settings", default="", help="sweep: GEMV option settings, ';'-separated (default: as is)")
    ap.add_argument("--set", default="", help="GEMV options in force for the sweep and --in-step")
    ap.add_argument("--from-sweep", default="", help="--in-step: candidate tiles from this sweep JSON")
    ap.add_argument("--seed-table", action="store_true", help="--in-step: start from the sweep's fastest tiles")
    ap.add_argument("--candidates", type=int, default=8, help="--in-step: tiles tried per matrix")
    ap.add_argument("--baseline", default="", help="--in-step: options to time the tuned step against")
    ap.add_argument("--confirm-rounds", type=int, default=0,
                    help="--in-step: then time the start table against the tuned one in this many interleaved rounds")
    args = ap.parse_args()
    for setting in parse_settings(args.set):
        OPTIONS.update(setting)
    kind = "gemv_ab" if args.ab else "gemv_tune_in_step" if args.in_step else "gemv_tune"
    run = ab_in_step if args.ab else tune_in_step if args.in_step else sweep
    result = {"bench": kind, "command": shlex.join(["python", "bench/gemv_tune.py", *sys.argv[1:]]),
              "device_name": torch.cuda.get_device_name(), "torch": torch.__version__, **run(args)}
    emit(result, Path(args.out) if args.out else None)


def sweep(args: argparse.Namespace) -> dict:
    """Every tile of `shapes()` on each matrix alone, beside the table's tile and cuBLAS."""
    t_start = time.perf_counter()
    dev = torch.device("cuda")
    result: dict = {"copy_gbps": round(copy_bandwidth_gbps(dev), 1), "matrices": []}
    log(f"copy {result['copy_gbps']} GB/s")
    torch.manual_seed(0)
    for name, (n, k, prologue) in MATRICES.items():
        x_len = 2 * k if prologue == SILU_MUL else k
        x = torch.randn(1, x_len, device=dev, dtype=torch.bfloat16)
        res = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        nw = (1 + 0.1 * torch.randn(k, device=dev)).to(torch.bfloat16)
        res_out = torch.empty_like(res)
        copies = 2 if n > 100000 else 4
        bf = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        base = dict(OPTIONS)
        kinds = [(dtype, setting) for dtype in args.dtypes.split(",")
                 for setting in parse_settings(args.settings) or [{}]]
        quantized = [(q.weight, q.scale) for q in map(quantize_weight, bf)] if "fp8" in args.dtypes else []
        for dtype, setting in kinds:
            OPTIONS.update(base | setting)
            mats = [(w, None) for w in bf] if dtype == "bf16" else quantized
            w0, s0 = mats[0]
            deq = w0.float() * (s0[:, None] if s0 is not None else 1.0)
            ref = reference(x, deq, prologue, res, nw)[0]  # [N]
            tol = 0.02 * float(ref.abs().max()) + 1e-3
            row: dict = {"matrix": name, "n": n, "k": k, "dtype": dtype, "options": dict(OPTIONS),
                         "bytes": w0.numel() * w0.element_size(),
                         "ref_abs_max": round(float(ref.abs().max()), 4), "tolerance": round(tol, 5), "shapes": []}
            kw = {"prologue": prologue, "residual": res if prologue == RMSNORM else None,
                  "norm_weight": nw if prologue == RMSNORM else None}
            calls = [functools.partial(gemv, x, mats[i % copies][0], scale=mats[i % copies][1], **kw)
                     for i in range(CALLS)]
            got = gemv(x, w0, scale=s0, **kw)[0][0].float()
            us = graph_us_per_call(calls)
            row["table"] = {"tile": gemv_tile(w0.element_size(), n, k), "us": round(us, 2),
                            "gbps": round(row["bytes"] / us / 1e3, 1),
                            "max_abs_err": round(float((got - ref).abs().max()), 5)}
            if dtype == "bf16" and prologue == NONE:
                us = graph_us_per_call([functools.partial(F.linear, x, bf[i % copies]) for i in range(CALLS)])
                row["cublas_no_prologue"] = {"us": round(us, 2), "gbps": round(row["bytes"] / us / 1e3, 1)}
            fold = OPTIONS["fold"] if OPTIONS["fold"] != "table" else 1
            for bn, bk, warps in shapes(wide=fold != 0):
                if k % bk:
                    continue
                if time.perf_counter() - t_start > args.budget_s:
                    row["shapes"].append({"skipped": "time budget"})
                    break
                out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
                entry: dict = {"block_n": bn, "block_k": bk, "warps": warps}
                try:
                    launch(x, res, nw, res_out, w0, s0, out, prologue, bn, bk, warps, fold)
                    err = float((out[0].float() - ref).abs().max())
                    entry["max_abs_err"] = round(err, 5)
                    if not (err <= tol):
                        entry["ok"] = False
                    else:
                        outs = [torch.empty(1, n, device=dev, dtype=torch.bfloat16) for _ in range(CALLS)]
                        us = graph_us_per_call([functools.partial(
                            launch, x, res, nw, res_out, mats[i % copies][0], mats[i % copies][1], outs[i],
                            prologue, bn, bk, warps, fold) for i in range(CALLS)])
                        entry.update(ok=True, us=round(us, 2), gbps=round(row["bytes"] / us / 1e3, 1))
                except Exception as exc:  # noqa: BLE001 - reported in the JSON
                    entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                row["shapes"].append(entry)
            row["best"] = fastest(row["shapes"])
            log(f"{name} {dtype} {_label(setting)}: table {row['table']} best {row['best']}")
            result["matrices"].append(row)
        OPTIONS.update(base)
        del bf, mats, quantized
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    return result


if __name__ == "__main__":
    main()
