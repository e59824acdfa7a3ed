"""Layers split in two halves on two streams against the engine's one-stream layer, at 64-128 rows (GPU probe).

    python bench/split_layers.py --out bench/results/split-layers-h100/split-layers-inplace.json

The question (forty-sixth session): at 64 and 128 streams every kernel of the step waits for the one before,
and each boundary costs ~3 us of streaming (bench/results/boundary-ceiling-h200/). The two tails already run
side by side on two streams. Can the 40 layers themselves run as two chains side by side, so that one chain's
ramps and drains are filled by the other's streaming? A layer splits into two independent halves without
reading any weight or cache byte twice:
- the attention block by KV-head groups: half A is the QKV product of query heads 0-15 and KV heads 0-3, the
  attention over those heads (its own cache of 4 KV heads: the engine would hold the cache as two halves),
  and o over those heads' columns; half B the rest. The two o products sum: B's product adds into A's
  output in place (`addmm_`, cuBLAS's beta = 1; an out-of-place `addmm` would copy A's output first);
- the MLP block by intermediate columns: half A is gate/up rows 0-6143 of each, SiLU-mul, and down over those
  columns; half B the rest, summed the same way.
The residual adds and RMSNorms stay single kernels between the blocks (each half needs the whole row).

A chain of `--layers` layers (a weight and cache copy per layer, so L2 holds none of either) is captured in
one CUDA graph per variant and timed in interleaved rounds:
- `serial`: the engine's layer at these row counts (runtime/fast_forward.py `_layer`: add+RMSNorm, cuBLAS
  QKV, the fused q/k-norm + RoPE + K/V store + attention kernel, cuBLAS o, add+RMSNorm, cuBLAS gate/up,
  SiLU-mul, cuBLAS down);
- `split_one_stream`: the halves one after the other on one stream (what splitting alone costs);
- `split_two_streams`: half B on a second stream, forked after each norm and joined before the next;
- `split_staggered`: the same, but half B's first product waits for half A's first product, so that B's
  products run beside A's attention (or SiLU-mul) instead of beside A's products;
- `split_attn_two_streams`, `split_mlp_two_streams`: only that block split on two streams, the other serial.
Before timing, the first layer's output and residual of every split variant are compared with `serial`'s
(relative error; the split sums round once more), every output is finite, and the K/V rows each variant
stored (into slots cleared before it ran) are compared with `serial`'s for the same heads.
"""
from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from bench.decode_attention_tune import BLOCK, DIM, EPS, HEADS, KV, THETA, decode_tables, new_row_slots
from bench.fast_tools import bench_result, emit, kernel_table, log, rel_err, time_interleaved
from runtime.fast_ops import rope_tables
from runtime.kernels.elementwise import add_rmsnorm, silu_mul
from runtime.kernels.paged_attention import decode_num_parts, paged_decode_attention_rope

HIDDEN, INTER = 4096, 12288
HALF_Q, HALF_KV, HALF_I = HEADS // 2, KV // 2, INTER // 2


@dataclass
class Layer:
    """One layer's weights and caches, whole and in halves (the halves are copies: both forms stay resident)."""

    in_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    qkv: torch.Tensor  # [6144, 4096]
    o: torch.Tensor  # [4096, 4096]
    gate_up: torch.Tensor  # [24576, 4096]
    down: torch.Tensor  # [4096, 12288]
    kv: tuple[torch.Tensor, torch.Tensor]  # [blocks, 16, 8, 128] each
    qkv_h: tuple[torch.Tensor, torch.Tensor]  # [3072, 4096]: query heads, then KV heads of the half
    o_h: tuple[torch.Tensor, torch.Tensor]  # [4096, 2048]
    gate_up_h: tuple[torch.Tensor, torch.Tensor]  # [12288, 4096]: the half's gate rows, then its up rows
    down_h: tuple[torch.Tensor, torch.Tensor]  # [4096, 6144]
    kv_h: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per half: [blocks, 16, 4, 128] each


