"""What kernel boundaries cost a decode step that only streams its bytes: the ceiling of a persistent
(megakernel) step against one that launches a kernel per product, norm and attention.

    python bench/boundary_ceiling.py --out bench/results/boundary-ceiling-h200/boundary-ceiling.json

A decode step at B streams reads, in order, per layer instance (32 shared + 4 text tail + 4 audio tail):
the QKV weights, the attention's KV (B x (context + 1) keys and values), o's weights, the add+RMSNorm
rows, gate/up's weights, the SiLU-mul rows, down's weights, the second add+RMSNorm's rows; then both heads.
This bench reads exactly those byte counts, phase by phase, from distinct ranges of one buffer (no
arithmetic beyond a sum), in six ways, each captured in one CUDA graph:
- `kernels`: one launch per phase (322; the engine's step launches 369 with its split-K reductions, the
  embedding and the tails on two streams), no PDL;
- `kernels_pdl`: the same under programmatic dependent launch, each kernel waiting for its predecessor
  before its first load (the engine's kernels under PDL);
- `kernels_pdl_early`: each kernel streams its phase first and waits for its predecessor only before it
  ends: every phase's bytes may stream while the one before finishes (weights read across the boundary);
- `persistent`: one kernel whose programs are all resident at once (checked from the compiled kernel's
  registers and shared memory), a grid-wide barrier between phases (`_grid_barrier`: group counters, then
  a phase counter that every program polls);
- `persistent_prefetch`: the same, each program loading its first chunk of the next phase before it waits
  at the barrier;
- `one_read`: one kernel reading all the bytes as one phase (the roofline of this reader).
Every variant's per-phase sums are checked against the buffer's (small integers, so float32 sums are
exact) before it is timed, and again from its graph; the persistent kernel's barrier counters are checked
too. Each reader launch (--launches) runs every variant; PyTorch's own sum over the same bytes is timed
beside them as what a plain read reaches. The tails run one after the other here (the engine overlaps them
on two streams).
"""
from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fast_tools import MATRIX_SHAPES, bench_result, emit, log, time_interleaved

HIDDEN, INTER, KV_HEADS, HEAD_DIM, LAYERS = 4096, 12288, 8, 128, 40
PLAIN, PDL_START, PDL_END, PERSISTENT, PERSISTENT_PREFETCH = 0, 1, 2, 3, 4


def step_phases(batch: int, context: int) -> list[tuple[str, int]]:
    """(name, bytes) of every phase of one bf16 decode step, in order."""
    def weights(name: str) -> int:
        n, k = MATRIX_SHAPES[name]
        return n * k * 2
    layer = [
        ("qkv", weights("qkv") + batch * HIDDEN * 2),
        ("attention", batch * (context + 1) * KV_HEADS * HEAD_DIM * 2 * 2),
        ("o", weights("o") + batch * HIDDEN * 2),
        ("add_rmsnorm", batch * HIDDEN * 2 * 2),
        ("gate_up", weights("gate_up") + batch * HIDDEN * 2),
        ("silu_mul", batch * 2 * INTER * 2),
        ("down", weights("down") + batch * INTER * 2),
        ("add_rmsnorm", batch * HIDDEN * 2 * 2),
    ]
    return layer * LAYERS + [("text_head", weights("text_head")), ("audio_head", weights("audio_head"))]


