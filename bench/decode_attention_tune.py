"""Launch options of the decode-attention kernel at many streams, timed against the copy rate (H200).

    python bench/decode_attention_tune.py --out bench/results/decode-attention-tune-h200/tune.json

The kernel the serving path runs from 16 streams up (`paged_decode_attention_rope`: q/k norm + RoPE, the
new row's K/V stored, attention over the paged cache; full-shape heads: 32 query, 8 KV, D 128; 16-token
pages) is timed for each key tile x warps x stages (`--configs`), with `--orders` also in each grid order
(`kv_first`: a sequence's KV-head programs side by side) and cache layout (`head_major`: [blocks, KV,
block_size, D], a page of one KV head contiguous, instead of the engine's [blocks, block_size, KV, D]), with
`--parts2` also over 2 key partitions (+ the merge kernel). Each sequence has `--context` earlier
tokens on pages spread over the whole cache (a shuffled block table, as a long-running server's pages end up).
A call is timed per layer in a CUDA graph of one call per layer (`--layers` caches, so L2 holds none of the
keys), KV bytes read / time against the device copy rate of the same run.

Before timing, every variant's output is compared with a float32 reference of the same attention
(max abs difference, all finite) and its stored K/V with the default variant's.
"""
from __future__ import annotations

import argparse
import functools
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.fast_tools import copy_bandwidth_gbps, emit, fastest, graph_us_per_call, log
from runtime.fast_ops import rope_tables
from runtime.kernels.paged_attention import decode_num_parts, paged_decode_attention_rope

HEADS, KV, DIM, BLOCK = 32, 8, 128, 16
EPS, THETA = 1e-6, 1_000_000.0
# (key tile, warps, stages); the first is the engine's default before this sweep
CONFIGS = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 2, 2), (64, 2, 3), (64, 8, 2), (64, 8, 3),
           (32, 4, 2), (32, 4, 3), (32, 4, 4), (32, 2, 2), (32, 2, 3), (32, 2, 4), (32, 1, 3),
           (16, 1, 3), (16, 1, 4), (16, 2, 4), (128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3)]


