"""Tiles of the flow estimator's fused linear (vocoder/kernels/flow_fused.py) for many-row steps.

    python bench/flow_linear_tiles.py --out bench/results/flow-linear-tiles-h200.json

For each of the four products of a transformer block of the `full` estimator (LN1+QKV 256->1536, out 512->256
+ bias + residual, LN2+FF1 256->1024 + bias + GELU, FF2 1024->256 + bias + residual) and each row count, the
PyTorch modules' sequence (layer norm, cuBLAS linear, GELU, add) and `fused_linear` with candidate tiles,
each checked against PyTorch first and then timed as 50 calls in one CUDA graph
(`bench.fast_tools.graph_us_per_call`). Then whole blocks (`ChunkTransformer`) fused with the default tiles
against PyTorch + the chunk attention kernel, at the same row counts. bf16.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fast_tools import emit, graph_us_per_call, log
from vocoder.flow_layers import ChunkTransformer
from vocoder.kernels import flow_fused

CANDIDATES = [(32, 32, 64, 4, 2), (64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 128, 64, 8, 3),
              (128, 64, 64, 4, 3), (128, 128, 64, 8, 3), (64, 256, 64, 8, 3), (128, 256, 64, 8, 2)]


def products(block: ChunkTransformer, x: torch.Tensor, a: torch.Tensor, f: torch.Tensor) -> dict:
    """kind -> (the PyTorch modules' computation, fused_linear(tiles) of the same): x [M, 256] block input,
    a [M, 512] attention output, f [M, 1024] GELU output."""
    n1, n2, ff1, ff2 = block.norm1, block.norm2, block.ff[0], block.ff[2]
    fl = flow_fused.fused_linear
    return {
        "ln_qkv": (lambda: F.linear(F.layer_norm(x, (256,), n1.weight, n1.bias, n1.eps), block.qkv.weight),
                   lambda t: fl(x, block.qkv.weight, norm=(n1.weight, n1.bias, n1.eps), tiles=t)),
        "out_res": (lambda: x + F.linear(a, block.out.weight, block.out.bias),
                    lambda t: fl(a, block.out.weight, block.out.bias, residual=x, tiles=t)),
        "ln_ff1_gelu": (lambda: F.gelu(F.linear(F.layer_norm(x, (256,), n2.weight, n2.bias, n2.eps), ff1.weight,
                                                ff1.bias)),
                        lambda t: fl(x, ff1.weight, ff1.bias, norm=(n2.weight, n2.bias, n2.eps), gelu=True, tiles=t)),
        "ff2_res": (lambda: x + F.linear(f, ff2.weight, ff2.bias),
                    lambda t: fl(f, ff2.weight, ff2.bias, residual=x, tiles=t)),
    }


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1280,5120,12800,51200")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    block = ChunkTransformer(256, 8, 64, 4, 4).to(dev, dt)
    for prm in block.parameters():
        prm.data.normal_(0.0, 0.1 if prm.dim() == 1 else 0.06)
    result: dict = {"command": "python " + " ".join(["bench/flow_linear_tiles.py", *argv]),
                    "device": torch.cuda.get_device_name(), "default_large_tiles": list(flow_fused.LARGE_TILES),
                    "small_rows": flow_fused.SMALL_ROWS, "linears": {}, "blocks": {}}
    for m in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(m, 256, device=dev, dtype=dt)
        a = torch.randn(m, 512, device=dev, dtype=dt)
        f = torch.randn(m, 1024, device=dev, dtype=dt).mul_(0.5)
        kinds = products(block, x, a, f)
        for kind, (ref_fn, fused_fn) in kinds.items():
            want = ref_fn().float()
            row: dict = {"torch_us": round(graph_us_per_call([ref_fn] * 50), 2)}
            for t in CANDIDATES:
                name = "x".join(map(str, t))
                try:
                    got = fused_fn(t).float()
                    err = float((got - want).abs().max())
                    if not (torch.isfinite(got).all() and err <= 0.05 * float(want.abs().max()) + 0.05):
                        row[name] = {"error": f"max abs {err}"}
                        continue
                    row[name] = {"us": round(graph_us_per_call([functools.partial(fused_fn, t)] * 50), 2),
                                 "max_abs": round(err, 4)}
                except Exception as exc:  # noqa: BLE001 - a tile that does not build is reported
                    row[name] = {"error": str(exc)[:200]}
            ok = {k: v["us"] for k, v in row.items() if isinstance(v, dict) and "us" in v}
            row["best"] = min(ok, key=ok.get) if ok else None
            result["linears"].setdefault(kind, {})[str(m)] = row
            log(f"{kind} M={m}: torch {row['torch_us']} us, best {row['best']} "
                f"{ok.get(row['best'])} us; " + json.dumps(ok))
        if args.out is not None:  # the sweep so far, in case a later part fails
            args.out.write_text(json.dumps(result, indent=1) + "\n")
        xb = x.view(1, m, 256)
        block.use_triton, block.fused_max_rows = True, 1 << 30
        brow = {}
        for fused in (True, False):
            block.fuse_linears = fused
            brow["fused_us" if fused else "torch_us"] = round(graph_us_per_call([functools.partial(block, xb)] * 50), 2)
        block.fuse_linears = True
        got = block(xb).float()
        block.fuse_linears = False
        want = block(xb).float()
        brow["max_abs_fused_vs_torch"] = round(float((got - want).abs().max()), 4)
        result["blocks"][str(m)] = brow
        log(f"block M={m}: {json.dumps(brow)}")
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
