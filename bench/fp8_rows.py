"""FP8-weight products for more than 16 rows, per layer matrix of the full shape and row count (H200):
- `torch._scaled_mm` with per-row FP8 activations (runtime/fp8.py), its activations quantized by one Triton
  kernel (`fp8_scaled_mm`, the default) or by the eager ops it used before (`fp8_scaled_mm_eager`);
- a weight-only Triton kernel (below), over a sweep of tiles;
- bf16 cuBLAS, the baseline.

    python bench/fp8_rows.py --out bench/results/fp8-rows-h200/fp8-rows.json

Every candidate is first checked against a float32 product with the dequantized weights (relative error
under 1e-2, all finite); then each product is timed per call in a CUDA graph of 16 calls over 4 weight
copies (L2 holds none of them). `gbps` counts the weight bytes once. The sweep stops starting new shapes
after `--budget-s`.

The weight-only kernel (probe, not adopted): out = x @ (w_fp8 * scale).T with x in bf16, each weight tile read
once as 1 byte per value, widened to bf16 in registers and multiplied on the tensor cores as the left operand
(the product computed transposed, W x^T); a program owns BN channels of BM rows over one K slice, grid (row
tiles, channel tiles, SPLIT), float32 partials summed in split order by a second kernel when SPLIT > 1.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fast_tools import copy_bandwidth_gbps, emit, graph_us_per_call, log
from runtime import fp8
from runtime.fp8 import _scaled_mm_linear, quantize_weight
from runtime.kernels.launch import pdl_args, pdl_enter


@triton.jit
def _fp8_gemm_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, M, N, K: tl.constexpr, K_SPLIT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PARTIAL: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    k_lo = pid_s * K_SPLIT
    m_mask = rm < M
    n_mask = rn < N
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * K + (k_lo + rk)[None, :]  # [BN, BK], fp8
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * K + (k_lo + rk)[None, :]  # [BM, BK]
    pdl_enter(USE_PDL)
    acc = tl.zeros([BN, BM], tl.float32)
    for k0 in range(0, K_SPLIT, BK):
        w = tl.load(w_ptrs + k0, mask=n_mask[:, None], other=0.0)
        x = tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0)
        acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
    if PARTIAL:  # [SPLIT, M, N] float32, unscaled
        out = out_ptr + (pid_s * M + rm[None, :]).to(tl.int64) * N + rn[:, None]
        tl.store(out, acc, mask=m_mask[None, :] & n_mask[:, None])
    else:
        acc = acc * tl.load(s_ptr + rn, mask=n_mask, other=0.0)[:, None]
        out = out_ptr + rm[None, :].to(tl.int64) * N + rn[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[None, :] & n_mask[:, None])


@triton.jit
def _reduce_kernel(part_ptr, s_ptr, out_ptr, M, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                   USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.load(part_ptr + row * N + cols, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + (s * M + row) * N + cols, mask=mask, other=0.0)
    acc = acc * tl.load(s_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * N + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
             tiles: tuple[int, int, int, int, int, int]) -> torch.Tensor:
    """x [M, K] bf16 or fp16, w [N, K] float8_e4m3fn, scale [N] float32 -> [M, N] in x's dtype;
    tiles = (BM, BN, BK, warps, stages, SPLIT)."""
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1], (x.shape, w.shape)
    assert x.is_contiguous() and w.is_contiguous() and scale.shape == (w.shape[0],)
    m, k = x.shape
    n = w.shape[0]
    bm, bn, bk, warps, stages, split = tiles
    assert k % (split * bk) == 0, f"K ({k}) must be a multiple of SPLIT x BK ({split} x {bk})"
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    target = out if split == 1 else torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    _fp8_gemm_kernel[grid](x, w, scale, target, m, n, K=k, K_SPLIT=k // split, BM=bm, BN=bn, BK=bk,
                           PARTIAL=split > 1, num_warps=warps, num_stages=stages, **pdl_args())
    if split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _reduce_kernel[(m, triton.cdiv(n, block))](target, scale, out, m, n, SPLIT=split, BLOCK=block,
                                                    num_warps=4, **pdl_args())
    return out


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "audio_head": (16512, 4096), "text_head": (151680, 4096)}
COPIES = 4
CALLS = 16


def candidates(m: int, n: int, k: int) -> list[tuple[int, int, int, int, int, int]]:
    """(BM, BN, BK, warps, stages, SPLIT) to try for m rows."""
    if m <= 128:
        bm = max(16, 1 << (m - 1).bit_length())
        out = []
        for bn, bk, split in itertools.product((64, 128), (128, 256), (1, 2, 4, 8)):
            programs = -(-n // bn) * split
            if 96 <= programs <= 1200 and k % (split * bk) == 0:
                out.append((bm, bn, bk, 4, 4, split))
        return out
    return [(64, 128, 64, 4, 4, 1), (128, 128, 64, 8, 3, 1), (128, 128, 64, 8, 4, 1), (128, 256, 64, 8, 3, 1),
            (64, 256, 64, 8, 4, 1), (128, 128, 128, 8, 3, 1)]


def check(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative max error, asserting shape and finiteness."""
    assert got.shape == want.shape and bool(torch.isfinite(got).all())
    return (got.float() - want).abs().max().item() / want.abs().max().item()


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="24,64,128,512")
    p.add_argument("--shapes", default="qkv,o,gate_up,down,audio_head")
    p.add_argument("--budget-s", type=float, default=480)
    p.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the weight-only kernel's tiles")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    device = torch.device("cuda")
    result: dict = {"bench": "fp8_rows", "command": shlex.join(["python", "bench/fp8_rows.py", *argv]),
                    "device_name": torch.cuda.get_device_name(device), "torch": torch.__version__,
                    "copy_gbps": round(copy_bandwidth_gbps(device), 1), "products": [], "skipped": []}
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        qs = [quantize_weight(w) for w in ws]
        deq = qs[0].weight.float() * qs[0].scale[:, None]
        for m in (int(r) for r in args.rows.split(",")):
            if time.perf_counter() - t0 > args.budget_s:
                result["skipped"].append({"matrix": name, "rows": m})
                continue
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            want = x.float() @ deq.t()
            row: dict = {"matrix": name, "n": n, "k": k, "rows": m, "fp8_bytes": n * k}
            row["bf16_cublas_us"] = round(graph_us_per_call(
                [functools.partial(F.linear, x, ws[i % COPIES]) for i in range(CALLS)]), 2)
            scaled = [functools.partial(_scaled_mm_linear, x, qs[i % COPIES]) for i in range(CALLS)]
            rows16 = -(-m // 16) * 16
            fp8.OPTIONS["act_quant"] = "torch"
            eager_q = fp8.quantize_activations(x, rows16)
            fp8.OPTIONS["act_quant"] = "triton"
            kernel_q = fp8.quantize_activations(x, rows16)
            row["act_quant_bit_equal"] = (torch.equal(eager_q[0].view(torch.uint8), kernel_q[0].view(torch.uint8))
                                          and torch.equal(eager_q[1], kernel_q[1]))
            for kind, quant in (("fp8_scaled_mm", "triton"), ("fp8_scaled_mm_eager", "torch")):
                fp8.OPTIONS["act_quant"] = quant  # read while the graph is captured
                try:
                    row[kind + "_rel_err"] = round(check(scaled[0](), want), 5)
                    row[kind + "_us"] = round(graph_us_per_call(scaled), 2)
                finally:
                    fp8.OPTIONS["act_quant"] = "triton"
            tried = []
            for tiles in candidates(m, n, k) if args.sweep else []:
                fns = [functools.partial(fp8_gemm, x, qs[i % COPIES].weight, qs[i % COPIES].scale, tiles)
                       for i in range(CALLS)]
                try:
                    err = check(fns[0](), want)
                    assert err < 1e-2, err
                    us = graph_us_per_call(fns)
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile or fit is reported
                    tried.append({"tiles": tiles, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                    continue
                tried.append({"tiles": tiles, "us": round(us, 2), "rel_err": round(err, 5),
                              "gbps": round(n * k / us / 1e3, 1)})
            timed = [t for t in tried if "us" in t]
            row["candidates"] = tried
            if timed:
                best = min(timed, key=lambda t: t["us"])
                row["best"] = best
                row["speedup_vs_bf16"] = round(row["bf16_cublas_us"] / best["us"], 3)
                row["speedup_vs_scaled_mm"] = round(row["fp8_scaled_mm_us"] / best["us"], 3)
            log(f"{name} m={m}: bf16 {row['bf16_cublas_us']} us, scaled_mm {row['fp8_scaled_mm_us']} us "
                f"(eager quantization {row['fp8_scaled_mm_eager_us']}), weight-only best {row.get('best')}")
            result["products"].append(row)
        del ws, qs, deq
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