def new_row_slots(tables: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The cache slot of each sequence's new row at `pos` [B] through its block table [B, W] -> [B] int64."""
    return tables.long().gather(1, (pos // BLOCK).long()[:, None])[:, 0] * BLOCK + pos % BLOCK


def decode_tables(batch: int, context: int, dev: torch.device, spare: int = 8
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A decode batch on shuffled pages (as a long-running server's pages end up): `batch` sequences of
    `context` earlier tokens and a new row each -> (block tables [B, W] int32 drawn from B * W + `spare` pages,
    seq_lens [B] int32, the new rows' positions [B], the number of pages)."""
    seq_len = context + 1
    width = -(-seq_len // BLOCK)
    blocks = batch * width + spare
    tables = torch.randperm(blocks, device=dev)[: batch * width].view(batch, width).to(torch.int32)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=dev)
    return tables, seq_lens, seq_lens - 1, blocks


def parse_configs(spec: str) -> list[tuple[int, int, int]]:
    """"64,4,2;32,1,3" -> [(64, 4, 2), (32, 1, 3)]: (key tile, warps, stages)."""
    return [tuple(int(v) for v in c.split(",")) for c in spec.split(";") if c]


def reference(qkv, q_norm, k_norm, cos, sin, pos, k_cache, v_cache, tables, seq_lens, rows: int) -> torch.Tensor:
    """float32 attention of the first `rows` sequences (the new row normalised, rotated and appended)."""
    def norm_rope(x, w, p):
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.float()
        half = DIM // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos[p].float() + rot * sin[p].float()

    out = []
    for b in range(rows):
        n = int(seq_lens[b])
        p = int(pos[b])
        row = qkv[b].view(HEADS + 2 * KV, DIM)
        q = norm_rope(row[:HEADS], q_norm, p)
        k_new = norm_rope(row[HEADS:HEADS + KV], k_norm, p)
        v_new = row[HEADS + KV:].float()
        slots = (tables[b].long()[:, None] * BLOCK + torch.arange(BLOCK, device=qkv.device)).flatten()[:n - 1]
        k = torch.cat([k_cache.view(-1, KV, DIM)[slots].float(), k_new[None]])
        v = torch.cat([v_cache.view(-1, KV, DIM)[slots].float(), v_new[None]])
        k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)  # [n, H, D]
        w = torch.softmax(torch.einsum("hd,nhd->hn", q, k) / DIM ** 0.5, -1)
        out.append(torch.einsum("hn,nhd->hd", w, v))
    return torch.stack(out)


def measure_batch(batch: int, args: argparse.Namespace, copy_gbps: float, cos: torch.Tensor, sin: torch.Tensor,
                  q_norm: torch.Tensor, k_norm: torch.Tensor) -> dict:
    """Every variant at one batch size (module docstring): a row of the result."""
    dev = cos.device
    tables, seq_lens, pos, blocks = decode_tables(batch, args.context, dev)
    seq_len, width = args.context + 1, tables.shape[1]
    qkv = torch.randn(batch, (HEADS + 2 * KV) * DIM, device=dev, dtype=torch.bfloat16)
    caches = {False: [], True: []}
    for _ in range(args.layers):
        k = torch.randn(blocks, BLOCK, KV, DIM, device=dev, dtype=torch.bfloat16)
        v = torch.randn(blocks, BLOCK, KV, DIM, device=dev, dtype=torch.bfloat16)
        caches[False].append((k, v))
        if args.orders:
            caches[True].append((k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()))
    parts = decode_num_parts(batch, KV, width * BLOCK)
    nbytes = 2 * batch * seq_len * KV * DIM * 2
    row: dict = {"batch": batch, "parts": parts, "kv_bytes_per_call": nbytes, "variants": []}
    log(f"batch {batch}: {nbytes / 1e6:.0f} MB of KV per call, {parts} partition(s)")

    # each table's own new-row slots; the in-order pages are timed last: their stores overwrite keys the
    # shuffled sequences read (and the other way round), so each table's reference is taken right before
    # its first variant
    in_order = torch.arange(batch * width, device=dev, dtype=torch.int32).view(batch, width)
    tables_by_name = {"shuffled": tables, "in_order": in_order}
    slots = {t: new_row_slots(tab, pos).int() for t, tab in tables_by_name.items()}
    k0, v0 = caches[False][0]
    want: dict = {}
    base_out: dict = {}

    def run(kc, vc, opts, n_parts, table_name):
        return paged_decode_attention_rope(qkv, q_norm, k_norm, cos, sin, pos, slots[table_name], kc, vc,
                                           tables_by_name[table_name], seq_lens, n_parts, HEADS, EPS, **opts)

    configs = parse_configs(args.configs) if args.configs else CONFIGS
    orders = [(False, False), (True, False), (False, True), (True, True)] if args.orders else [(False, False)]
    variants = [(f"bn{bn}_w{w}_s{s}{'_kvfirst' if kf else ''}{'_headmajor' if hm else ''}",
                 {"block_n": bn, "num_warps": w, "num_stages": s, "kv_first": kf, "head_major": hm}, parts,
                 "shuffled")
                for kf, hm in orders for bn, w, s in configs]
    variants.append(("default_parts2", {}, 2, "shuffled"))
    variants += [(f"bn{bn}_w{w}_s{s}_parts{n}", {"block_n": bn, "num_warps": w, "num_stages": s}, n, "shuffled")
                 for n in (int(v) for v in args.split_parts.split(","))
                 for bn, w, s in (parse_configs(args.parts2) if args.parts2 else [])]
    variants += [("default_again", {}, parts, "shuffled"), ("default_in_order", {}, parts, "in_order")]
    for name, opts, n_parts, table_name in variants:
        entry: dict = {"name": name, "parts": n_parts, "tables": table_name}
        try:
            if table_name not in want:
                want[table_name] = reference(qkv, q_norm, k_norm, cos, sin, pos, k0, v0,
                                             tables_by_name[table_name], seq_lens, rows=4)
                base_out[table_name] = run(k0, v0, {}, parts, table_name)
            hm = opts.get("head_major", False)
            kc, vc = caches[hm][0]
            got = run(kc, vc, opts, n_parts, table_name)
            torch.cuda.synchronize()
            slot = slots[table_name].long()
            stored = [(c.transpose(1, 2) if hm else c).reshape(-1, KV, DIM)[slot] for c in (kc, vc)]
            base_stored = [c.view(-1, KV, DIM)[slot] for c in (k0, v0)]
            entry["finite"] = bool(torch.isfinite(got).all())
            entry["max_abs_vs_float32"] = float((got[:4].float() - want[table_name]).abs().max())
            entry["max_abs_vs_default"] = float((got.float() - base_out[table_name].float()).abs().max())
            entry["stores_equal_default"] = all(torch.equal(a, b) for a, b in zip(stored, base_stored))
            calls = [functools.partial(run, *caches[hm][i], opts, n_parts, table_name)
                     for i in range(args.layers)]
            us = graph_us_per_call(calls)
            entry["us"] = round(us, 2)
            entry["gbps"] = round(nbytes / (us / 1e6) / 1e9, 1)
            entry["of_copy"] = round(entry["gbps"] / copy_gbps, 3)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is reported
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        row["variants"].append(entry)
        log(f"  {name}: {entry.get('us', entry.get('error'))}")
    best = fastest(row["variants"])
    row["fastest"] = best["name"] if best else None
    # the engine's own launch for this grid ("default_again"; the first variant is the first of --configs)
    row["default_us"] = next((v.get("us") for v in row["variants"] if v["name"] == "default_again"), None)
    del caches
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="64,128")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--configs", default="", help="key tile,warps,stages;... (default: CONFIGS)")
    ap.add_argument("--orders", action="store_true", help="also each grid order and cache layout")
    ap.add_argument("--parts2", default="", help="configs also timed over key partitions (+ the merge)")
    ap.add_argument("--split-parts", default="2", help="the partition counts --parts2 uses")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    out = Path(args.out) if args.out else None
    result: dict = {"bench": "decode_attention_tune",
                    "command": shlex.join(["python", "bench/decode_attention_tune.py", *sys.argv[1:]]),
                    "device_name": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "context": args.context, "layers": args.layers, "copy_gbps": round(copy_bandwidth_gbps(dev), 1),
                    "rows": []}
    log(f"copy {result['copy_gbps']} GB/s")
    cos, sin = rope_tables(args.context + 64, DIM, THETA, torch.bfloat16, dev)
    q_norm = 1 + 0.1 * torch.randn(DIM, device=dev, dtype=torch.bfloat16)
    k_norm = 1 + 0.1 * torch.randn(DIM, device=dev, dtype=torch.bfloat16)
    for batch in [int(b) for b in args.batches.split(",")]:
        result["rows"].append(measure_batch(batch, args, result["copy_gbps"], cos, sin, q_norm, k_norm))
        emit(result, out)


if __name__ == "__main__":
    main()
