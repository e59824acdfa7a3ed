"""A TMA-fed product for 64-128-row decode steps that loads its weights before the PDL wait (H200 probe).

    python bench/tma_rows.py --rows 64,128 --out $OUT/r/tma-rows-chain-h200.json

The forty-second session's chains (bench/rows_gemm.py --chain) left one structure untried: products whose
programs stream their weights into shared memory *before* waiting for the previous kernel (only the
activations depend on it), with few enough bytes of shared memory per program that, under PDL, the next
product's programs become resident beside the running ones and start their own weight stream while it
finishes. `bench/boundary_ceiling.py` measured that structure for kernels that only stream (5.33 ms of a
64-stream step against 6.01 with a kernel per phase and no overlap); cuBLAS cannot do it, and Triton's
pipeliner issues its first loads after the wait. This kernel is written in Gluon (Triton's explicit
language, shipped with Triton 3.6) so that the order is ours:

- program (n tile, K split) owns BNW weight rows over K / SPLIT; computed as y^T = W x^T, so the weight tile
  is wgmma's 64-row-granular left operand and the 64-128 activation rows are its N;
- STAGES shared-memory stages, each filled by two TMA copies (weight tile, activation tile) on one mbarrier;
- prologue: every stage's weight copy, then `griddepcontrol.wait` + `launch_dependents` (under PDL), then
  the activation copies; loop: wait for the stage, async wgmma, wait for the previous wgmma, refill the
  stage it freed;
- SPLIT > 1: float32 partials, summed into bf16 by a second kernel (as cuBLAS's split-K reduce).

`--chain` compares it, in the same CUDA-graph layer chains as bench/rows_gemm.py (16 layers of the four
products, a weight copy per layer), with cuBLAS: without PDL, with PDL and the weights issued after the
wait, and with PDL and the weights issued before it. Every product is checked against a float32 product
first, and the early-weight variant must give the plain variant's bits.

`--tiled` (forty-fourth session) adds chains whose kernels read `tile_major` copies of the weights, where every
BNW x BK box is contiguous (one sequential read per TMA box); they must give the plain chains' bits.
`--sweep-tiled` times the candidates alone on such copies, so the chains' tiles are chosen there.
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from runtime.kernels.launch import pdl_args, pdl_enter


@gluon.jit
def _gdc_wait_and_release():
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _unit_coords(u, n_tiles, BNW: gl.constexpr, K_TILES: gl.constexpr, BK: gl.constexpr):
    """Work unit u -> (first output column, first K element, K-split index): units run over the N tiles of
    split 0, then of split 1, ..."""
    ks = u // n_tiles
    return (u % n_tiles) * BNW, ks * (K_TILES * BK), ks


@gluon.jit
def _w_box(off_n, k, K, BNW: gl.constexpr, BK: gl.constexpr, TILED: gl.constexpr):
    """Coordinates of the [BNW, BK] weight box at (off_n, k): in the [N, K] matrix, or (TILED) in its
    `tile_major` copy, where that box is BNW * BK contiguous elements."""
    if TILED:
        return [((off_n // BNW) * (K // BK) + k // BK) * BNW, 0]
    else:
        return [off_n, k]


@gluon.jit
def _tma_rows_kernel(
    w_desc, x_desc, y_ptr, M, N, K,
    K_TILES: gl.constexpr, UNITS_PER: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
    USE_PDL: gl.constexpr, EARLY_W: gl.constexpr, TILED: gl.constexpr, num_warps: gl.constexpr,
):
    """y[M, N] (bf16, or float32 partials [SPLIT, M, N]) = x[M, K] W[N, K]^T. A work unit is BNW output columns
    over K / SPLIT; program p takes units p, p + grid, ... (at most UNITS_PER), their K tiles one continuous
    stream through the STAGES shared-memory stages, so the copies run ahead across unit boundaries."""
    BNW: gl.constexpr = w_desc.block_type.shape[0]
    BK: gl.constexpr = w_desc.block_type.shape[1]
    BM: gl.constexpr = x_desc.block_type.shape[0]
    pid = gl.program_id(0)
    grid = gl.num_programs(0)
    n_tiles = N // BNW
    units = gl.minimum(UNITS_PER, (n_tiles * SPLIT - pid + grid - 1) // grid)
    iters = units * K_TILES
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BNW, BK], w_desc.layout)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    stage_bytes: gl.constexpr = w_desc.block_type.nbytes + x_desc.block_type.nbytes
    # the first STAGES tiles are the first unit's (K_TILES >= STAGES, checked by the wrapper); the weights
    # depend on no earlier kernel, so under PDL (EARLY_W) they are asked for before the wait
    off_n0, k00, _ks0 = _unit_coords(pid, n_tiles, BNW, K_TILES, BK)
    for s in gl.static_range(STAGES):
        mbarrier.expect(bars.index(s), stage_bytes)
        if EARLY_W:
            tma.async_copy_global_to_shared(w_desc, _w_box(off_n0, k00 + s * BK, K, BNW, BK, TILED), bars.index(s),
                                            w_smem.index(s))
    if USE_PDL:
        _gdc_wait_and_release()
    for s in gl.static_range(STAGES):
        if not EARLY_W:
            tma.async_copy_global_to_shared(w_desc, _w_box(off_n0, k00 + s * BK, K, BNW, BK, TILED), bars.index(s),
                                            w_smem.index(s))
        tma.async_copy_global_to_shared(x_desc, [0, k00 + s * BK], bars.index(s), x_smem.index(s))

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BM, 16])
    # each thread writes 8 consecutive output columns (16 bytes of bf16)
    out_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[16, 2],
                                                warps_per_cta=[1, num_warps], order=[0, 1])
    cols = gl.arange(0, BNW, layout=gl.SliceLayout(1, out_layout))
    m = gl.arange(0, BM, layout=gl.SliceLayout(0, out_layout))
    acc = gl.zeros([BNW, BM], gl.float32, layout=mma_layout)
    for g in range(iters):
        cur = g % STAGES
        kk = g % K_TILES
        mbarrier.wait(bars.index(cur), (g // STAGES) & 1)
        acc = warpgroup_mma(w_smem.index(cur), x_smem.index(cur).permute((1, 0)), acc, use_acc=kk > 0,
                            is_async=True)
        # at most this wgmma outstanding: the previous one has read its stage, which is refilled
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        nxt = g - 1 + STAGES
        if (g > 0) & (nxt < iters):
            prev = (g - 1) % STAGES
            off_n, k0, _ks = _unit_coords(pid + (nxt // K_TILES) * grid, n_tiles, BNW, K_TILES, BK)
            mbarrier.expect(bars.index(prev), stage_bytes)
            kn = k0 + (nxt % K_TILES) * BK
            tma.async_copy_global_to_shared(w_desc, _w_box(off_n, kn, K, BNW, BK, TILED), bars.index(prev),
                                            w_smem.index(prev))
            tma.async_copy_global_to_shared(x_desc, [0, kn], bars.index(prev), x_smem.index(prev))
        if kk == K_TILES - 1:  # the unit's last tile: write it out
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            off_n, _k0, ks = _unit_coords(pid + (g // K_TILES) * grid, n_tiles, BNW, K_TILES, BK)
            out = gl.convert_layout(acc, out_layout)
            n = off_n + cols
            mask = (m[None, :] < M) & (n[:, None] < N)
            if SPLIT == 1:
                gl.store(y_ptr + m[None, :] * N + n[:, None], out.to(gl.bfloat16), mask=mask)
            else:
                gl.store(y_ptr + (ks * M + m[None, :]) * N + n[:, None], out, mask=mask)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))


@triton.jit
def _split_sum_kernel(part_ptr, y_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """y = sum over the SPLIT float32 partials, in split order, rounded once to bf16."""
    pdl_enter(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


_DESCS: dict[tuple, TensorDescriptor] = {}


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _desc(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A host TMA descriptor of contiguous 2-D `t` with `block` tiles (cached: the graphs reuse buffers)."""
    key = (t.data_ptr(), tuple(t.shape), tuple(block), t.dtype)
    d = _DESCS.get(key)
    if d is None:
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        d = _DESCS[key] = TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)
    return d


