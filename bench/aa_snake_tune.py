"""Launch shapes of the fused anti-aliased activation kernel on one GPU, against a copy of the same tensor.

    python bench/aa_snake_tune.py --out bench/results/aa-snake-tune-h200.json

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
from vocoder.kernels.aa_snake import aa_snake


def time_ms(fn: Callable[[], object]) -> float:
    """Median of 20 CUDA-event timings after one warm-up call (bench.engine.time_fn)."""
    return time_fn(fn, torch.device("cuda"), warmup=1, reps=20).median_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rows = []
    for channels, length in [(768, 670), (384, 2680), (192, 8040), (24, 64320)]:
        torch.manual_seed(0)
        act = Activation1d(SnakeBeta(channels, alpha_logscale=True)).cuda()
        with torch.no_grad():
            for p in act.act.parameters():
                p.normal_(0, 0.5)
        x = torch.randn(args.batch, channels, length, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            ref = act(x.float())
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
    result = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