def halves_of_qkv(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[(H + 2KV) D, K] -> per half the rows of its query heads, then its K heads, then its V heads."""
    q, k, v = qkv.split([HEADS * DIM, KV * DIM, KV * DIM])
    return tuple(torch.cat([q[i * HALF_Q * DIM:(i + 1) * HALF_Q * DIM], k[i * HALF_KV * DIM:(i + 1) * HALF_KV * DIM],
                            v[i * HALF_KV * DIM:(i + 1) * HALF_KV * DIM]]).contiguous() for i in (0, 1))


def halves_of_gate_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[2I, K] (gate rows, then up rows) -> per half its gate rows then its up rows, as `silu_mul` reads."""
    gate, up = gate_up.chunk(2)
    return tuple(torch.cat([gate[i * HALF_I:(i + 1) * HALF_I], up[i * HALF_I:(i + 1) * HALF_I]]).contiguous()
                 for i in (0, 1))


def make_layer(blocks: int, dev: torch.device, dtype: torch.dtype = torch.bfloat16) -> Layer:
    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dtype) * shape[-1] ** -0.5

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(n, device=dev, dtype=dtype)

    qkv, o, gate_up, down = w((HEADS + 2 * KV) * DIM, HIDDEN), w(HIDDEN, HEADS * DIM), w(2 * INTER, HIDDEN), w(HIDDEN, INTER)
    kv = tuple(torch.randn(blocks, BLOCK, KV, DIM, device=dev, dtype=dtype) for _ in range(2))
    return Layer(
        in_norm=norm(HIDDEN), post_norm=norm(HIDDEN), q_norm=norm(DIM), k_norm=norm(DIM), qkv=qkv, o=o,
        gate_up=gate_up, down=down, kv=kv, qkv_h=halves_of_qkv(qkv),
        o_h=tuple(c.contiguous() for c in o.chunk(2, dim=1)), gate_up_h=halves_of_gate_up(gate_up),
        down_h=tuple(c.contiguous() for c in down.chunk(2, dim=1)),
        kv_h=tuple(tuple(c[:, :, i * HALF_KV:(i + 1) * HALF_KV].contiguous() for c in kv) for i in (0, 1)),
    )


@dataclass
class Step:
    """The decode inputs shared by every layer: positions, new-row slots, block tables, lengths, RoPE tables."""

    pos: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor
    seq_lens: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    parts: int  # key partitions of the whole layer's attention
    parts_half: int  # ... and of a half's


def attend(step: Step, qkv: torch.Tensor, layer: Layer, kv: tuple[torch.Tensor, torch.Tensor], heads: int,
           parts: int) -> torch.Tensor:
    """The engine's fused decode attention on QKV rows of `heads` query heads over the cache `kv` -> [B, heads*D]."""
    out = paged_decode_attention_rope(qkv, layer.q_norm, layer.k_norm, step.cos, step.sin, step.pos, step.slots,
                                      kv[0], kv[1], step.tables, step.seq_lens, parts, heads, EPS)
    return out.reshape(qkv.shape[0], heads * DIM)


def serial_attention(layer: Layer, step: Step, h: torch.Tensor) -> torch.Tensor:
    """The attention block as the engine runs it: QKV, the fused attention kernel, o."""
    return F.linear(attend(step, F.linear(h, layer.qkv), layer, layer.kv, HEADS, step.parts), layer.o)


def serial_mlp(layer: Layer, h: torch.Tensor) -> torch.Tensor:
    """The MLP block as the engine runs it: gate/up, SiLU-mul, down."""
    return F.linear(silu_mul(F.linear(h, layer.gate_up)), layer.down)


def serial_layer(layer: Layer, step: Step, x: torch.Tensor, res: torch.Tensor, keep: list) -> tuple:
    """runtime/fast_forward.py `_layer` at 16+ rows, with cuBLAS products."""
    h, res = add_rmsnorm(x, res, layer.in_norm, EPS)
    h, res = add_rmsnorm(serial_attention(layer, step, h), res, layer.post_norm, EPS)
    return serial_mlp(layer, h), res


