"""A weight-streaming Triton product for 64-128-row decode steps against cuBLAS (H200 probe; not adopted).

    python bench/rows_gemm.py --out bench/results/rows-gemm-h200.json

At 64-128 rows cuBLAS reads the layer matrices at 2.1-3.5 TB/s (bench/results/decode-ab-h200/tunableop/). The
kernel below: one program owns BN output columns for all rows (BM >= M), streams its [BN, K] weight slice
through `stages` BK-deep tiles (cp.async + wgmma, as Triton pipelines it on sm_90), float32 accumulation.
For each layer matrix of the full shape (and the audio head) and each row count, every (BN, BK, warps,
stages) candidate is first checked against a float32 product on fresh random data (relative error under
1e-2, all finite), then timed per call in a CUDA graph of 16 calls
over 4 weight copies (L2 holds none of them). `F.linear` (cuBLAS) is timed the same way in the same run as
the baseline, with the copy rate; `gbps` counts the weight bytes once.

`--chain` (forty-first session) asks the question the sweep cannot: does this product beat
cuBLAS in a step, where each kernel waits for the one before? A CUDA graph of `--layers` layers of the four
layer products (QKV, o, gate/up, down; a copy of each matrix per layer, so L2 holds none) is timed as
cuBLAS (`F.linear`), as this kernel without PDL, with PDL, and with PDL plus an L2 prefetch of each
program's first `--l2-slice` bytes of its weight slice before the PDL wait (-1: the whole slice;
runtime/kernels/launch.py `l2_prefetch_rows`, as the FP8 GEMV does). Before timing, every product of the
first layer is checked against a float32 product, and the prefetching variants must give the same bits
as the plain one. Variants are timed in interleaved rounds (bench/fast_tools.py `time_interleaved`).
Two runs (forty-second session, bench/results/rows-gemm-chain-h200/): at 64 rows at most 1.6% faster than
cuBLAS (0.3% slower in the other run), at 128 rows 19-26% slower.

`--side-l2` (forty-second session) gives cuBLAS the prefetch it cannot issue itself: while product i runs,
a graph branch on a second stream (forked after product i-1) asks L2 for the first N bytes of product
i+1's weights (`l2_prefetch`, a kernel of one-warp programs, one 1 MiB bulk prefetch each). A prefetch
moves no bits (checked); what it might win is the bandwidth left idle at each kernel's tail and ramp.

`--chain-stages N` (forty-second session) gives every product N pipeline stages: with the sweep's 4-5 a program
fills an SM's shared memory, so under PDL the next product's programs find no room to start, issue their
prefetch and wait beside it, the structure `bench/boundary_ceiling.py` found fastest. Measured: 3 stages
cost 24% at 64 rows and PDL then made the chain 8% slower; 2 stages cost 95% (the results' README).

    python bench/rows_gemm.py --chain --rows 64,128 --out $OUT/r/rows-gemm-chain-h200.json

`chain_probe` also takes other products as extra variants: bench/tma_rows.py (forty-third session) times its
TMA product that way.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench.fast_tools import bench_result, emit, fastest, graph_us_per_call, log, time_interleaved
from runtime.kernels import pdl_launches
from runtime.kernels.launch import l2_prefetch_once, l2_prefetch_rows, pdl_args, pdl_enter

MATRICES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
            "audio_head": (16384 + 8, 4096)}
CALLS = 16


@triton.jit
def _rows_gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    USE_PDL: tl.constexpr,
    L2_SLICE: tl.constexpr = 0,
):
    if L2_SLICE != 0:  # the program's [BN, K] weight rows are one contiguous slice: ask L2 before the wait
        l2_prefetch_rows(w_ptr, tl.program_id(0), N, K, BN, L2_SLICE)
    pdl_enter(USE_PDL)
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    m_mask = rm < M
    n_mask = rn < N
    x_rows = x_ptr + rm[:, None] * K + rk[None, :]
    w_cols = w_ptr + rn[None, :].to(tl.int64) * K + rk[:, None]
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):  # K % BK == 0 (checked by the wrapper)
        x = tl.load(x_rows + k0, mask=m_mask[:, None], other=0.0)  # [BM, BK]
        w = tl.load(w_cols + k0, mask=n_mask[None, :], other=0.0)  # [BK, BN]: W^T tile
        acc = tl.dot(x, w, acc)
    out = y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _l2_prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr):
    """Program p asks L2 for bytes [p * CHUNK, (p + 1) * CHUNK) of `ptr` (a byte pointer) below `nbytes`."""
    start = tl.program_id(0).to(tl.int64) * CHUNK
    l2_prefetch_once(ptr + start, tl.minimum(nbytes - start, CHUNK).to(tl.int32))


def l2_prefetch(w: torch.Tensor, nbytes: int, chunk: int = 1 << 20) -> None:
    """Ask L2 for the first `nbytes` of contiguous `w` (-1 or more than it holds: all), one bulk prefetch per
    `chunk` bytes, each from its own program (a kernel of a few tiny programs: it fits beside a running GEMM)."""
    total = w.numel() * w.element_size()
    nbytes = total if nbytes < 0 else min(nbytes, total)
    assert w.is_contiguous() and nbytes % 16 == 0 and chunk % 16 == 0, (nbytes, chunk)
    _l2_prefetch_kernel[(triton.cdiv(nbytes, chunk),)](w.view(-1).view(torch.uint8), nbytes, CHUNK=chunk, num_warps=1)


def rows_gemm(x: torch.Tensor, w: torch.Tensor, tiles: tuple[int, int, int, int], l2_slice: int = 0) -> torch.Tensor:
    """x [M, K] @ w[N, K].T -> [M, N] in x's dtype; tiles = (BN, BK, warps, stages); M <= 128, K % BK == 0.
    `l2_slice`: bytes of each program's weight slice asked of L2 before the PDL wait (0: none, -1: all)."""
    assert l2_slice == -1 or (l2_slice >= 0 and l2_slice % 16 == 0), l2_slice
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1] and x.dtype == w.dtype
    m, k = x.shape
    n = w.shape[0]
    bn, bk, warps, stages = tiles
    assert 0 < m <= 128 and k % bk == 0, (m, k, bk)
    x = x.contiguous()
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _rows_gemm_kernel[(triton.cdiv(n, bn),)](
        x, w, y, m, n, K=k, BM=max(16, triton.next_power_of_2(m)), BN=bn, BK=bk,
        num_warps=warps, num_stages=stages, **pdl_args(), **({"L2_SLICE": l2_slice} if l2_slice else {}),
    )
    return y


