"""One-row FP8 products on the tensor cores in float16, against the serving FP8 GEMV (an experiment).

    python bench/fp8_dot_gemv.py --out bench/results/fp8-dot-gemv-h200/sweep.json

Why: the serving one-row FP8 GEMV (runtime/kernels/gemv.py) reads its weights at ~2.9 TB/s against ~4.2 TB/s
for bf16. It widens every FP8 weight to float32 on the conversion unit (`cvt.rn.f16x2.e4m3x2`, then one
`cvt.f32.f16` per element) and multiplies on the FMA units: 1.5 conversions per weight byte, which at the
H200's 16 conversions per SM and clock caps the rate near 2.8 TB/s. Here the weights are widened only to
float16 (one conversion per two weights, exact for e4m3) and multiplied on the tensor cores against the
activation row in float16 (padded to 16 rows), accumulating in float32 (`tl.dot`). The runtime's small-batch
FP8 kernel (runtime/kernels/fp8_gemv.py) widens to bfloat16 instead, which has no direct conversion from e4m3.

For each of the model's FP8 matrices (no prologue, so all kernels do the same work): the serving GEMV with its
table tile, the small-batch kernel at one row, and the float16 dot kernel over a list of launch shapes, each
checked against a float32 product of the dequantized weights first, then timed per call inside a CUDA graph
of 16 calls over 4 weight copies (2 for the text head), so L2 holds none of them. Device copy rate = roofline.
"""
from __future__ import annotations

import argparse
import functools
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import triton
import triton.language as tl

from bench.fast_tools import copy_bandwidth_gbps, emit, fastest, graph_us_per_call, log
from bench.gemv_tune import CALLS, MATRICES
from runtime.fp8 import quantize_weight
from runtime.kernels.fp8_gemv import fp8_gemv
from runtime.kernels.gemv import NONE, gemv, gemv_tile

# (BLOCK_N, BLOCK_K, warps, stages, weights as the dot's left operand)
SHAPES = [(16, 256, 4, 3, False), (16, 512, 4, 3, False), (32, 256, 4, 3, False), (32, 512, 4, 3, False),
          (16, 1024, 4, 2, False), (32, 1024, 4, 2, False), (64, 128, 4, 4, True), (64, 256, 4, 3, True),
          (64, 256, 4, 4, True), (64, 512, 4, 3, True), (128, 128, 4, 4, True), (128, 256, 8, 3, True),
          (32, 256, 4, 3, True), (64, 256, 4, 3, False)]


@triton.jit
def _dot_f16_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    W_LEFT: tl.constexpr):
    pid = tl.program_id(0)
    n = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    nmask = n < N
    r = tl.arange(0, 16)
    if W_LEFT:
        acc = tl.zeros([BLOCK_N, 16], tl.float32)
    else:
        acc = tl.zeros([16, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=nmask[:, None], other=0.0).to(tl.float16)
        xv = tl.load(x_ptr + k).to(tl.float32)
        if W_LEFT:
            xb = tl.where(r[None, :] == 0, xv[:, None], 0.0).to(tl.float16)  # [BK, 16], column 0 = x
            acc += tl.dot(w, xb)
        else:
            xb = tl.where(r[:, None] == 0, xv[None, :], 0.0).to(tl.float16)  # [16, BK], row 0 = x
            acc += tl.dot(xb, tl.trans(w))
    if W_LEFT:
        out = tl.sum(tl.where(r[None, :] == 0, acc, 0.0), axis=1)
    else:
        out = tl.sum(tl.where(r[:, None] == 0, acc, 0.0), axis=0)
    out = out * tl.load(s_ptr + n, mask=nmask, other=0.0)
    tl.store(out_ptr + n, out.to(out_ptr.dtype.element_ty), mask=nmask)


def dot_f16(x, w, scale, out, bn, bk, warps, stages, w_left):
    n, k = w.shape
    _dot_f16_kernel[(triton.cdiv(n, bn),)](x, w, scale, out, n, k, BLOCK_N=bn, BLOCK_K=bk, W_LEFT=w_left,
                                           num_warps=warps, num_stages=stages)
    return out


def measure_matrix(name: str, dev: torch.device, over_budget) -> dict:
    """The serving GEMV, the small-batch kernel and the float16 dot kernel's shapes on one FP8 matrix."""
    n, k, _ = MATRICES[name]
    copies = 2 if n > 100000 else 4
    mats = [quantize_weight(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02) for _ in range(copies)]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    ref = (x.float() @ (mats[0].weight.float() * mats[0].scale[:, None]).t())[0]
    tol = 0.02 * float(ref.abs().max()) + 1e-3
    nbytes = n * k
    row: dict = {"matrix": name, "n": n, "k": k, "bytes": nbytes, "tolerance": round(tol, 5), "shapes": []}

    def timed(fn, label: str) -> dict:
        got = fn(0)[0].float()
        err = float((got - ref).abs().max())
        entry: dict = {"kernel": label, "max_abs_err": round(err, 5), "ok": err <= tol}
        if entry["ok"]:
            us = graph_us_per_call([functools.partial(fn, i % copies) for i in range(CALLS)])
            entry.update(us=round(us, 2), gbps=round(nbytes / us / 1e3, 1))
        return entry

    row["serving_gemv"] = {"tile": gemv_tile(1, n, k), **timed(
        lambda i: gemv(x, mats[i].weight, scale=mats[i].scale, prologue=NONE)[0], "gemv")}
    row["small_batch_bf16_dot"] = timed(lambda i: fp8_gemv(x, mats[i].weight, mats[i].scale), "fp8_gemv")
    log(f"{name}: serving {row['serving_gemv']} small-batch {row['small_batch_bf16_dot']}")
    outs = [torch.empty(1, n, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
    for bn, bk, warps, stages, w_left in SHAPES:
        if k % bk or over_budget():
            continue
        label = f"dot_f16 {bn}x{bk} w{warps} s{stages} {'w-left' if w_left else 'x-left'}"
        try:
            entry = timed(functools.partial(_dot_call, x, mats, outs, (bn, bk, warps, stages, w_left)), label)
        except Exception as exc:  # noqa: BLE001 - reported in the JSON
            entry = {"kernel": label, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        row["shapes"].append(entry)
        log(f"{name}: {entry}")
    row["best_dot"] = fastest(row["shapes"])
    return row


def _dot_call(x, mats, outs, shape, i: int) -> torch.Tensor:
    return dot_f16(x, mats[i].weight, mats[i].scale, outs[i], *shape)


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--matrices", default=",".join(MATRICES))
    ap.add_argument("--budget-s", type=float, default=400.0)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    dev = torch.device("cuda")
    result: dict = {"bench": "fp8_dot_gemv", "command": shlex.join(["python", "bench/fp8_dot_gemv.py", *argv]),
                    "device_name": torch.cuda.get_device_name(dev), "copy_gbps": round(copy_bandwidth_gbps(dev), 1),
                    "matrices": []}
    log(f"copy {result['copy_gbps']} GB/s")
    torch.manual_seed(0)
    for name in args.matrices.split(","):
        result["matrices"].append(measure_matrix(name, dev, lambda: time.perf_counter() - t_start > args.budget_s))
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