def split_layer(layer: Layer, step: Step, x: torch.Tensor, res: torch.Tensor, keep: list, *,
                side: torch.cuda.Stream | None, stagger: bool, blocks: str = "attn,mlp") -> tuple:
    """The layer as two halves per block named in `blocks` (the others as `serial_layer`); half B on `side`
    (None: on the current stream, after half A). `keep` holds every tensor either stream made until the graph
    is done with them (no cross-stream reuse)."""
    main = torch.cuda.current_stream() if side is not None else None

    def block(first_a: Callable, rest_a: Callable, first_b: Callable, mid_b: Callable,
              last_b: Callable) -> torch.Tensor:
        """A: first_a then rest_a; B: first_b, mid_b, then last_b adding A's result (after A is done)."""
        if side is None:  # one stream: A, then B
            a = rest_a(first_a())
            return last_b(mid_b(first_b()), a)
        side.wait_stream(main)  # fork: B reads the norm's output
        a1 = first_a()
        a1_done = torch.cuda.Event()
        a1_done.record(main)
        a = rest_a(a1)
        a_done = torch.cuda.Event()
        a_done.record(main)
        with torch.cuda.stream(side):
            if stagger:
                side.wait_event(a1_done)  # B's first product beside A's second kernel, not beside A's product
            b1 = first_b()
            bm = mid_b(b1)
            side.wait_event(a_done)  # B's last product adds A's (beta = 1)
            out = last_b(bm, a)
        main.wait_stream(side)  # join
        keep.extend([a1, a, b1, bm, out])
        return out

    h, res = add_rmsnorm(x, res, layer.in_norm, EPS)
    keep.append(h)
    (qkv_a, qkv_b), (o_a, o_b) = layer.qkv_h, layer.o_h
    kv_a, kv_b = layer.kv_h
    parts = step.parts_half
    if "attn" not in blocks:
        o = serial_attention(layer, step, h)
    else:
        o = block(lambda: F.linear(h, qkv_a), lambda q: F.linear(attend(step, q, layer, kv_a, HALF_Q, parts), o_a),
                  lambda: F.linear(h, qkv_b), lambda q: attend(step, q, layer, kv_b, HALF_Q, parts),
                  lambda attn, a: a.addmm_(attn, o_b.t()))
    h, res = add_rmsnorm(o, res, layer.post_norm, EPS)
    keep.append(h)
    (gu_a, gu_b), (d_a, d_b) = layer.gate_up_h, layer.down_h
    if "mlp" not in blocks:
        return serial_mlp(layer, h), res
    down = block(lambda: F.linear(h, gu_a), lambda g: F.linear(silu_mul(g), d_a),
                 lambda: F.linear(h, gu_b), silu_mul, lambda m, a: a.addmm_(m, d_b.t()))
    return down, res


def chain(layer_fn: Callable, layers: list[Layer], step: Step, x0: torch.Tensor, res0: torch.Tensor,
          keep: list) -> tuple[torch.Tensor, torch.Tensor]:
    """All layers in a row -> last output and residual."""
    x, res = x0, res0
    for layer in layers:
        x, res = layer_fn(layer, step, x, res, keep)
    return x, res


def stored_rows(layer: Layer, slots: torch.Tensor, half: int | None) -> list[torch.Tensor]:
    """The new rows' K and V in the whole cache (`half` None) or in one half's."""
    caches = layer.kv if half is None else layer.kv_h[half]
    return [c.view(-1, c.shape[2], DIM)[slots.long()] for c in caches]


def split_stored_rows(layer: Layer, slots: torch.Tensor, blocks: str) -> list[torch.Tensor]:
    """The new rows' K and V [N, KV, D] as `split_layer(blocks=...)` stored them: in the halves' caches, put
    side by side, when it splits the attention block; else in the whole cache."""
    if "attn" not in blocks:
        return stored_rows(layer, slots, None)
    halves = [stored_rows(layer, slots, i) for i in (0, 1)]
    return [torch.cat([halves[0][j], halves[1][j]], dim=1) for j in (0, 1)]


def clear_new_rows(layer: Layer, slots: torch.Tensor) -> None:
    """Zero the new rows' slots in every cache of the layer (whole and halves), so a check sees fresh stores."""
    for c in (*layer.kv, *layer.kv_h[0], *layer.kv_h[1]):
        c.view(-1, c.shape[2], DIM)[slots.long()] = 0