CHAIN = ("qkv", "o", "gate_up", "down")  # one layer's products in step order
# (BN, BK, warps, stages) per matrix: the sweep's best at 64 and 128 rows (bench/results/rows-gemm-h200/)
CHAIN_TILES = {
    64: {"qkv": (64, 128, 4, 5), "o": (32, 128, 4, 5), "gate_up": (64, 64, 4, 4), "down": (32, 128, 4, 5)},
    128: {"qkv": (64, 128, 8, 4), "o": (32, 128, 8, 5), "gate_up": (256, 64, 8, 4), "down": (32, 128, 8, 5)},
}


ChainRun = Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]  # (x, w, matrix name) -> x w^T


def chain_probe(
    m: int, layers: int, l2_slices: list[int], side_l2: list[int], rounds: int, dev: torch.device,
    stages: int | None = None, extra: dict[str, tuple[str, ChainRun, str | None]] | None = None,
    triton_variants: bool = True,
) -> dict:
    """`--chain` at `m` rows (module docstring): per variant the graph's median per layer, its weight bytes'
    rate and the checks that preceded the timing. `stages`: every product's pipeline depth instead of the
    sweep's (fewer stages, less shared memory: room on the SMs for the next kernel's programs under PDL).
    `extra`: more variants, name -> (PDL mode, run, the variant whose bits it must give or None);
    `triton_variants`: time this file's Triton product too (False: cuBLAS and `extra` only)."""
    tiles = {n: t if stages is None else (*t[:3], stages) for n, t in CHAIN_TILES[m].items()}
    ws = [{name: torch.randn(*MATRICES[name], device=dev, dtype=torch.bfloat16) * 0.02 for name in CHAIN}
          for _ in range(layers)]
    xs = {k: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for k in {MATRICES[n][1] for n in CHAIN}}
    layer_bytes = sum(MATRICES[n][0] * MATRICES[n][1] * 2 for n in CHAIN)
    variants: dict[str, tuple[str, ChainRun, str | None]] = {"cublas": ("off", lambda x, w, name: F.linear(x, w), None)}
    if triton_variants:
        variants["triton"] = ("off", lambda x, w, name: rows_gemm(x, w, tiles[name]), None)
        variants["triton_pdl"] = ("wait", lambda x, w, name: rows_gemm(x, w, tiles[name]), "triton")
        for s in l2_slices:
            variants[f"triton_pdl_l2={s}"] = ("wait", lambda x, w, name, s=s: rows_gemm(x, w, tiles[name], s), "triton")
    variants |= extra or {}
    side_bytes = {f"cublas_side_l2={b}": b for b in side_l2}  # cuBLAS, next product's weights prefetched beside
    row: dict = {"m": m, "layers": layers, "tiles": {n: list(t) for n, t in tiles.items()},
                 "weight_bytes_per_layer": layer_bytes, "checks": {}, "variants": {}}
    outs: dict[str, dict[str, torch.Tensor]] = {}  # layer 0's outputs by variant and matrix
    for vname, (pdl, run, same_as) in variants.items():  # every product of layer 0 checked before any timing
        check: dict = {}
        outs[vname] = {}
        with pdl_launches(pdl):
            for name in CHAIN:
                x, w = xs[MATRICES[name][1]], ws[0][name]
                got = run(x, w, name)
                torch.cuda.synchronize()
                ref = x.float() @ w.float().t()
                rel = float((got.float() - ref).norm() / ref.norm())
                if not (rel < 1e-2 and bool(torch.isfinite(got).all())):
                    raise RuntimeError(f"{vname} {name} m={m}: relative error {rel} or non-finite values")
                check[name] = round(rel, 6)
                outs[vname][name] = got.clone()
                if same_as is not None and not torch.equal(got, outs[same_as][name]):
                    raise RuntimeError(f"{vname} {name} m={m}: bits differ from {same_as}'s")
        row["checks"][vname] = check
    cublas_out = outs["cublas"]
    for vname, nbytes in side_bytes.items():  # a prefetch changes no bits: same output as plain cuBLAS
        for name in CHAIN:
            l2_prefetch(ws[0][name], nbytes)
            if not torch.equal(F.linear(xs[MATRICES[name][1]], ws[0][name]), cublas_out[name]):
                raise RuntimeError(f"{vname} {name} m={m}: bits differ from cuBLAS's")
        row["checks"][vname] = "bits equal to cublas"

    order = [(xs[MATRICES[name][1]], layer[name], name) for layer in ws for name in CHAIN]  # step order
    side = torch.cuda.Stream(dev)

    def step(run: ChainRun) -> None:
        for x, w, name in order:
            run(x, w, name)

    def side_step(nbytes: int) -> None:
        """Before product i starts, a branch on `side` (forked after product i-1) prefetches product i+1's
        first `nbytes` of weights while product i runs; joined once at the end."""
        main = torch.cuda.current_stream(dev)
        for i, (x, w, _) in enumerate(order):
            if i + 1 < len(order):
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    l2_prefetch(order[i + 1][1], nbytes)
            F.linear(x, w)
        main.wait_stream(side)

    steps = {v: (pdl, functools.partial(step, run)) for v, (pdl, run, _) in variants.items()}
    steps |= {v: ("off", functools.partial(side_step, nbytes)) for v, nbytes in side_bytes.items()}
    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    for vname, (pdl, fn) in steps.items():
        with pdl_launches(pdl):
            fn()  # warm-up (compiles) outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
        graphs[vname] = graph
    timed = time_interleaved({v: g.replay for v, g in graphs.items()}, warmup=3, reps=20, rounds=rounds)
    for vname, t in timed.items():
        per_layer_us = t["median_ms"] * 1e3 / layers
        row["variants"][vname] = {"us_per_layer": round(per_layer_us, 2),
                                  "gbps": round(layer_bytes / per_layer_us / 1e3, 1),
                                  "round_us_per_layer": [round(r * 1e3 / layers, 2) for r in t["round_medians_ms"]]}
    log(f"chain m={m}: " + ", ".join(f"{v} {r['us_per_layer']} us" for v, r in row["variants"].items()))
    return row


