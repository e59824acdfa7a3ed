"""Launch shapes of the fused anti-aliased activation kernel on one GPU, against a copy of the same tensor.

    python bench/aa_snake_tune.py --out bench/results/aa-snake-tune-h200.json
    python bench/aa_snake_tune.py --layout nwc --out bench/results/aa-snake-nwc-tune-h200.json

Shapes are BigVGAN `full` activations of a 64-stream steady step (134-frame windows): stage 1 (768
channels, 670 steps) to stage 6 (24 channels, 64320 steps), bf16. Each launch shape is first checked
against the package's Activation1d (max abs difference), then timed (CUDA events, median of 20);
`copy_ms` is `x.clone()` of the same tensor in the same run: the memory-traffic floor of a kernel that
reads x once and writes y once.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from bigvgan.activations import SnakeBeta
from bigvgan.alias_free_activation.torch.act import Activation1d

from bench.engine import time_fn
from vocoder.kernels.aa_snake import _aa_snake_nwc, aa_snake, nwc_launch


def time_ms(fn: Callable[[], object]) -> float:
    """Median of 20 CUDA-event timings after one warm-up call (bench.engine.time_fn)."""
    return time_fn(fn, torch.device("cuda"), warmup=1, reps=20).median_ms


def activation_case(channels: int, length: int, batch: int, *, time_major: bool = False):
    """A seeded SnakeBeta `Activation1d` of `channels`, a bf16 input [batch, channels, length] (stored
    time-major if asked) and the module's float32 output on it: (act, x, ref)."""
    torch.manual_seed(0)
    act = Activation1d(SnakeBeta(channels, alpha_logscale=True)).cuda()
    with torch.no_grad():
        for p in act.act.parameters():
            p.normal_(0, 0.5)
    if time_major:
        x = torch.randn(batch, length, channels, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    else:
        x = torch.randn(batch, channels, length, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = act(x.float())
    return act, x, ref


def save(rows: list[dict], out: str) -> None:
    """The rows so far as the tool's JSON (with its command) at `out`, if given."""
    result = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(), "rows": rows}
    if out:
        Path(out).write_text(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--layout", choices=("ncw", "nwc"), default="ncw",
                    help="nwc: the channels-last kernels on time-major tensors ((rows, channel block, warps))")
    ap.add_argument("--nwc-launches", default="64x32x4,32x64x4,64x64x4,128x32x4,64x32x2,32x32x2,64x16x2",
                    help="--layout nwc: (rows)x(channel block)x(warps) shapes of the gathering kernel to time")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    args.nwc_launches = [tuple(int(v) for v in item.split("x")) for item in args.nwc_launches.split(",")]
    if args.layout == "nwc":
        tune_nwc(args)
        return
    rows = []
    for channels, length in [(768, 670), (384, 2680), (192, 8040), (24, 64320)]:
        act, x, ref = activation_case(channels, length, args.batch)
        filters = (act.upsample.filter, act.downsample.lowpass.filter)
        copy_ms = time_ms(x.clone)
        row = {"channels": channels, "length": length, "copy_ms": round(copy_ms, 4), "launches": []}
        for direct, block, warps in [(True, None, None)] + [
            (False, b, w) for b in (64, 128, 256, 512, 1024, 2048) for w in (1, 2, 4, 8) if b // (32 * w) >= 1
        ]:
            run = functools.partial(
                aa_snake,
                x,
                act.act.alpha,
                act.act.beta,
                *filters,
                log_scale=True,
                direct=direct,
                block=block,
                num_warps=warps,
            )
            err = float((run().float() - ref).abs().max())
            ms = time_ms(run)
            row["launches"].append(
                {"direct": direct, "block": block, "warps": warps, "ms": round(ms, 4), "max_abs": err}
            )
        best = min(row["launches"], key=lambda r: r["ms"])
        row["best"] = best
        default = functools.partial(aa_snake, x, act.act.alpha, act.act.beta, *filters, log_scale=True)
        row["default_ms"] = round(time_ms(default), 4)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "launches"}), flush=True)
    save(rows, args.out)


def tune_nwc(args: argparse.Namespace) -> None:
    """The channels-last kernels (vocoder/kernels/aa_snake.py `_aa_snake_nwc`) on the same activations stored
    time-major: the direct kernel and the gathering one under each (rows, channel block, warps)."""
    rows = []
    for channels, length in [(768, 670), (384, 2680), (192, 8040), (96, 16080), (48, 32160), (24, 64320)]:
        act, x, ref = activation_case(channels, length, args.batch, time_major=True)
        filters = tuple(f.reshape(-1).float().contiguous() for f in (act.upsample.filter,
                                                                     act.downsample.lowpass.filter))
        flags = {"LOG_SCALE": True, "HAS_BETA": True}
        row = {"channels": channels, "length": length, "copy_ms": round(time_ms(x.clone), 4),
               "default_launch": nwc_launch(channels), "launches": []}
        candidates = [(False, None)] + [(True, launch) for launch in args.nwc_launches]
        for gather, launch in candidates:
            run = functools.partial(_aa_snake_nwc, x, (act.act.alpha, act.act.beta), filters, flags,
                                    gather=gather, launch=launch)
            try:
                err = float((run().float() - ref).abs().max())
                ms = time_ms(run)
            except Exception as exc:  # noqa: BLE001 - a launch shape that does not compile is reported
                row["launches"].append({"gather": gather, "launch": launch, "error": str(exc)[:200]})
                continue
            row["launches"].append({"gather": gather, "launch": launch, "ms": round(ms, 4), "max_abs": err})
        row["best"] = min((r for r in row["launches"] if "ms" in r), key=lambda r: r["ms"])
        row["default_ms"] = next(r["ms"] for r in row["launches"] if r.get("launch") == row["default_launch"]
                                 and "ms" in r)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "launches"}), flush=True)
        save(rows, args.out)  # after every shape: a run cut short keeps what it measured


if __name__ == "__main__":
    main()
