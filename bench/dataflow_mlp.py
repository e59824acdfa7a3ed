"""A dataflow MLP block for 64-row decode steps: gate/up, SiLU-mul and down in one persistent kernel whose
down tiles wait for the gate/up tiles they read, not for a kernel boundary (H200 probe).

    python bench/dataflow_mlp.py --rows 64 --out $OUT/r/dataflow-mlp-h200.json

Issue 4's 64-stream step pays, per layer, the MLP block as four kernels: cuBLAS's gate/up product, the SiLU-mul,
cuBLAS's split-K down product and its split-K sum. Each boundary drains one kernel's last wave before the next
one ramps up (bench/boundary_ceiling.py: ~3.1 us a boundary for kernels that only stream). Here one launch
does the whole block, as a queue of work units that every program takes from in order (an atomic counter):
- an A unit is 64 intermediate columns: their gate and up weight rows over the hidden size (or over
  1/KSPLIT_A of it), so its epilogue can apply SiLU(gate) * up, rounded as `runtime/kernels/elementwise.py`'s
  `silu_mul`, and store those 64 columns of h. With KSPLIT_A > 1 the parts store float32 partials and the
  last to arrive sums them in part order first. The h tile then counts itself done in its K group;
- a B unit is 128 of down's output columns over 1/SPLIT of the intermediate size. It needs only the h tiles
  of its K group, so it waits for that group's count, not for all of gate/up. It stores float32 partials; the
  last of the SPLIT units of an output tile to arrive sums them in split order and stores bf16.
All A units are queued before any B unit, so a B unit's producers are running when it waits: no deadlock
whatever the number of resident programs. Each program asks for the next unit's weight tiles while it
finishes the current one; its activation tiles go with them when nothing is awaited (EARLY_X: the unit is an
A unit, or its K group is done already), else once the dependency holds. Under PDL a program asks for its
first weight tiles before `griddepcontrol.wait`. The operands stream by TMA into an mbarrier ring and
multiply on wgmma as y^T = W x^T, as in bench/tma_rows.py. TILED reads the weights from a `tile_major` copy,
in which every 64 x BK box is contiguous. h goes out through the generic proxy and comes back in by TMA (the
async proxy), so both sides fence the proxies around the release / acquire of the group count. WS runs the
warp-specialized form (`_mlp_ws_kernel`): one load warp takes the units and streams their tiles through
empty / ready barriers while the four MMA warps multiply and run the epilogues. It hands each unit id to the
MMA warps through a small ring in the launch's own zeroed words (`launch_words`): a ring shared by all layers
hung under PDL, when a layer's programs ran beside the previous layer's.

Checks before any timing: h and y of layer 0 against a float32 block (relative error beside cuBLAS's), every
counter at its expected value (units taken, group counts, arrivals; no wait ran out of polls), and the
layers' outputs bit-equal between the first eager run and the graph replays (the block is deterministic:
fixed K order, partials summed in a fixed order). Then 16-layer chains in CUDA graphs (a weight copy per
layer, so L2 holds none), timed in interleaved rounds against cuBLAS + `silu_mul` + cuBLAS. Each PDL variant
is also replayed once with TRACE, which stores every unit's program and start / activations-asked / end
times; `traces` summarizes the middle layer's launch (when gate/up's units end, how long units and waits
take, when the programs finish).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from bench.tma_rows import _desc, _gdc_wait_and_release, _w_box, tile_major_copy

HIDDEN, INTER = 4096, 12288
HALF = 64  # weight rows per half tile (wgmma's M); K per tile (BK) is the descriptors' block width
HIDDEN_C, INTER_C, HALF_C = (gl.constexpr(v) for v in (HIDDEN, INTER, HALF))


@gluon.jit
def _fence_proxy_async_global():
    """Order this thread's generic-proxy global accesses with its async-proxy (TMA) ones."""
    gl.inline_asm_elementwise("fence.proxy.async.global; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _wait_group(grp, target, err_ptr, spin_cap, CTA_SYNC: gl.constexpr):
    """Poll a K group's count (volatile loads) until it reaches `target`, counting in err[0] a wait that ran out
    of `spin_cap` polls; then acquire it and order the TMA copies that follow after it. CTA_SYNC: other threads
    of the program issue those copies (a barrier after the one thread's acquire)."""
    seen = gl.load(grp, volatile=True)
    polls = 0
    while (seen < target) & (polls < spin_cap):
        seen = gl.load(grp, volatile=True)
        polls += 1
    if polls >= spin_cap:
        gl.atomic_add(err_ptr, 1)
    gl.atomic_add(grp, 0, sem="acquire", scope="gpu")
    if CTA_SYNC:
        gl.thread_barrier()
    _fence_proxy_async_global()


@gluon.jit
def _unit_tiles(u, SPLIT: gl.constexpr, KSPLIT_A: gl.constexpr, BK: gl.constexpr):
    """K tiles of unit u: a gate/up unit spans HIDDEN / KSPLIT_A, a down unit INTER / SPLIT."""
    NA: gl.constexpr = INTER_C // HALF_C * KSPLIT_A
    KT_A: gl.constexpr = HIDDEN_C // KSPLIT_A // BK
    KT_B: gl.constexpr = INTER_C // SPLIT // BK
    return KT_B + (KT_A - KT_B) * (u < NA).to(gl.int32)


@gluon.jit
def _group_counter(cnt_ptr, u, KSPLIT_A: gl.constexpr):
    """The counter of h tiles done in the K group that down unit u reads."""
    return cnt_ptr + 1 + (u - INTER_C // HALF_C * KSPLIT_A) // (HIDDEN_C // (2 * HALF_C))


@gluon.jit
def _group_done(grp, target, CTA_SYNC: gl.constexpr):
    """1 if a K group's count has reached `target` (acquired, and the TMA copies that follow ordered after it),
    else 0; no waiting. CTA_SYNC as in `_wait_group`."""
    done = 0
    if gl.atomic_add(grp, 0, sem="acquire", scope="gpu") >= target:
        if CTA_SYNC:
            gl.thread_barrier()
        _fence_proxy_async_global()
        done = 1
    return done


@gluon.jit
def _mma_tile(w_smem, x_smem, cs, acc0, acc1, kk):
    """Stage cs's products into both accumulators (y^T = W x^T for each weight half), then wait until at most
    these two are outstanding: the previous tile's are done and its stage may be refilled."""
    xt = x_smem.index(cs).permute((1, 0))
    acc0 = warpgroup_mma(w_smem.index(2 * cs), xt, acc0, use_acc=kk > 0, is_async=True)
    acc1 = warpgroup_mma(w_smem.index(2 * cs + 1), xt, acc1, use_acc=kk > 0, is_async=True)
    return warpgroup_mma_wait(num_outstanding=2, deps=(acc0, acc1))


@gluon.jit
def _now():
    """The global nanosecond timer (%globaltimer)."""
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _load_w(u, t, wgu_desc, wd_desc, bar, w0, w1, NA: gl.constexpr, NT: gl.constexpr, KB: gl.constexpr,
            TILED: gl.constexpr, KSPLIT_A: gl.constexpr):
    """Unit u's two weight half tiles of its K tile t: gate and up rows (A), or two 64-row halves of down's
    128 output rows over its K range (B)."""
    BK_C: gl.constexpr = wgu_desc.block_type.shape[1]
    if u < NA:  # A unit u: 64 intermediate columns u // KSPLIT_A over K part u % KSPLIT_A
        j = u // KSPLIT_A
        k = (u % KSPLIT_A) * (HIDDEN_C // KSPLIT_A) + t * BK_C
        tma.async_copy_global_to_shared(wgu_desc, _w_box(j * HALF_C, k, HIDDEN_C, HALF_C, BK_C, TILED), bar, w0)
        tma.async_copy_global_to_shared(wgu_desc, _w_box(INTER_C + j * HALF_C, k, HIDDEN_C, HALF_C, BK_C, TILED), bar, w1)
    else:
        b = u - NA
        row = (b % NT) * (2 * HALF_C)
        k = (b // NT) * KB + t * BK_C
        tma.async_copy_global_to_shared(wd_desc, _w_box(row, k, INTER_C, HALF_C, BK_C, TILED), bar, w0)
        tma.async_copy_global_to_shared(wd_desc, _w_box(row + HALF_C, k, INTER_C, HALF_C, BK_C, TILED), bar, w1)


@gluon.jit
def _load_x(u, t, x_desc, h_desc, bar, xs, NA: gl.constexpr, NT: gl.constexpr, KB: gl.constexpr,
            KSPLIT_A: gl.constexpr):
    """Unit u's activation tile of its K tile t: x (A) or h over the unit's K range (B)."""
    BK_C: gl.constexpr = x_desc.block_type.shape[1]
    if u < NA:
        tma.async_copy_global_to_shared(x_desc, [0, (u % KSPLIT_A) * (HIDDEN_C // KSPLIT_A) + t * BK_C], bar, xs)
    else:
        tma.async_copy_global_to_shared(h_desc, [0, ((u - NA) // NT) * KB + t * BK_C], bar, xs)


@gluon.jit
def _unit_epilogue(u, acc0, acc1, h_ptr, part_ptr, apart_ptr, y_ptr, cnt_ptr, M, out_layout: gl.constexpr,
                   SPLIT: gl.constexpr, KSPLIT_A: gl.constexpr):
    """A unit's results: for a gate/up unit, h = silu(gate) * up (after summing its K parts' partials when the
    last part arrives) and its K group's count released; for a down unit, its float32 partials, and, in the last
    of the SPLIT parts of its output tile to arrive, their sum in split order as bf16 y."""
    BM: gl.constexpr = acc0.type.shape[1]
    NJ: gl.constexpr = INTER_C // HALF_C
    NA: gl.constexpr = NJ * KSPLIT_A
    NT: gl.constexpr = HIDDEN_C // (2 * HALF_C)
    PER_GROUP: gl.constexpr = NJ // SPLIT
    cols = gl.arange(0, HALF_C, layout=gl.SliceLayout(1, out_layout))
    m = gl.arange(0, BM, layout=gl.SliceLayout(0, out_layout))
    row_ok = m[None, :] < M
    if u < NA:  # h[:, 64j : 64j + 64] = silu(gate) * up, rounded as silu_mul rounds
        j = u // KSPLIT_A
        gate = gl.convert_layout(acc0, out_layout)
        up = gl.convert_layout(acc1, out_layout)
        last = 1
        if KSPLIT_A > 1:  # float32 partials; the last of the K parts to arrive sums them in part order
            abase = apart_ptr + ((u % KSPLIT_A) * M + m[None, :]) * (2 * INTER_C) + (j * HALF_C + cols)[:, None]
            gl.store(abase, gate, mask=row_ok)
            gl.store(abase + INTER_C, up, mask=row_ok)
            gl.thread_barrier()
            last = (gl.atomic_add(cnt_ptr + 1 + SPLIT + NT + j, 1, sem="acq_rel", scope="gpu") == KSPLIT_A - 1).to(gl.int32)
            if last == 1:
                gl.thread_barrier()
                gate = gl.zeros([HALF_C, BM], gl.float32, layout=out_layout)
                up = gl.zeros([HALF_C, BM], gl.float32, layout=out_layout)
                for ka in gl.static_range(KSPLIT_A):
                    src = apart_ptr + (ka * M + m[None, :]) * (2 * INTER_C) + (j * HALF_C + cols)[:, None]
                    gate += gl.load(src, mask=row_ok, other=0.0)
                    up += gl.load(src + INTER_C, mask=row_ok, other=0.0)
        if last == 1:
            gate = gate.to(gl.bfloat16).to(gl.float32)
            up = up.to(gl.bfloat16).to(gl.float32)
            act = (gate / (1.0 + gl.exp(-gate))).to(gl.bfloat16).to(gl.float32)
            hv = (act * up).to(gl.bfloat16)
            gl.store(h_ptr + m[None, :] * INTER_C + (j * HALF_C + cols)[:, None], hv, mask=row_ok)
            _fence_proxy_async_global()
            gl.thread_barrier()
            gl.atomic_add(cnt_ptr + 1 + j // PER_GROUP, 1, sem="release", scope="gpu")
    else:  # float32 partials; the last of the SPLIT units of this output tile sums them
        b = u - NA
        nt = b % NT
        ks = b // NT
        n0 = nt * (2 * HALF_C) + cols
        base = part_ptr + (ks * M + m[None, :]) * HIDDEN_C
        gl.store(base + n0[:, None], gl.convert_layout(acc0, out_layout), mask=row_ok)
        gl.store(base + (n0 + HALF_C)[:, None], gl.convert_layout(acc1, out_layout), mask=row_ok)
        gl.thread_barrier()
        arrived = gl.atomic_add(cnt_ptr + 1 + SPLIT + nt, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            gl.thread_barrier()
            lo = gl.zeros([HALF_C, BM], gl.float32, layout=out_layout)
            hi = gl.zeros([HALF_C, BM], gl.float32, layout=out_layout)
            for k2 in gl.static_range(SPLIT):
                src = part_ptr + (k2 * M + m[None, :]) * HIDDEN_C
                lo += gl.load(src + n0[:, None], mask=row_ok, other=0.0)
                hi += gl.load(src + (n0 + HALF_C)[:, None], mask=row_ok, other=0.0)
            dst = y_ptr + m[None, :] * HIDDEN_C
            gl.store(dst + n0[:, None], lo.to(gl.bfloat16), mask=row_ok)
            gl.store(dst + (n0 + HALF_C)[:, None], hi.to(gl.bfloat16), mask=row_ok)

@gluon.jit
def _mlp_kernel(
    wgu_desc, wd_desc, x_desc, h_desc, h_ptr, part_ptr, apart_ptr, y_ptr, cnt_ptr, err_ptr, trace_ptr, M, spin_cap,
    SPLIT: gl.constexpr, KSPLIT_A: gl.constexpr, STAGES: gl.constexpr, EARLY_X: gl.constexpr, TILED: gl.constexpr,
    USE_PDL: gl.constexpr,
    TRACE: gl.constexpr, num_warps: gl.constexpr,
):
    """y = down(silu(x Wg^T) * (x Wu^T)) for M <= 64 rows (module docstring). cnt (`counter_words`): [0] units
    taken, [1 + g] h tiles done in K group g, [1 + SPLIT + nt] down units arrived at output tile nt, then
    each h tile's gate/up parts arrived (KSPLIT_A > 1); err[0] counts waits that ran out of polls. TRACE:
    trace[u] = (program, start, activations asked for, end) in ns of each unit."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK_C: gl.constexpr = x_desc.block_type.shape[1]
    NJ: gl.constexpr = INTER_C // HALF_C  # h tiles of 64 intermediate columns
    NA: gl.constexpr = NJ * KSPLIT_A  # A units
    NT: gl.constexpr = HIDDEN_C // (2 * HALF_C)  # down's output tiles
    KB: gl.constexpr = INTER_C // SPLIT  # a B unit's K range
    PER_GROUP: gl.constexpr = NJ // SPLIT  # h tiles per K group of down
    TOTAL: gl.constexpr = NA + NT * SPLIT
    STAGE_BYTES: gl.constexpr = 2 * wgu_desc.block_type.nbytes + x_desc.block_type.nbytes
    gl.static_assert(KB // BK_C >= STAGES - 1)
    gl.static_assert(NJ % SPLIT == 0)
    gl.static_assert(HIDDEN_C // KSPLIT_A // BK_C >= STAGES - 1)

    w_smem = gl.allocate_shared_memory(wgu_desc.dtype, [2 * STAGES, HALF_C, BK_C], wgu_desc.layout)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK_C], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s0 in gl.static_range(STAGES):
        mbarrier.init(bars.index(s0), count=1)

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BM, 16])
    # [64 weight rows, BM activation rows]: 8 consecutive output columns (16 bytes of bf16) per thread
    out_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[8, 4],
                                                warps_per_cta=[1, num_warps], order=[0, 1])

    u = gl.atomic_add(cnt_ptr, 1)
    for i in gl.static_range(STAGES - 1):  # the first unit's first weight tiles depend on no kernel
        if u < TOTAL:
            mbarrier.expect(bars.index(i), STAGE_BYTES)
            _load_w(u, i, wgu_desc, wd_desc, bars.index(i), w_smem.index(2 * i), w_smem.index(2 * i + 1),
                    NA, NT, KB, TILED, KSPLIT_A)
    if USE_PDL:
        _gdc_wait_and_release()
    g = 0  # this program's tiles so far, over all its units: stage g % STAGES, phase (g // STAGES) & 1
    start = 0  # g at the current unit's first tile
    ready = 0  # whether the current unit's first activation tiles were asked for with their weights
    while u < TOTAL:
        kt = _unit_tiles(u, SPLIT, KSPLIT_A, BK_C)
        if TRACE:
            gl.store(trace_ptr + u * 4, gl.program_id(0).to(gl.int64))
            gl.store(trace_ptr + u * 4 + 1, _now())
        if ready == 0:
            if u >= NA:  # a B unit reads h: wait until its K group's A units are done
                _wait_group(_group_counter(cnt_ptr, u, KSPLIT_A), PER_GROUP, err_ptr, spin_cap, True)
            for i in gl.static_range(STAGES - 1):  # activations of the tiles whose weights were asked for
                sx = (start + i) % STAGES
                _load_x(u, i, x_desc, h_desc, bars.index(sx), x_smem.index(sx), NA, NT, KB, KSPLIT_A)
        if TRACE:
            gl.store(trace_ptr + u * 4 + 2, _now())
        acc0 = gl.zeros([HALF_C, BM], gl.float32, layout=mma_layout)
        acc1 = gl.zeros([HALF_C, BM], gl.float32, layout=mma_layout)
        nxt = TOTAL
        nready = 0
        for kk in range(kt):
            cs = g % STAGES
            mbarrier.wait(bars.index(cs), (g // STAGES) & 1)
            # the previous tile's products are done: its stage is free for tile g + STAGES - 1
            acc0, acc1 = _mma_tile(w_smem, x_smem, cs, acc0, acc1, kk)
            t = kk + STAGES - 1
            ps = (g + STAGES - 1) % STAGES
            if t < kt:
                mbarrier.expect(bars.index(ps), STAGE_BYTES)
                _load_w(u, t, wgu_desc, wd_desc, bars.index(ps), w_smem.index(2 * ps), w_smem.index(2 * ps + 1),
                        NA, NT, KB, TILED, KSPLIT_A)
                _load_x(u, t, x_desc, h_desc, bars.index(ps), x_smem.index(ps), NA, NT, KB, KSPLIT_A)
            else:  # the next unit's tile t - kt: its weights now, its activations too if nothing is awaited
                if t == kt:
                    nxt = gl.atomic_add(cnt_ptr, 1)
                    if EARLY_X:
                        if nxt < NA:  # x was ready before this program's first tile
                            nready = 1
                        if (nxt >= NA) & (nxt < TOTAL):  # h of its K group, if already done (no waiting)
                            nready = _group_done(_group_counter(cnt_ptr, nxt, KSPLIT_A), PER_GROUP, True)
                if nxt < TOTAL:
                    mbarrier.expect(bars.index(ps), STAGE_BYTES)
                    _load_w(nxt, t - kt, wgu_desc, wd_desc, bars.index(ps), w_smem.index(2 * ps),
                            w_smem.index(2 * ps + 1), NA, NT, KB, TILED, KSPLIT_A)
                    if nready == 1:
                        _load_x(nxt, t - kt, x_desc, h_desc, bars.index(ps), x_smem.index(ps), NA, NT, KB, KSPLIT_A)
            g += 1
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
        _unit_epilogue(u, acc0, acc1, h_ptr, part_ptr, apart_ptr, y_ptr, cnt_ptr, M, out_layout, SPLIT, KSPLIT_A)
        if TRACE:
            gl.store(trace_ptr + u * 4 + 3, _now())
        start += kt
        u = nxt
        ready = nready
    for s0 in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s0))


@gluon.jit
def _ws_producer(wgu_desc, wd_desc, x_desc, h_desc, w_smem, x_smem, ready, empty, ulist_ptr, uready, uempty,
                 cnt_ptr, err_ptr, spin_cap, SPLIT: gl.constexpr, KSPLIT_A: gl.constexpr, UQ: gl.constexpr,
                 TILED: gl.constexpr, USE_PDL: gl.constexpr):
    """The load warp of `_mlp_ws_kernel`: takes units from the queue, hands each to the MMA warps through a
    ring of UQ slots, and streams its tiles into the stage ring as stages come free. A unit whose inputs are
    not known ready (the first unit, which waits for the previous kernel; a down unit whose K group is not
    done) gets the weights of its first tiles before that wait and their activations after it."""
    STAGES: gl.constexpr = ready.type.shape[0]
    BK_C: gl.constexpr = x_desc.block_type.shape[1]
    NJ: gl.constexpr = INTER_C // HALF_C
    NA: gl.constexpr = NJ * KSPLIT_A
    NT: gl.constexpr = HIDDEN_C // (2 * HALF_C)
    KB: gl.constexpr = INTER_C // SPLIT
    PER_GROUP: gl.constexpr = NJ // SPLIT
    TOTAL: gl.constexpr = NA + NT * SPLIT
    STAGE_BYTES: gl.constexpr = 2 * wgu_desc.block_type.nbytes + x_desc.block_type.nbytes
    pid = gl.program_id(0)
    g = 0
    slot = 0
    first = 1
    go = 1
    u = gl.atomic_add(cnt_ptr, 1)
    while go == 1:
        us = slot % UQ
        mbarrier.wait(uempty.index(us), ((slot // UQ) & 1) ^ 1)
        gl.store(ulist_ptr + pid * UQ + us, u)
        mbarrier.arrive(uready.index(us), count=1)
        slot += 1
        if u >= TOTAL:
            go = 0
        else:
            kt = _unit_tiles(u, SPLIT, KSPLIT_A, BK_C)
            dep = first
            if u >= NA:  # noqa: SIM102 - the group is tested only for a down unit
                if _group_done(_group_counter(cnt_ptr, u, KSPLIT_A), PER_GROUP, False) == 0:
                    dep = 1
            pre = gl.minimum(kt, STAGES) * dep
            for i in range(pre):
                st = (g + i) % STAGES
                mbarrier.wait(empty.index(st), (((g + i) // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(st), STAGE_BYTES)
                _load_w(u, i, wgu_desc, wd_desc, ready.index(st), w_smem.index(2 * st), w_smem.index(2 * st + 1),
                        NA, NT, KB, TILED, KSPLIT_A)
            if dep == 1:
                if USE_PDL:  # noqa: SIM102 - a constexpr test apart from the runtime one
                    if first == 1:
                        _gdc_wait_and_release()
                if u >= NA:
                    _wait_group(_group_counter(cnt_ptr, u, KSPLIT_A), PER_GROUP, err_ptr, spin_cap, False)
            for i in range(pre):
                st = (g + i) % STAGES
                _load_x(u, i, x_desc, h_desc, ready.index(st), x_smem.index(st), NA, NT, KB, KSPLIT_A)
            for t in range(pre, kt):
                st = (g + t) % STAGES
                mbarrier.wait(empty.index(st), (((g + t) // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(st), STAGE_BYTES)
                _load_w(u, t, wgu_desc, wd_desc, ready.index(st), w_smem.index(2 * st), w_smem.index(2 * st + 1),
                        NA, NT, KB, TILED, KSPLIT_A)
                _load_x(u, t, x_desc, h_desc, ready.index(st), x_smem.index(st), NA, NT, KB, KSPLIT_A)
            g += kt
            first = 0
            u = gl.atomic_add(cnt_ptr, 1)


@gluon.jit
def _ws_consumer(w_smem, x_smem, ready, empty, ulist_ptr, uready, uempty, h_ptr, part_ptr, apart_ptr, y_ptr,
                 cnt_ptr, M, SPLIT: gl.constexpr, KSPLIT_A: gl.constexpr, UQ: gl.constexpr, num_warps: gl.constexpr):
    """The MMA warps of `_mlp_ws_kernel`: each unit's products from the stage ring (a stage is handed back as
    soon as its products are done), then the unit's epilogue while the load warp streams on."""
    STAGES: gl.constexpr = ready.type.shape[0]
    BM: gl.constexpr = x_smem.type.shape[1]
    BK_C: gl.constexpr = x_smem.type.shape[2]
    TOTAL: gl.constexpr = INTER_C // HALF_C * KSPLIT_A + HIDDEN_C // (2 * HALF_C) * SPLIT
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BM, 16])
    out_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[8, 4],
                                                warps_per_cta=[1, num_warps], order=[0, 1])
    pid = gl.program_id(0)
    g = 0
    slot = 0
    go = 1
    while go == 1:
        us = slot % UQ
        mbarrier.wait(uready.index(us), (slot // UQ) & 1)
        u = gl.load(ulist_ptr + pid * UQ + us, volatile=True)
        mbarrier.arrive(uempty.index(us), count=1)
        slot += 1
        if u >= TOTAL:
            go = 0
        else:
            kt = _unit_tiles(u, SPLIT, KSPLIT_A, BK_C)
            acc0 = gl.zeros([HALF_C, BM], gl.float32, layout=mma_layout)
            acc1 = gl.zeros([HALF_C, BM], gl.float32, layout=mma_layout)
            for kk in range(kt):
                cs = g % STAGES
                mbarrier.wait(ready.index(cs), (g // STAGES) & 1)
                acc0, acc1 = _mma_tile(w_smem, x_smem, cs, acc0, acc1, kk)
                if kk > 0:  # the previous tile's products are done: its stage goes back to the load warp
                    mbarrier.arrive(empty.index((g - 1) % STAGES), count=1)
                g += 1
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
            mbarrier.arrive(empty.index((g - 1) % STAGES), count=1)
            _unit_epilogue(u, acc0, acc1, h_ptr, part_ptr, apart_ptr, y_ptr, cnt_ptr, M, out_layout, SPLIT, KSPLIT_A)


@gluon.jit
def _mlp_ws_kernel(
    wgu_desc, wd_desc, x_desc, h_desc, h_ptr, part_ptr, apart_ptr, y_ptr, cnt_ptr, err_ptr, ulist_ptr, M, spin_cap,
    SPLIT: gl.constexpr, KSPLIT_A: gl.constexpr, STAGES: gl.constexpr, UQ: gl.constexpr, TILED: gl.constexpr,
    USE_PDL: gl.constexpr, num_warps: gl.constexpr,
):
    """`_mlp_kernel`'s block, warp-specialized: one load warp (`_ws_producer`) streams every unit's tiles while
    the MMA warps (`_ws_consumer`) multiply and run the epilogues, so the weight stream does not stop at a
    unit's end. ulist [grid, UQ] int32 carries the unit ids from the load warp to the MMA warps."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK_C: gl.constexpr = x_desc.block_type.shape[1]
    w_smem = gl.allocate_shared_memory(wgu_desc.dtype, [2 * STAGES, HALF_C, BK_C], wgu_desc.layout)
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BM, BK_C], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    uready = gl.allocate_shared_memory(gl.int64, [UQ, 1], mbarrier.MBarrierLayout())
    uempty = gl.allocate_shared_memory(gl.int64, [UQ, 1], mbarrier.MBarrierLayout())
    for s0 in gl.static_range(STAGES):
        mbarrier.init(ready.index(s0), count=1)
        mbarrier.init(empty.index(s0), count=1)
    for s0 in gl.static_range(UQ):
        mbarrier.init(uready.index(s0), count=1)
        mbarrier.init(uempty.index(s0), count=1)
    gl.warp_specialize([
        (_ws_consumer, (w_smem, x_smem, ready, empty, ulist_ptr, uready, uempty, h_ptr, part_ptr, apart_ptr, y_ptr,
                        cnt_ptr, M, SPLIT, KSPLIT_A, UQ, num_warps)),
        (_ws_producer, (wgu_desc, wd_desc, x_desc, h_desc, w_smem, x_smem, ready, empty, ulist_ptr, uready, uempty,
                        cnt_ptr, err_ptr, spin_cap, SPLIT, KSPLIT_A, UQ, TILED, USE_PDL)),
    ], [1], [48])


def tile_major(w: torch.Tensor, bk: int) -> torch.Tensor:
    """The weights in 64-row bands of 64 x bk contiguous boxes (bench/tma_rows.py's `tile_major_copy`; 16 KB a
    box at bk = 128)."""
    return tile_major_copy(w, HALF, bk)


WS_SLOTS = 2  # unit ids in flight from the warp-specialized kernel's load warp to its MMA warps


def counter_words(split: int) -> int:
    """int32 counters of one block: units taken, the K groups' h tiles done, each output tile's arrivals, each
    h tile's arrivals (its K parts)."""
    return 1 + split + HIDDEN // (2 * HALF) + INTER // HALF


def launch_words(split: int, programs: int) -> int:
    """int32 words one launch needs zeroed: its counters, then (warp-specialized kernel) each program's ring of
    unit ids, which must be the launch's own: under PDL the next layer's programs run beside this one's."""
    return counter_words(split) + programs * WS_SLOTS


def total_units(split: int, ksplit_a: int) -> int:
    """Work units of one block: gate/up's (64 intermediate columns x its K parts), then down's."""
    return INTER // HALF * ksplit_a + HIDDEN // (2 * HALF) * split


class Block:
    """Scratch of the dataflow MLP (h, float32 partials, an error counter) for `m` <= 64 rows, shared by every
    layer of a step; each launch gets its own zeroed counters."""

    def __init__(self, m: int, split: int, stages: int, early_x: bool, device: torch.device, bk: int = 64,
                 tiled: bool = False, ksplit_a: int = 1, ws: bool = False, spin_cap: int = 1 << 22) -> None:
        assert 0 < m <= 64 and INTER % (HALF * split) == 0 and (INTER // split) // bk >= stages - 1
        self.m, self.split, self.stages, self.early_x, self.bk, self.spin_cap = m, split, stages, early_x, bk, spin_cap
        self.tiled = tiled  # weights given as `tile_major` copies
        self.ksplit_a = ksplit_a  # gate/up's K split in parts (A units of HIDDEN / ksplit_a)
        assert HIDDEN // ksplit_a // bk >= stages - 1
        self.apart = torch.empty(ksplit_a, m, 2 * INTER, device=device, dtype=torch.float32)
        self.h = torch.empty(m, INTER, device=device, dtype=torch.bfloat16)
        self.part = torch.empty(split, m, HIDDEN, device=device, dtype=torch.float32)
        self.err = torch.zeros(1, device=device, dtype=torch.int32)
        self.grid = torch.cuda.get_device_properties(device).multi_processor_count
        self.ws = ws  # the warp-specialized kernel (a load warp beside the MMA warps; no trace, no EARLY_X)

    def __call__(self, x: torch.Tensor, w_gu: torch.Tensor, w_d: torch.Tensor, y: torch.Tensor,
                 counters: torch.Tensor, pdl: bool, trace: torch.Tensor | None = None) -> torch.Tensor:
        """y[m, HIDDEN] = down(silu(gate) * up) of x; `counters` (launch_words(split, grid) int32) must be zero;
        `trace` (int64 [total_units, 4]): each unit's program and timestamps."""
        assert x.shape == (self.m, HIDDEN) and w_gu.numel() == 2 * INTER * HIDDEN and w_d.numel() == HIDDEN * INTER
        assert (w_gu.shape[1], w_d.shape[1]) == ((self.bk, self.bk) if self.tiled else (HIDDEN, INTER))
        assert counters.numel() == launch_words(self.split, self.grid) and all(
            t.is_contiguous() for t in (x, w_gu, w_d, y, counters))
        descs = (_desc(w_gu, [HALF, self.bk]), _desc(w_d, [HALF, self.bk]), _desc(x, [64, self.bk]),
                 _desc(self.h, [64, self.bk]))
        if self.ws:
            assert trace is None
            _mlp_ws_kernel[(self.grid,)](
                *descs, self.h, self.part, self.apart, y, counters, self.err, counters[counter_words(self.split):],
                self.m, self.spin_cap,
                SPLIT=self.split, KSPLIT_A=self.ksplit_a, STAGES=self.stages, UQ=WS_SLOTS, TILED=self.tiled,
                USE_PDL=pdl, num_warps=4, launch_pdl=pdl,
            )
            return y
        _mlp_kernel[(self.grid,)](
            *descs, self.h, self.part, self.apart, y, counters, self.err, self.err if trace is None else trace,
            self.m, self.spin_cap, SPLIT=self.split, KSPLIT_A=self.ksplit_a, STAGES=self.stages,
            EARLY_X=self.early_x, TILED=self.tiled, USE_PDL=pdl, TRACE=trace is not None, num_warps=4, launch_pdl=pdl,
        )
        return y

    def expected_counters(self) -> list[int]:
        """Every counter after one launch: each program's last grab finds the queue empty."""
        nj = INTER // HALF
        return ([total_units(self.split, self.ksplit_a) + self.grid] + [nj // self.split] * self.split
                + [self.split] * (HIDDEN // (2 * HALF)) + [self.ksplit_a if self.ksplit_a > 1 else 0] * nj)


def trace_summary(trace: torch.Tensor, na: int) -> dict:
    """One launch's unit timeline (`trace` [total_units, 4]: program, start, activations asked for, end; ns)
    in microseconds from its first unit's start."""
    tr = trace.cpu().double()
    t0 = tr[:, 1].min()
    start, dep, end = (tr[:, 1] - t0) / 1e3, (tr[:, 2] - t0) / 1e3, (tr[:, 3] - t0) / 1e3
    is_a = torch.arange(len(tr)) < na  # the first na units are gate/up's
    prog = tr[:, 0].long()
    last_end = torch.zeros(int(prog.max()) + 1, dtype=torch.float64).scatter_reduce(0, prog, end, "amax")

    def q(v: torch.Tensor) -> list[float]:
        return [round(float(v.quantile(f)), 2) for f in (0.1, 0.5, 0.9)] + [round(float(v.max()), 2)]

    return {"span_us": round(float(end.max()), 2), "a_end_us": round(float(end[is_a].max()), 2),
            "first_b_start_us": round(float(start[~is_a].min()), 2),
            "a_unit_us_p10_p50_p90_max": q((end - start)[is_a]),
            "b_unit_us_p10_p50_p90_max": q((end - start)[~is_a]),
            "b_wait_us_p10_p50_p90_max": q((dep - start)[~is_a]),
            "b_wait_us_sum": round(float((dep - start)[~is_a].sum()), 1),
            "program_last_end_us_p10_p50_p90_max": q(last_end),
            "units_per_program_max": int(torch.bincount(prog).max())}


def silu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    """`runtime/kernels/elementwise.py`'s silu_mul in PyTorch ops: gate, up in bf16, SiLU rounded to bf16."""
    g, u = gu[:, :INTER].float(), gu[:, INTER:].float()
    act = (g / (1.0 + torch.exp(-g))).to(torch.bfloat16).float()
    return (act * u).to(torch.bfloat16)


def main() -> None:
    from bench.fast_tools import bench_result, emit, log, time_interleaved
    from runtime.kernels.elementwise import silu_mul

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--layers", type=int, default=16, help="layers in each chain graph")
    ap.add_argument("--configs", default="6,4,1,128,0;6,4,1,128,1;3,4,1,128,1;6,4,1,128,1,2",
                    help="SPLIT,STAGES,EARLY_X,BK,TILED,KSPLIT_A,WS, ';'-separated; missing trailing fields are 0, "
                         "64, 0, 1, 0. SPLIT: down's K split; EARLY_X: a unit's first activation tiles asked for with "
                         "its weights when nothing is awaited; BK: K per tile; TILED: weights in `tile_major` order; "
                         "KSPLIT_A: gate/up's K split; WS: the warp-specialized kernel")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    out = Path(args.out) if args.out else None
    m, layers = args.rows, args.layers
    result = bench_result("dataflow_mlp", sys.argv[1:], dev, rows=m, layers=layers, checks={}, chain={},
                          traces={})
    log(f"copy {result['copy_gbps']} GB/s")
    ws = [(torch.randn(2 * INTER, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02,
           torch.randn(HIDDEN, INTER, device=dev, dtype=torch.bfloat16) * 0.02) for _ in range(layers)]
    xs = [torch.randn(m, HIDDEN, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
    layer_bytes = (2 * INTER * HIDDEN + HIDDEN * INTER) * 2
    result["weight_bytes_per_layer"] = layer_bytes

    # float32 block of layer 0 and the cuBLAS path's error against it
    x0, (wgu0, wd0) = xs[0], ws[0]
    gu32 = x0.float() @ wgu0.float().t()
    h32 = F.silu(gu32[:, :INTER]) * gu32[:, INTER:]
    y32 = h32 @ wd0.float().t()
    h_cublas = silu_mul(F.linear(x0, wgu0))
    assert torch.equal(h_cublas, silu_mul_ref(F.linear(x0, wgu0)))
    y_cublas = F.linear(h_cublas, wd0)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return round(float((a.float() - b).norm() / b.norm()), 6)

    result["checks"]["cublas"] = {"h_rel": rel(h_cublas, h32), "y_rel": rel(y_cublas, y32)}
    defaults = (None, None, 0, 64, 0, 1, 0)  # SPLIT, STAGES, then the fields later runs added
    configs = []
    for item in args.configs.split(";"):
        given = [int(v) for v in item.split(",")]
        configs.append(tuple(given + list(defaults[len(given):])))
    variants = {}
    for split, stages, early_x, bk, tiled, ksplit_a, ws_on in configs:
        blk = Block(m, split, stages, bool(early_x), dev, bk, bool(tiled), ksplit_a, bool(ws_on))
        wl = [(tile_major(a, bk), tile_major(b, bk)) for a, b in ws] if tiled else ws
        cnt = torch.zeros(layers, launch_words(split, blk.grid), device=dev, dtype=torch.int32)
        ys = torch.zeros(layers, m, HIDDEN, device=dev, dtype=torch.bfloat16)
        for pdl in (False, True):
            name = (f"dataflow_s{split}_a{ksplit_a}_st{stages}_bk{bk}" + ("_ex" if early_x else "")
                    + ("_tiled" if tiled else "") + ("_ws" if ws_on else "")
                    + ("_pdl" if pdl else ""))
            cnt.zero_()
            blk.err.zero_()
            y0 = blk(x0, wl[0][0], wl[0][1], ys[0], cnt[0], pdl)
            torch.cuda.synchronize()
            check = {"h_rel": rel(blk.h, h32), "y_rel": rel(y0, y32), "finite": bool(torch.isfinite(y0).all()),
                     "counters_ok": cnt[0, :counter_words(split)].tolist() == blk.expected_counters(),
                     "polls_ran_out": int(blk.err.item())}
            check["h_vs_cublas_rel"] = rel(blk.h, h_cublas.float())
            result["checks"][name] = check
            log(f"{name}: {check}")
            ok = (check["finite"] and check["counters_ok"] and check["polls_ran_out"] == 0
                  and check["y_rel"] < 2 * result["checks"]["cublas"]["y_rel"] + 1e-3 and check["h_rel"] < 1e-2)
            if not ok:
                emit(result, out)
                raise RuntimeError(f"{name}: check failed {check} (expected counters {blk.expected_counters()[:4]}...)")
            first = y0.clone()

            def step(blk=blk, cnt=cnt, ys=ys, pdl=pdl, wl=wl) -> None:
                cnt.zero_()
                for i in range(layers):
                    blk(xs[i], wl[i][0], wl[i][1], ys[i], cnt[i], pdl)

            step()
            torch.cuda.synchronize()
            eager = ys.clone()
            if not torch.equal(eager[0], first):
                raise RuntimeError(f"{name}: layer 0 differs between two eager runs")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            for _ in range(3):
                ys.zero_()
                graph.replay()
                torch.cuda.synchronize()
                if not torch.equal(ys, eager) or blk.err.item() != 0:
                    raise RuntimeError(f"{name}: graph replay differs from the eager run (or a wait ran out)")
            check["graph_bits_equal"] = True
            variants[name] = graph.replay
            if ws_on:
                continue
            traces = torch.zeros(layers, total_units(split, ksplit_a), 4, device=dev, dtype=torch.int64)

            def traced(blk=blk, cnt=cnt, ys=ys, pdl=pdl, traces=traces, wl=wl) -> None:
                cnt.zero_()
                for i in range(layers):
                    blk(xs[i], wl[i][0], wl[i][1], ys[i], cnt[i], pdl, traces[i])

            traced()
            tgraph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(tgraph):
                traced()
            for _ in range(3):
                tgraph.replay()
            torch.cuda.synchronize()
            if not torch.equal(ys, eager):
                raise RuntimeError(f"{name}: the traced graph's outputs differ")
            result["traces"][name] = trace_summary(traces[layers // 2], INTER // HALF * ksplit_a)
            log(f"{name} trace: {result['traces'][name]}")

    hs = [torch.empty(m, 2 * INTER, device=dev, dtype=torch.bfloat16)]
    yc = torch.empty(layers, m, HIDDEN, device=dev, dtype=torch.bfloat16)

    def cublas_step() -> None:
        for i in range(layers):
            torch.matmul(silu_mul(torch.matmul(xs[i], ws[i][0].t(), out=hs[0])), ws[i][1].t(), out=yc[i])

    cublas_step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cublas_step()
    variants = {"cublas": g.replay} | variants
    timed = time_interleaved(variants, warmup=3, reps=20, rounds=args.rounds)
    for name, t in timed.items():
        us = t["median_ms"] * 1e3 / layers
        result["chain"][name] = {"us_per_layer": round(us, 2), "gbps": round(layer_bytes / us / 1e3, 1),
                                 "round_us_per_layer": [round(r * 1e3 / layers, 2) for r in t["round_medians_ms"]]}
    result["floor_us_per_layer"] = round(layer_bytes / result["copy_gbps"] / 1e3, 2)
    log("chain: " + ", ".join(f"{n} {r['us_per_layer']} us" for n, r in result["chain"].items())
        + f"; floor {result['floor_us_per_layer']}")
    emit(result, out)


if __name__ == "__main__":
    main()