def sweep_product(
    name: str, m: int, ws: list[torch.Tensor], candidates: list[tuple], run: Callable[..., torch.Tensor],
    extra: Callable[[dict, torch.Tensor, list[torch.Tensor], tuple], None] | None = None,
) -> dict:
    """One matrix (4 copies `ws`, [N, K] bf16) at `m` rows: cuBLAS (`F.linear`) and each candidate
    `run(x, w, tiles)` first checked against a float32 product (relative error under 1e-2, all finite; the
    largest difference from cuBLAS's output recorded), then timed per call in a CUDA graph of CALLS calls over
    the copies. `extra(entry, x, ws, tiles)` may add timings to a candidate that passed."""
    n, k = ws[0].shape
    nbytes = n * k * ws[0].element_size()
    x = torch.randn(m, k, device=ws[0].device, dtype=ws[0].dtype)
    ref = x.float() @ ws[0].float().t()
    cublas_out = F.linear(x, ws[0]).float()
    cublas_us = graph_us_per_call([functools.partial(F.linear, x, ws[i % 4]) for i in range(CALLS)])
    row = {"matrix": name, "n": n, "k": k, "m": m, "cublas_us": round(cublas_us, 2),
           "cublas_gbps": round(nbytes / cublas_us / 1e3, 1),
           "cublas_rel_err": float((cublas_out - ref).norm() / ref.norm()), "tiles": []}
    for tiles in candidates:
        entry: dict = {"tiles": list(tiles)}
        try:
            got = run(x, ws[0], tiles).float()
            entry["rel_err"] = float((got - ref).norm() / ref.norm())
            entry["finite"] = bool(torch.isfinite(got).all())
            entry["max_abs_vs_cublas"] = float((got - cublas_out).abs().max())
            if entry["rel_err"] < 1e-2 and entry["finite"]:
                us = graph_us_per_call([functools.partial(run, x, ws[i % 4], tiles) for i in range(CALLS)])
                entry.update(us=round(us, 2), gbps=round(nbytes / us / 1e3, 1), vs_cublas=round(cublas_us / us, 3))
                if extra is not None:
                    extra(entry, x, ws, tiles)
        except Exception as exc:  # noqa: BLE001 - reported in the JSON (e.g. too much shared memory)
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        row["tiles"].append(entry)
    row["best"] = fastest(row["tiles"])
    log(f"{name} m={m}: cuBLAS {row['cublas_us']} us ({row['cublas_gbps']} GB/s); best {row['best']}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16,32,64,128")
    ap.add_argument("--bn", default="32,64,128,256")
    ap.add_argument("--bk", default="64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="3,4,5")
    ap.add_argument("--matrices", default=",".join(MATRICES))
    ap.add_argument("--chain", action="store_true", help="time layer chains of the four products (docstring)")
    ap.add_argument("--layers", type=int, default=16, help="--chain: layers in the graph")
    ap.add_argument("--l2-slice", default="2048,16384,-1", help="--chain: prefetch sizes to try (bytes, -1: all)")
    ap.add_argument("--side-l2", default="4194304,16777216,33554432",
                    help="--chain: cuBLAS with the next product's first N bytes prefetched beside (bytes, -1: all)")
    ap.add_argument("--chain-stages", type=int, default=None,
                    help="--chain: every product's pipeline stages instead of the sweep's (room for PDL's next kernel)")
    ap.add_argument("--rounds", type=int, default=6, help="--chain: interleaved timing rounds")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    ints = lambda s: [int(v) for v in s.split(",")]
    if args.chain:
        if unknown := set(ints(args.rows)) - set(CHAIN_TILES):
            ap.error(f"--chain has tiles for {sorted(CHAIN_TILES)} rows only, not {sorted(unknown)}")
        result = bench_result("rows_gemm", sys.argv[1:], dev, chains=[])
        for m in ints(args.rows):
            result["chains"].append(chain_probe(m, args.layers, ints(args.l2_slice), ints(args.side_l2) if args.side_l2 else [],
                                                  args.rounds, dev, args.chain_stages))
            emit(result, Path(args.out) if args.out else None)
        return
    cands = list(itertools.product(ints(args.bn), ints(args.bk), ints(args.warps), ints(args.stages)))
    result = bench_result("rows_gemm", sys.argv[1:], dev, rows=[])
    log(f"copy {result['copy_gbps']} GB/s; {len(cands)} candidates")
    for name in args.matrices.split(","):
        n, k = MATRICES[name]
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(4)]
        for m in ints(args.rows):
            result["rows"].append(sweep_product(name, m, ws, cands, rows_gemm))
            emit(result, Path(args.out) if args.out else None)
        del ws
    emit(result, Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