def measure(rows: int, args: argparse.Namespace, dev: torch.device) -> dict:
    tables, seq_lens, pos, blocks = decode_tables(rows, args.context, dev)
    width, seq_len = tables.shape[1], args.context + 1
    cos, sin = rope_tables(args.context + 64, DIM, THETA, torch.bfloat16, dev)
    step = Step(pos=pos, slots=new_row_slots(tables, pos).int(), tables=tables, seq_lens=seq_lens, cos=cos, sin=sin,
                parts=decode_num_parts(rows, KV, width * BLOCK), parts_half=decode_num_parts(rows, HALF_KV, width * BLOCK))
    layers = [make_layer(blocks, dev) for _ in range(args.layers)]
    x0 = torch.randn(rows, HIDDEN, device=dev, dtype=torch.bfloat16)
    res0 = torch.randn(rows, HIDDEN, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream(dev)
    variants: dict[str, Callable] = {
        "serial": serial_layer,
        "split_one_stream": functools.partial(split_layer, side=None, stagger=False),
        "split_two_streams": functools.partial(split_layer, side=side, stagger=False),
        "split_staggered": functools.partial(split_layer, side=side, stagger=True),
        "split_attn_two_streams": functools.partial(split_layer, side=side, stagger=False, blocks="attn"),
        "split_mlp_two_streams": functools.partial(split_layer, side=side, stagger=False, blocks="mlp"),
    }
    weight_bytes = 2 * HIDDEN * ((HEADS + 2 * KV) * DIM + HEADS * DIM + 2 * INTER + INTER)
    kv_bytes = 2 * rows * seq_len * KV * DIM * 2
    row: dict = {"rows": rows, "layers": args.layers, "parts": step.parts, "parts_half": step.parts_half,
                 "bytes_per_layer": weight_bytes + kv_bytes, "checks": {}}
    log(f"{rows} rows: {(weight_bytes + kv_bytes) / 1e6:.0f} MB a layer, partitions {step.parts} / {step.parts_half}")

    # checks, eager: first layer of each variant against serial's
    want_out, want_res = chain(serial_layer, layers[:1], step, x0, res0, [])
    want_kv = stored_rows(layers[0], step.slots, None)
    for name, fn in variants.items():
        if name == "serial":
            continue
        clear_new_rows(layers[0], step.slots)
        out, res = chain(fn, layers[:1], step, x0, res0, [])
        torch.cuda.synchronize()
        got_kv = split_stored_rows(layers[0], step.slots, fn.keywords.get("blocks", "attn,mlp"))
        kv_err = max(rel_err(got_kv[j], want_kv[j]) for j in (0, 1))
        row["checks"][name] = {"finite": bool(torch.isfinite(out).all() and torch.isfinite(res).all()),
                               "out_rel_err": rel_err(out, want_out), "res_rel_err": rel_err(res, want_res),
                               "kv_rel_err": kv_err}
        log(f"  check {name}: {row['checks'][name]}")
        ok = row["checks"][name]
        if not (ok["finite"] and ok["out_rel_err"] < 2e-2 and ok["res_rel_err"] < 2e-2 and ok["kv_rel_err"] < 2e-2):
            raise SystemExit(f"{name} disagrees with serial: {ok}")

    graphs, keep = {}, {}
    for name, fn in variants.items():
        keep[name] = []
        chain(fn, layers, step, x0, res0, [])  # warm-up (compiles)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            last, _ = chain(fn, layers, step, x0, res0, keep[name])
        keep[name].append(last)
        graphs[name] = g
    timed = time_interleaved({n: g.replay for n, g in graphs.items()}, warmup=3, reps=20, rounds=args.rounds)
    for name, t in timed.items():
        t["us_per_layer"] = round(t["median_ms"] * 1e3 / args.layers, 2)
        t["of_copy"] = round(row["bytes_per_layer"] / (t["us_per_layer"] * 1e-6) / 1e9 / args.copy_gbps, 3)
        log(f"  {name}: {t['us_per_layer']} us a layer ({t['of_copy']:.1%} of copy)")
    for name, g in graphs.items():  # what each layer launches (CUPTI), so the kernel counts are measured
        table = kernel_table(g.replay, steps=2, top=32)
        kernels = [k for k in table["top"] if not k["name"].startswith(("cuda", "Activity"))]
        timed[name]["kernels_per_layer"] = round(sum(k["calls_per_step"] for k in kernels) / args.layers, 2)
        timed[name]["kernels"] = kernels
    row["timed"] = timed
    del graphs, keep, layers
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="64,128")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    result = bench_result("split_layers", sys.argv[1:], dev, context=args.context, rows=[])
    args.copy_gbps = result["copy_gbps"]
    log(f"copy {args.copy_gbps} GB/s")
    out = Path(args.out) if args.out else None
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            result["rows"].append(measure(rows, args, dev))
            emit(result, out)


if __name__ == "__main__":
    main()