def phase_table(phases: list[tuple[str, int]], block: int) -> tuple[list[int], list[int]]:
    """Start (elements) and length (chunks of `block` bf16 elements, rounded up) of each phase, laid end to
    end."""
    starts, chunks, at = [], [], 0
    for _, nbytes in phases:
        n = -(-nbytes // (2 * block))
        starts.append(at)
        chunks.append(n)
        at += n * block
    return starts, chunks


def elements(phases: list[tuple[str, int]], block: int) -> int:
    """bf16 elements the phases take, laid end to end in whole chunks."""
    starts, chunks = phase_table(phases, block)
    return starts[-1] + chunks[-1] * block


@triton.jit
def _stream_kernel(buf_ptr, starts_ptr, chunks_ptr, out_ptr, bar_ptr, grp_ptr, flag_ptr, first, num_phases, spin_cap,
                   MAX_PROGS: tl.constexpr, BLOCK: tl.constexpr, UNROLL: tl.constexpr, GROUPS: tl.constexpr,
                   MODE: tl.constexpr):
    """Sum phases first .. first + num_phases - 1 of `buf`: program pid takes chunks pid, pid + grid, ...,
    UNROLL of them loaded before they are added; out[phase, pid] = the program's sum (float32 per lane,
    exact for the buffer's small integers; int64 across lanes). MODE: PLAIN, PDL_START (wait before the first
    load), PDL_END (wait before returning), PERSISTENT (a grid barrier after every phase but the last),
    PERSISTENT_PREFETCH (as PERSISTENT, each program loading its first chunk of the next phase before it
    waits at the barrier, as a persistent step would load the next matrix's first weight tile)."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    PREFETCH: tl.constexpr = MODE == 4
    pre = tl.zeros([BLOCK], buf_ptr.dtype.element_ty)  # the prefetched chunk, widened after the barrier
    if PREFETCH:
        pre = _chunk(buf_ptr, starts_ptr, chunks_ptr, first, pid, offs, BLOCK)
    if MODE == 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if MODE == 2:
        tl.extra.cuda.gdc_launch_dependents()
    for i in range(num_phases):
        p = first + i
        start = tl.multiple_of(tl.load(starts_ptr + p), BLOCK)  # phases start on whole chunks: 16-byte loads
        n = tl.load(chunks_ptr + p)
        acc = tl.zeros([BLOCK], tl.float32)
        c0 = pid
        if PREFETCH:
            acc += pre.to(tl.float32)
            c0 = pid + grid
        for c in range(c0, n, grid * UNROLL):
            for j in tl.static_range(UNROLL):
                cj = c + j * grid
                acc += tl.load(buf_ptr + start + cj.to(tl.int64) * BLOCK + offs, mask=(offs < BLOCK) & (cj < n),
                               other=0.0).to(tl.float32)
        tl.store(out_ptr + p * MAX_PROGS + pid, tl.sum(acc.to(tl.int64), axis=0))
        if MODE >= 3:  # noqa: SIM102 - a constexpr test apart from the runtime one
            if i + 1 < num_phases:
                if PREFETCH:
                    pre = _chunk(buf_ptr, starts_ptr, chunks_ptr, p + 1, pid, offs, BLOCK)
                _grid_barrier(bar_ptr + p, grp_ptr + p * GROUPS, flag_ptr, pid, grid, spin_cap, GROUPS)
    if MODE == 2:
        tl.extra.cuda.gdc_wait()


@triton.jit
def _chunk(buf_ptr, starts_ptr, chunks_ptr, p, pid, offs, BLOCK: tl.constexpr):
    """Chunk `pid` of phase p as loaded (zeros past the phase's end)."""
    start = tl.multiple_of(tl.load(starts_ptr + p), BLOCK)
    n = tl.load(chunks_ptr + p)
    return tl.load(buf_ptr + start + pid.to(tl.int64) * BLOCK + offs, mask=(offs < BLOCK) & (pid < n), other=0.0)


@triton.jit
def _grid_barrier(bar_ptr, grp_ptr, flag_ptr, pid, grid, spin_cap, GROUPS: tl.constexpr):
    """Two levels, so that no counter takes every program's atomic: program pid arrives on its group's
    counter (pid % GROUPS); the group's last arrival arrives on the phase's counter, which every program
    then polls (plain volatile loads) until all GROUPS have arrived. A program that polls `spin_cap` times
    sets flag[0] and goes on instead of hanging."""
    tl.debug_barrier()  # every thread of the program is done with the phase
    g = pid % GROUPS
    size = (grid - g + GROUPS - 1) // GROUPS
    if tl.atomic_add(grp_ptr + g, 1, sem="acq_rel") == size - 1:
        tl.atomic_add(bar_ptr, 1, sem="release")
    seen = tl.load(bar_ptr, volatile=True)
    polls = 0
    while (seen < GROUPS) & (polls < spin_cap):
        seen = tl.load(bar_ptr, volatile=True)
        polls += 1
    if polls >= spin_cap:
        tl.atomic_add(flag_ptr, 1)
    tl.atomic_add(grp_ptr + g, 0, sem="acquire")  # order this program's later loads after the barrier
    tl.debug_barrier()


class Streamer:
    """The buffer, its phase table and the launches of each variant."""

    def __init__(self, buf: torch.Tensor, phases: list[tuple[str, int]], block: int, warps: int, stages: int,
                 per_sm: int, unroll: int, groups: int) -> None:
        dev = buf.device
        self.buf, self.block, self.warps, self.stages, self.unroll, self.groups = (
            buf, block, warps, stages, unroll, groups)
        starts, chunks = phase_table(phases, block)
        assert starts[-1] + chunks[-1] * block <= buf.numel()
        self.starts = torch.tensor(starts, dtype=torch.int64, device=dev)
        self.chunks = torch.tensor(chunks, dtype=torch.int32, device=dev)
        self.chunk_list = chunks
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.max_progs = self.sms * per_sm
        self.num_phases = len(phases)
        self.out = torch.zeros(self.num_phases, self.max_progs, dtype=torch.int64, device=dev)
        self.bar = torch.zeros(self.num_phases, dtype=torch.int32, device=dev)
        self.grp = torch.zeros(self.num_phases * groups, dtype=torch.int32, device=dev)
        self.flag = torch.zeros(1, dtype=torch.int32, device=dev)
        # one phase holding the whole range, for `one_read`
        self.all_starts = torch.zeros(1, dtype=torch.int64, device=dev)
        self.all_chunks = torch.tensor([sum(chunks)], dtype=torch.int32, device=dev)
        self.all_out = torch.zeros(1, self.max_progs, dtype=torch.int64, device=dev)

    def _launch(self, grid: int, starts, chunks, out, first: int, num: int, mode: int, warmup: bool = False):
        args = (self.buf, starts, chunks, out, self.bar, self.grp, self.flag, first, num, 1 << 20)
        options = {"MAX_PROGS": self.max_progs, "BLOCK": self.block, "UNROLL": self.unroll, "GROUPS": self.groups,
                   "MODE": mode, "num_stages": self.stages,
                   "num_warps": self.warps, "launch_pdl": mode in (PDL_START, PDL_END)}
        if warmup:  # compile only
            return _stream_kernel.warmup(*args, grid=(grid,), **options)
        return _stream_kernel[(grid,)](*args, **options)

    def co_resident(self, mode: int) -> dict:
        """Whether a persistent kernel's programs all fit the SMs at once (its grid barrier needs that):
        programs per SM allowed by warps, registers and shared memory, from the compiled kernel."""
        compiled = self._launch(self.max_progs, self.starts, self.chunks, self.out, 0, self.num_phases, mode,
                                warmup=True)
        compiled._init_handles()  # loads the module; sets n_regs
        regs, smem = compiled.n_regs, compiled.metadata.shared
        fits = min(64 // self.warps, 65536 // max(1, regs * 32 * self.warps), 233472 // max(1, smem), 32)
        return {"regs": regs, "shared_bytes": smem, "programs_per_sm_fit": fits,
                "ok": fits * self.sms >= self.max_progs}

    def per_phase(self, mode: int) -> None:
        for p, n in enumerate(self.chunk_list):
            self._launch(min(n, self.max_progs), self.starts, self.chunks, self.out, p, 1, mode)

    def persistent(self, mode: int = PERSISTENT) -> None:
        self.bar.zero_()
        self.grp.zero_()
        self._launch(self.max_progs, self.starts, self.chunks, self.out, 0, self.num_phases, mode)

    def one_read(self) -> None:
        self._launch(self.max_progs, self.all_starts, self.all_chunks, self.all_out, 0, 1, PLAIN)

    def variants(self) -> dict:
        return {"kernels": lambda: self.per_phase(PLAIN), "kernels_pdl": lambda: self.per_phase(PDL_START),
                "kernels_pdl_early": lambda: self.per_phase(PDL_END), "persistent": self.persistent,
                "persistent_prefetch": lambda: self.persistent(PERSISTENT_PREFETCH), "one_read": self.one_read}


def fill(buf: torch.Tensor, piece: int = 1 << 28) -> None:
    """Small integers 0..3 (exact in bf16 and in every float32 partial sum here), piece by piece."""
    gen = torch.Generator(device=buf.device).manual_seed(0)
    for i in range(0, buf.numel(), piece):
        part = buf[i:i + piece]
        part.copy_(torch.randint(0, 4, part.shape, generator=gen, device=buf.device, dtype=torch.int32))


def expected_sums(s: Streamer) -> list[int]:
    """Each phase's sum, from the buffer (exact in float64)."""
    return [int(s.buf[a:a + n * s.block].sum(dtype=torch.float64).item())
            for a, n in zip(s.starts.tolist(), s.chunk_list)]


def check(s: Streamer, name: str, fn, want: list[int]) -> dict:
    """Run `fn` once on zeroed outputs; the per-phase sums must equal the buffer's exactly."""
    s.out.zero_()
    s.all_out.zero_()
    s.flag.zero_()
    fn()
    torch.cuda.synchronize()
    if name == "one_read":
        got = [int(s.all_out.sum().item())]
        ok = got[0] == sum(want)
    else:
        got = s.out.sum(dim=1).tolist()
        ok = got == want
    report = {"sums_equal": ok}
    if name.startswith("persistent"):
        report["barrier_counts_ok"] = (s.bar[:-1].tolist() == [s.groups] * (s.num_phases - 1)
                                       and s.grp.view(-1, s.groups)[:-1].sum(dim=1).tolist()
                                       == [s.max_progs] * (s.num_phases - 1))
        report["spin_cap_hit"] = int(s.flag.item())
        ok = ok and report["barrier_counts_ok"] and report["spin_cap_hit"] == 0
    assert ok, (name, report, got[:4], want[:4])
    return report


def time_launch(buf: torch.Tensor, phases: list[tuple[str, int]], launch: tuple[int, ...], rounds: int) -> dict:
    """Every variant with one reader launch: checked, captured, timed in interleaved rounds, checked again
    from its graph. The persistent kernel only where all its programs fit the SMs at once."""
    s = Streamer(buf, phases, *launch)
    fit = {name: s.co_resident(mode) for name, mode in (("persistent", PERSISTENT),
                                                        ("persistent_prefetch", PERSISTENT_PREFETCH))}
    fns = s.variants()
    for name, got in fit.items():
        if not got["ok"]:
            del fns[name]
    want = expected_sums(s)
    checks = {name: check(s, name, fn, want) for name, fn in fns.items()}
    graphs = {}
    for name, fn in fns.items():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graphs[name] = graph
    timed = time_interleaved({n: g.replay for n, g in graphs.items()}, 3, 20, rounds)
    for name in fns:
        check(s, name, graphs[name].replay, want)
    nbytes = sum(b for _, b in phases)
    one = timed["one_read"]["median_ms"]
    return {"launch": dict(zip(LAUNCH_FIELDS, launch, strict=True)), "programs": s.max_progs, "co_resident": fit,
            "checks": checks,
            "variants": {n: {**t, "gbps": round(nbytes / t["median_ms"] / 1e6, 1)} for n, t in timed.items()},
            "per_boundary_us_over_one_read": {n: round((t["median_ms"] - one) * 1e3 / (len(phases) - 1), 3)
                                              for n, t in timed.items() if n != "one_read"}}


LAUNCH_FIELDS = ("block", "warps", "stages", "programs_per_sm", "unroll", "barrier_groups")


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="64,128")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--launches", default="8192,8,1,2,1,8;8192,8,1,2,1,16;4096,4,1,4,1,16;8192,8,1,1,1,4",
                   help="reader launches, ';'-separated: " + ",".join(LAUNCH_FIELDS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    device = torch.device("cuda")
    result = bench_result("boundary_ceiling", argv, device, context=args.context, rows=[])
    batches = [int(b) for b in args.batches.split(",")]
    launches = [tuple(int(v) for v in item.split(",")) for item in args.launches.split(";")]
    most = max(elements(step_phases(max(batches), args.context), launch[0]) for launch in launches)
    buf = torch.empty(most, dtype=torch.bfloat16, device=device)
    fill(buf)
    log(f"buffer {buf.numel() * 2 / 1e9:.2f} GB")
    for batch in batches:
        phases = step_phases(batch, args.context)
        nbytes = sum(b for _, b in phases)
        # PyTorch's own reduction over the same bytes: what a plain read reaches here
        flat = buf[:nbytes // 2]
        torch_sum = time_interleaved({"sum": functools.partial(torch.sum, flat, dtype=torch.float32)}, 3, 20,
                                     1)["sum"]["median_ms"]
        row = {"batch": batch, "phases": len(phases), "bytes": nbytes, "torch_sum_ms": torch_sum,
               "torch_sum_gbps": round(nbytes / torch_sum / 1e6, 1), "launches": []}
        log(f"B={batch} torch sum {torch_sum:.3f} ms ({row['torch_sum_gbps']} GB/s)")
        for launch in launches:
            got = time_launch(buf, phases, launch, args.rounds)
            row["launches"].append(got)
            log(f"B={batch} {launch} programs {got['programs']}: "
                + ", ".join(f"{n} {t['median_ms']:.3f}" for n, t in got["variants"].items()))
        result["rows"].append(row)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