def block_m(m: int) -> int:
    """The activation tile's rows for `m` rows: the next power of 2 from 16 (TMA fills the rows past m with 0)."""
    return max(16, triton.next_power_of_2(m))


def smem_bytes(cfg: tuple[int, int, int, int, int], m: int) -> int:
    """Shared memory of one program: STAGES stages of a [BNW, BK] weight and a [BM, BK] activation tile (bf16)."""
    bnw, bk, stages = cfg[:3]
    return stages * (bnw + block_m(m)) * bk * 2


_TILED: dict[tuple, torch.Tensor] = {}


def tile_major_copy(w: torch.Tensor, bnw: int, bk: int) -> torch.Tensor:
    """[N, K] -> [N / bnw * K / bk * bnw, bk]: band of bnw rows by band, K tile by K tile, each bnw x bk box
    contiguous, so a TMA box is one sequential read (`_w_box` addresses it)."""
    n, k = w.shape
    return w.view(n // bnw, bnw, k // bk, bk).permute(0, 2, 1, 3).contiguous().view(-1, bk)


def tile_major(w: torch.Tensor, bnw: int, bk: int) -> torch.Tensor:
    """`tile_major_copy`, cached per (matrix, tile) for the chains' weights (cleared between the sweep's
    matrices)."""
    key = (w.data_ptr(), tuple(w.shape), bnw, bk)
    if key not in _TILED:
        _TILED[key] = tile_major_copy(w, bnw, bk)
    return _TILED[key]


def tma_rows(x: torch.Tensor, w: torch.Tensor, cfg: tuple[int, int, int, int, int], early_w: bool = True,
             persistent: bool = True, tiled: bool = False) -> torch.Tensor:
    """x [M, K] @ w[N, K].T -> [M, N] bf16; cfg = (BNW, BK, STAGES, SPLIT, warps); M <= 128 (padded to `block_m`).
    `early_w`: the first stages' weight copies
    before the PDL wait (no effect without PDL: nothing is waited for). `persistent`: at most one program per
    SM, each taking its share of the work units (else one program per unit). `tiled`: read the weights from
    their `tile_major` copy (made on first use)."""
    bnw, bk, stages, split, warps = cfg
    m, k = x.shape
    n = w.shape[0]
    assert x.dtype == w.dtype == torch.bfloat16 and w.shape[1] == k and x.is_contiguous() and w.is_contiguous()
    assert 0 < m <= 128 and n % bnw == 0 and k % (bk * split) == 0 and k // (bk * split) >= stages, (m, n, k, cfg)
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    dst = y if split == 1 else torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    pa = pdl_args()
    units = n // bnw * split
    per = -(-units // _sm_count(x.device)) if persistent else 1
    _tma_rows_kernel[(-(-units // per),)](
        _desc(tile_major(w, bnw, bk) if tiled else w, [bnw, bk]), _desc(x, [block_m(m), bk]), dst, m, n, k,
        K_TILES=k // (bk * split), UNITS_PER=per, STAGES=stages, SPLIT=split, EARLY_W=early_w, TILED=tiled,
        num_warps=warps, **pa,
    )
    if split > 1:
        block = 2048
        _split_sum_kernel[(triton.cdiv(m * n, block),)](dst, y, m * n, SPLIT=split, BLOCK=block, num_warps=4, **pa)
    return y


def candidates(m: int, n: int, k: int, sms: int, persistent: bool) -> list[tuple[int, int, int, int, int]]:
    """(BNW, BK, STAGES, SPLIT, warps) for one product: BK 64, 4 warps; at least a third of the SMs' worth of
    work units (persistent: the programs, at most one per SM, share them out; else at most 3 units per SM, one
    program each); at most 200 KB of shared memory per program (~113 KB leaves room for a second)."""
    out = []
    for bnw in (64, 128, 256):
        for split in (1, 2, 4):
            for stages in ((3, 4) if bnw == 256 else (4, 6, 8)):
                cfg = (bnw, 64, stages, split, 4)
                units = (n // bnw) * split
                if n % bnw or k % (64 * split) or k // (64 * split) < stages:
                    continue
                if units >= sms // 3 and (persistent or units <= 3 * sms) and smem_bytes(cfg, m) <= 200 * 1024:
                    out.append(cfg)
    return out


def pick(sweep_rows: list[dict], m: int, smem_cap: int | None) -> dict[str, tuple]:
    """Per matrix, the fastest checked candidate at `m` rows (with at most `smem_cap` bytes of shared memory
    per program when given: room for the next kernel's program beside it)."""
    best: dict[str, tuple] = {}
    for row in sweep_rows:
        if row["m"] != m:
            continue
        ok = [e for e in row["tiles"] if "us" in e
              and (smem_cap is None or smem_bytes(tuple(e["tiles"]), m) <= smem_cap)]
        if ok:
            best[row["matrix"]] = tuple(min(ok, key=lambda e: e["us"])["tiles"])
    return best


def main() -> None:
    from bench.fast_tools import bench_result, emit, log
    from bench.rows_gemm import CHAIN, MATRICES, chain_probe, sweep_product

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="64,128")
    ap.add_argument("--layers", type=int, default=16, help="layers in each chain graph")
    ap.add_argument("--rounds", type=int, default=6, help="interleaved timing rounds of the chains")
    ap.add_argument("--smem-cap", type=int, default=113 * 1024,
                    help="the 'fit2' chain variants: fastest tiles with at most this much shared memory per program")
    ap.add_argument("--no-persistent", dest="persistent", action="store_false",
                    help="one program per work unit instead of at most one per SM")
    ap.add_argument("--tiled", action="store_true",
                    help="also chain the same tiles reading `tile_major` weight copies (bits must not change)")
    ap.add_argument("--sweep-tiled", action="store_true",
                    help="time the candidates alone on `tile_major` weights (the chains' tiles are then chosen there)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out = Path(args.out) if args.out else None
    rows = [int(v) for v in args.rows.split(",")]
    result = bench_result("tma_rows", sys.argv[1:], dev, sweep=[], picks={}, chains=[])
    log(f"copy {result['copy_gbps']} GB/s, {sms} SMs")
    for name in CHAIN:  # each product alone: every candidate checked against float32, then timed (cold L2)
        n, k = MATRICES[name]
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(4)]
        for m in rows:
            result["sweep"].append(sweep_product(
                name, m, ws, candidates(m, n, k, sms, args.persistent),
                lambda x, w, cfg: tma_rows(x, w, cfg, persistent=args.persistent, tiled=args.sweep_tiled)))
            emit(result, out)
        del ws
        _TILED.clear()
    for m in rows:
        extra = {}
        for tag, cap in (("", None), ("_fit2", args.smem_cap)):
            cfgs = pick(result["sweep"], m, cap)
            result["picks"][f"{m}{tag}"] = {nm: list(c) for nm, c in cfgs.items()}
            if set(cfgs) != set(CHAIN):
                log(f"m={m}{tag}: no checked candidate for {set(CHAIN) - set(cfgs)}; variant skipped")
                continue
            run = functools.partial(tma_rows, persistent=args.persistent)
            extra[f"tma{tag}"] = ("off", lambda x, w, nm, c=cfgs, r=run: r(x, w, c[nm]), None)
            extra[f"tma{tag}_pdl"] = ("wait", lambda x, w, nm, c=cfgs, r=run: r(x, w, c[nm], early_w=False),
                                      f"tma{tag}")
            extra[f"tma{tag}_pdl_early_w"] = ("wait", lambda x, w, nm, c=cfgs, r=run: r(x, w, c[nm]), f"tma{tag}")
            if args.tiled:
                extra[f"tma{tag}_tiled"] = ("off", lambda x, w, nm, c=cfgs, r=run: r(x, w, c[nm], tiled=True),
                                            f"tma{tag}")
                extra[f"tma{tag}_tiled_pdl"] = ("wait", lambda x, w, nm, c=cfgs, r=run: r(x, w, c[nm], early_w=False,
                                                                                          tiled=True), f"tma{tag}")
        result["chains"].append(chain_probe(m, args.layers, [], [], args.rounds, dev, extra=extra,
                                            triton_variants=False))
        emit(result, out)


if __name__ == "__main__":
    main()
