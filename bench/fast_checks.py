"""GPU checks of the fast path's Triton kernels against the PyTorch reference ops (runtime/fast_ops.py).

Every check draws fresh random inputs (never zeros), runs both backends and reports the largest
difference; `run_kernel_checks` returns one dict per kernel with `ok`. Used by bench/fast_bench.py
before anything is timed.
"""
from __future__ import annotations

import functools
import math

import torch

from bench.fast_tools import overridden
from runtime import fp8
from runtime.fast_ops import TorchOps, TritonOps, rope_tables, rope_then_attend
from runtime.fp8 import linear, quantize_weight
from runtime.kernels.fp8_gemm import weight_only_tiles
from runtime.kv_cache import quantize_rows


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.float(), b.float()
    return {
        "max_abs_diff": float((a - b).abs().max()),
        "rel_l2": float((a - b).norm() / b.norm().clamp(min=1e-30)),
        "exact_fraction": float((a == b).float().mean()),
        "finite": bool(torch.isfinite(a).all()),
    }


def _cache(blocks: int, block_size: int, kv: int, dim: int, device: torch.device, gen: torch.Generator):
    k = torch.randn(blocks, block_size, kv, dim, device=device, generator=gen).to(torch.bfloat16)
    v = torch.randn(blocks, block_size, kv, dim, device=device, generator=gen).to(torch.bfloat16)
    return k, v


# op name of the fast path each check covers (a failed check switches that op to its fallback)
CHECK_OPS = {"add_rmsnorm": "add_rmsnorm", "qk_norm_rope_store": "qk_norm_rope_store", "silu_mul": "silu_mul",
             "embed": "embed",
             "decode_attention_rope": "decode_attention_rope", "decode_attention": "decode_attention",
             "prefill_attention": "prefill_attention",
             "fp8_triton": "fp8_gemv", "gemv": "one_row_gemv"}


def failed_ops(checks: list[dict]) -> set[str]:
    """Fast-path ops whose check failed or raised."""
    return {op for c in checks if not c["ok"] for prefix, op in CHECK_OPS.items() if c["kernel"].startswith(prefix)}


def run_kernel_checks(device: torch.device, **shape: int) -> list[dict]:
    """Every check, each guarded: an exception becomes a failed entry with its message."""
    out: list[dict] = []
    for check in (_check_norms, _check_qk_rope, _check_silu, _check_embed, _check_decode, _check_decode_rope,
                  _check_prefill, _check_fp8, _check_gemv, _check_fp8_kv):
        try:
            out.extend(check(device, **shape))
        except Exception as exc:  # noqa: BLE001 - reported, and the op falls back to PyTorch
            out.append({"kernel": check.__name__.removeprefix("_check_"), "ok": False,
                        "error": f"{type(exc).__name__}: {str(exc)[:1500]}"})
    for c in out:  # map guarded failures onto op names
        if c["kernel"] == "norms":
            c["kernel"] = "add_rmsnorm"
        elif c["kernel"] == "qk_rope":
            c["kernel"] = "qk_norm_rope_store"
        elif c["kernel"] in ("decode", "prefill"):
            c["kernel"] += "_attention"
        elif c["kernel"] == "decode_rope":
            c["kernel"] = "decode_attention_rope"
        elif c["kernel"] == "fp8":
            c["kernel"] = "fp8_triton"
        elif c["kernel"] == "silu":
            c["kernel"] = "silu_mul"
    return out


def _setup(device: torch.device):
    gen = torch.Generator(device=device).manual_seed(1234)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(torch.bfloat16)

    return TorchOps(), TritonOps(), gen, randn


def _check_norms(device: torch.device, hidden: int = 4096, **_: int) -> list[dict]:
    ref, fast, _, randn = _setup(device)
    out: list[dict] = []

    # add + RMSNorm (with and without residual): elementwise, must round like eager
    x, res, w = randn(7, hidden), randn(7, hidden), randn(hidden, scale=0.2) + 1
    for has_res in (False, True):
        (a, ra), (b, rb) = fast.add_rmsnorm(x, res if has_res else None, w, 1e-6), ref.add_rmsnorm(
            x, res if has_res else None, w, 1e-6)
        d = _diff(a, b)
        out.append({"kernel": f"add_rmsnorm(residual={has_res})", **d, "ok": d["rel_l2"] < 1e-2 and d["finite"]
                    and bool(torch.equal(ra, rb))})

    return out


def _check_qk_rope(device: torch.device, heads: int = 32, kv: int = 8, dim: int = 128, **_: int) -> list[dict]:
    ref, fast, gen, randn = _setup(device)
    bf16 = torch.bfloat16
    out: list[dict] = []
    n, block_size, blocks = 6, 16, 40
    qkv = randn(n, (heads + 2 * kv) * dim)
    qn, kn = randn(dim, scale=0.2) + 1, randn(dim, scale=0.2) + 1
    cos, sin = rope_tables(4096, dim, 1e6, bf16, device)
    pos = torch.randint(0, 4096, (n,), device=device, generator=gen)
    slots = torch.randperm(blocks * block_size, device=device, generator=gen)[:n]
    slots[2] = -1
    kc_a, vc_a = _cache(blocks, block_size, kv, dim, device, gen)
    kc_b, vc_b = kc_a.clone(), vc_a.clone()
    qa = fast.qk_norm_rope_store(qkv, qn, kn, cos, sin, pos, slots, kc_a, vc_a, heads, kv, 1e-6)
    qb = ref.qk_norm_rope_store(qkv, qn, kn, cos, sin, pos, slots, kc_b, vc_b, heads, kv, 1e-6)
    dq, dk, dv = _diff(qa, qb), _diff(kc_a, kc_b), _diff(vc_a, vc_b)
    out.append({"kernel": "qk_norm_rope_store", "q": dq, "k_cache": dk, "v_cache": dv,
                "ok": dq["rel_l2"] < 1e-2 and dk["rel_l2"] < 1e-2 and dv["max_abs_diff"] == 0.0})

    return out


def _check_embed(device: torch.device, hidden: int = 4096, **_: int) -> list[dict]:
    """The one-launch embedding lookup against the reference's gathers and selects: the same bits."""
    ref, fast, _, randn = _setup(device)
    text, audio = randn(151680, hidden, scale=0.02), randn(16512, hidden, scale=0.02)
    tokens = torch.tensor([151667, 5, 16383, 151679, 0, 16511, 7, 151645], device=device)
    is_audio = torch.tensor([False, False, True, False, True, True, False, False], device=device)
    got, want = fast.embed(tokens, is_audio, text, audio), ref.embed(tokens, is_audio, text, audio)
    return [{"kernel": "embed", "ok": got.dtype == want.dtype and torch.equal(got.view(torch.int16),
                                                                            want.view(torch.int16))}]


def _check_silu(device: torch.device, inter: int = 12288, **_: int) -> list[dict]:
    ref, fast, _, randn = _setup(device)
    out: list[dict] = []
    gu = randn(5, 2 * inter)
    d = _diff(fast.silu_mul(gu), ref.silu_mul(gu))
    out.append({"kernel": "silu_mul", **d, "ok": d["rel_l2"] < 1e-2})

    return out


def _decode_tables(seq_lens_list: list[int], blocks: int, block_size: int, device: torch.device,
                   gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables [S, W] int32 of distinct random blocks wide enough for the longest context, and the
    contexts as seq_lens [S] int32."""
    n, width = len(seq_lens_list), math.ceil(max(seq_lens_list) / block_size)
    tables = torch.randperm(blocks, device=device, generator=gen)[: n * width].view(n, width).to(torch.int32)
    return tables, torch.tensor(seq_lens_list, dtype=torch.int32, device=device)


def _check_decode(device: torch.device, heads: int = 32, kv: int = 8, dim: int = 128, **_: int) -> list[dict]:
    ref, fast, gen, randn = _setup(device)
    out: list[dict] = []
    blocks, block_size = 200, 16
    kc, vc = _cache(blocks, block_size, kv, dim, device, gen)
    seq_lens_list = [1, 37, 600, 257]
    tables, seq_lens = _decode_tables(seq_lens_list, blocks, block_size, device, gen)
    q = randn(len(seq_lens_list), heads, dim)
    want = ref.decode_attention(q, kc, vc, tables, seq_lens, 1)
    for parts in (1, 4):
        d = _diff(fast.decode_attention(q, kc, vc, tables, seq_lens, parts), want)
        out.append({"kernel": f"decode_attention(parts={parts})", **d, "ok": d["rel_l2"] < 2e-2 and d["finite"]})

    return out


def _decode_rows(device: torch.device, gen: torch.Generator, randn, heads: int, kv: int, dim: int, blocks: int,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
    """One decode row for each of 5 sequences of 1 to 600 keys, the last a padding row (slot -1: its K/V are
    not stored) -> (block tables, seq_lens, the rows' QKV projection, the q/k norm + RoPE arguments of the ops
    that follow it: q/k norm weights, cos, sin, positions, slots)."""
    tables, seq_lens = _decode_tables([1, 37, 600, 257, 64], blocks, block_size, device, gen)
    pos = seq_lens.long() - 1
    slots = (tables.long().gather(1, (pos // block_size)[:, None])[:, 0] * block_size + pos % block_size)
    slots[4] = -1
    qkv = randn(len(pos), (heads + 2 * kv) * dim)
    qn, kn = randn(dim, scale=0.2) + 1, randn(dim, scale=0.2) + 1
    cos, sin = rope_tables(4096, dim, 1e6, torch.bfloat16, device)
    return tables, seq_lens, qkv, (qn, kn, cos, sin, pos, slots)


def _check_decode_rope(device: torch.device, heads: int = 32, kv: int = 8, dim: int = 128, **_: int) -> list[dict]:
    """The fused q/k norm + RoPE + K/V store + attention against the two Triton kernels it replaces and
    against the PyTorch ops; contexts of 1 to 600 keys, one padding row (slot -1), 1 and 4 key partitions.
    Against the two kernels the math and its roundings are the same; only the order of the float32 sum in
    each head's RMSNorm may differ (another tile shape), so results agree to a last bf16 bit at most (on
    the H200 they were identical)."""
    ref, fast, gen, randn = _setup(device)
    out: list[dict] = []
    blocks, block_size = 200, 16
    tables, seq_lens, qkv, rope = _decode_rows(device, gen, randn, heads, kv, dim, blocks, block_size)
    kc, vc = _cache(blocks, block_size, kv, dim, device, gen)
    for parts in (1, 4):
        caches = {name: (kc.clone(), vc.clone()) for name in ("fused", "triton", "torch")}
        got = {name: fn(qkv, *rope, *caches[name], tables, seq_lens, parts, heads, 1e-6)
               for name, fn in (("fused", fast.decode_attention_rope),
                                ("triton", functools.partial(rope_then_attend, fast)),
                                ("torch", ref.decode_attention_rope))}
        vs_triton, vs_torch = _diff(got["fused"], got["triton"]), _diff(got["fused"], got["torch"])
        k_vs, v_vs = (_diff(caches["fused"][i], caches["triton"][i]) for i in (0, 1))
        out.append({"kernel": f"decode_attention_rope(parts={parts})", "vs_unfused_triton": vs_triton,
                    "vs_torch": vs_torch, "k_cache_vs_unfused": k_vs, "v_cache_vs_unfused": v_vs,
                    "ok": vs_triton["rel_l2"] < 1e-3 and k_vs["rel_l2"] < 1e-3 and v_vs["max_abs_diff"] == 0.0
                    and vs_torch["rel_l2"] < 2e-2 and vs_torch["finite"]})

    return out


def _prefill_rows(device: torch.device, gen: torch.Generator, randn, heads: int, dim: int,
                  blocks: int) -> tuple[torch.Tensor, tuple]:
    """Three sequences' new rows (70 of 70 keys, 5 of 55 over earlier pages, 130 of 300) -> (q [205, H, D],
    the prefill ops' arguments after the caches: block tables, seq_lens, query starts, longest query)."""
    q_lens, s_lens, width = [70, 5, 130], [70, 55, 300], 38
    tables = torch.randperm(blocks, device=device, generator=gen)[: 3 * width].view(3, width).to(torch.int32)
    qs = torch.tensor([0, 70, 75, 205], dtype=torch.int32, device=device)
    q = randn(sum(q_lens), heads, dim)
    return q, (tables, torch.tensor(s_lens, dtype=torch.int32, device=device), qs, max(q_lens))


def _check_prefill(device: torch.device, heads: int = 32, kv: int = 8, dim: int = 128, **_: int) -> list[dict]:
    ref, fast, gen, randn = _setup(device)
    blocks, block_size = 200, 16
    kc, vc = _cache(blocks, block_size, kv, dim, device, gen)
    q, args = _prefill_rows(device, gen, randn, heads, dim, blocks)
    d = _diff(fast.prefill_attention(q, kc, vc, *args), ref.prefill_attention(q, kc, vc, *args))
    return [{"kernel": "prefill_attention", **d, "ok": d["rel_l2"] < 2e-2 and d["finite"]}]


def fp8_cache(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """One layer's cache [blocks, block_size, KV, D] as FP8 codes (k, v) and their scales [blocks, KV,
    block_size] as the ops' keyword arguments (runtime/kv_cache.py)."""
    (k8, k_s), (v8, v_s) = quantize_rows(k), quantize_rows(v)
    return k8, v8, {"k_scale": k_s.transpose(1, 2).contiguous(), "v_scale": v_s.transpose(1, 2).contiguous()}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of elements stored with the same bits."""
    return float((a.view(torch.uint8) == b.view(torch.uint8)).float().mean()) if a.element_size() == 1 else float(
        (a == b).float().mean())


def _check_fp8_kv(device: torch.device, heads: int = 32, kv: int = 8, dim: int = 128, **_: int) -> list[dict]:
    """The kernels on an FP8 cache against the PyTorch ops on the same codes and scales. The store quantizes
    as `quantize_rows` does: V codes and every scale bit for bit, K codes as far as K itself is (its bf16
    rows may differ from PyTorch's in a last bit); attention within bf16 rounding of the PyTorch ops, fused
    and unfused, 1 and 4 key partitions, prefill over earlier pages. The quantization's own effect (the
    same attention over the bf16 rows the codes came from) is reported as `vs_bf16_cache`."""
    ref, fast, gen, randn = _setup(device)
    out: list[dict] = []
    blocks, block_size = 200, 16
    # the store: fresh rows into an FP8 cache, codes and scales compared with PyTorch's
    tables, seq_lens, qkv, rope = _decode_rows(device, gen, randn, heads, kv, dim, blocks, block_size)
    qkv[1, (heads + kv) * dim:(heads + kv + 1) * dim] = 0  # a zero V row: scale 0, codes 0
    k16, v16 = _cache(blocks, block_size, kv, dim, device, gen)
    k8, v8, scales = fp8_cache(k16, v16)
    fresh = {name: (k8.clone(), v8.clone(), {k: t.clone() for k, t in scales.items()}) for name in ("triton", "torch")}
    qa = fast.qk_norm_rope_store(qkv, *rope, *fresh["triton"][:2], heads, kv, 1e-6,
                                 **fresh["triton"][2])
    qb = ref.qk_norm_rope_store(qkv, *rope, *fresh["torch"][:2], heads, kv, 1e-6,
                                **fresh["torch"][2])
    (ka, va, sa), (kb, vb, sb) = fresh["triton"], fresh["torch"]
    same = {"k_codes": _same_bytes(ka, kb), "v_codes": _same_bytes(va, vb),
            "k_scale": _same_bytes(sa["k_scale"], sb["k_scale"]), "v_scale": _same_bytes(sa["v_scale"], sb["v_scale"])}
    dq = _diff(qa, qb)
    out.append({"kernel": "qk_norm_rope_store(fp8 kv)", "q": dq, "same_bits": same,
                "ok": dq["rel_l2"] < 1e-2 and same["v_codes"] == same["v_scale"] == 1.0 and same["k_codes"] > 0.999
                and same["k_scale"] > 0.99})
    # decode: the fused kernel and the two kernels it replaces against the PyTorch ops
    for parts in (1, 4):
        caches = {name: (k8.clone(), v8.clone(), {k: t.clone() for k, t in scales.items()})
                  for name in ("fused", "triton", "torch")}
        got = {name: fn(qkv, *rope, *caches[name][:2], tables, seq_lens, parts, heads, 1e-6,
                        **caches[name][2])
               for name, fn in (("fused", fast.decode_attention_rope),
                                ("triton", functools.partial(rope_then_attend, fast)),
                                ("torch", ref.decode_attention_rope))}
        bf16 = ref.decode_attention_rope(qkv, *rope, k16.clone(), v16.clone(), tables,
                                         seq_lens, parts, heads, 1e-6)
        vs_torch, vs_triton = _diff(got["fused"], got["torch"]), _diff(got["triton"], got["torch"])
        codes = _same_bytes(caches["fused"][0], caches["triton"][0]) * _same_bytes(caches["fused"][1],
                                                                                    caches["triton"][1])
        out.append({"kernel": f"decode_attention_rope(fp8 kv, parts={parts})", "vs_torch": vs_torch,
                    "unfused_vs_torch": vs_triton, "codes_same_as_unfused": codes,
                    "vs_bf16_cache": _diff(got["fused"], bf16),
                    "ok": vs_torch["rel_l2"] < 2e-2 and vs_triton["rel_l2"] < 2e-2 and vs_torch["finite"]
                    and codes > 0.999})
    # prefill over earlier pages (codes and scales already in the cache)
    q, args = _prefill_rows(device, gen, randn, heads, dim, blocks)
    got = fast.prefill_attention(q, k8, v8, *args, **scales)
    d = _diff(got, ref.prefill_attention(q, k8, v8, *args, **scales))
    out.append({"kernel": "prefill_attention(fp8 kv)", **d,
                "vs_bf16_cache": _diff(got, ref.prefill_attention(q, k16, v16, *args)),
                "ok": d["rel_l2"] < 2e-2 and d["finite"]})
    return out


def _check_fp8(device: torch.device, hidden: int = 4096, **_: int) -> list[dict]:
    _, _, _, randn = _setup(device)
    out: list[dict] = []
    w8 = quantize_weight(randn(6144, hidden, scale=0.02))
    for rows in (1, 2, 3, 5):  # 2-3: the multi-row CUDA-core GEMV for qkv (its table), 1 and 5: tensor cores
        xx = randn(rows, hidden)
        want = xx.float() @ w8.dequantize(torch.float32).T
        for kernel in ("triton", "scaled_mm"):
            d = _diff(linear(xx, w8, small_batch_kernel=kernel), want)
            out.append({"kernel": f"fp8_{kernel}(M={rows})", **d, "ok": d["rel_l2"] < 5e-2 and d["finite"]})
    # more rows, as `linear` routes them: o through the weight-only kernel at 17-64 rows (its table), qkv and
    # 96 rows through torch._scaled_mm with the one-kernel activation quantization; bf16 activations kept, the
    # weight-only product is ~10x closer to the float32 one
    w_o = quantize_weight(randn(4096, hidden, scale=0.02))
    for rows in (24, 48, 96):
        xx = randn(rows, hidden)
        for name, w in (("o", w_o), ("qkv", w8)):
            weight_only = weight_only_tiles(rows, *w.weight.shape) is not None
            d = _diff(linear(xx, w), xx.float() @ w.dequantize(torch.float32).T)
            path = "weight_only" if weight_only else "scaled_mm"
            out.append({"kernel": f"fp8_{path}({name},M={rows})", **d,
                        "ok": d["rel_l2"] < (5e-3 if weight_only else 5e-2) and d["finite"]})
        same = act_quant_bit_equal(xx)
        out.append({"kernel": f"fp8_act_quant(M={rows})", "bit_equal_to_eager": same, "ok": same})
    return out


def act_quant_bit_equal(x: torch.Tensor) -> bool:
    """Whether the one-kernel activation quantization of runtime/fp8.py (rows padded to 16, as
    `_scaled_mm_linear` pads them) gives the eager ops' codes and scales, bit for bit."""
    rows = -(-x.shape[0] // 16) * 16
    with overridden(fp8.OPTIONS, act_quant="torch"):
        eager = fp8.quantize_activations(x, rows)
    with overridden(fp8.OPTIONS, act_quant="triton"):
        kernel = fp8.quantize_activations(x, rows)
    return torch.equal(eager[0].view(torch.uint8), kernel[0].view(torch.uint8)) and torch.equal(eager[1], kernel[1])


def _check_gemv(device: torch.device, **shape: int) -> list[dict]:
    """One-row fused GEMV (runtime/kernels/gemv.py) vs the separate PyTorch ops + F.linear, in each fold mode
    (OPTIONS["fold"]; "table" as serving runs it: these shapes fall back to the table's default tile) and
    each way of reading the RMSNorm's row (OPTIONS["prologue"]; named when not "loop")."""
    from runtime.kernels import gemv as gemv_mod

    out: list[dict] = []
    before = dict(gemv_mod.OPTIONS)
    try:
        for mode in (0, 1, 2, "table"):
            for prologue in gemv_mod.PROLOGUES:
                gemv_mod.OPTIONS.update(fold=mode, prologue=prologue)
                label = f"fold={mode}, " + ("" if prologue == "loop" else f"prologue={prologue}, ")
                for c in _check_gemv_mode(device, **shape):
                    out.append(c | {"kernel": c["kernel"].replace("gemv(", f"gemv({label}", 1)})
    finally:
        gemv_mod.OPTIONS.update(before)
    return out


def _check_gemv_mode(device: torch.device, hidden: int = 4096, inter: int = 12288, **_: int) -> list[dict]:
    from runtime.kernels.gemv import NONE, RMSNORM, SILU_MUL, gemv

    ref, _, _, randn = _setup(device)
    out: list[dict] = []
    w, nw = randn(3072, hidden, scale=0.02), randn(hidden, scale=0.2) + 1
    x, res = randn(1, hidden), randn(1, hidden)
    for name, residual in (("rmsnorm+res", res), ("rmsnorm", None)):
        h, summed = ref.add_rmsnorm(x, residual, nw, 1e-6)
        got, got_res = gemv(x, w, prologue=RMSNORM, residual=residual, norm_weight=nw, eps=1e-6)
        d = _diff(got, torch.nn.functional.linear(h, w))
        out.append({"kernel": f"gemv({name})", **d, "ok": d["rel_l2"] < 1e-2 and bool(torch.equal(got_res, summed))})
    d = _diff(gemv(x, w)[0], torch.nn.functional.linear(x, w))
    out.append({"kernel": "gemv(none)", **d, "ok": d["rel_l2"] < 1e-2})
    # float32 output (the heads' logits): the activation-typed output's values, widened, bit for bit
    kw = {"prologue": RMSNORM, "residual": res, "norm_weight": nw, "eps": 1e-6}
    wide, narrow = gemv(x, w, out_dtype=torch.float32, **kw)[0], gemv(x, w, **kw)[0]
    out.append({"kernel": "gemv(float32 out)", "ok": wide.dtype == torch.float32 and torch.equal(wide, narrow.float())})
    wd, gu = randn(hidden, inter, scale=0.02), randn(1, 2 * inter)
    d = _diff(gemv(gu, wd, prologue=SILU_MUL)[0], torch.nn.functional.linear(ref.silu_mul(gu), wd))
    out.append({"kernel": "gemv(silu_mul)", **d, "ok": d["rel_l2"] < 1e-2})
    w8 = quantize_weight(w)
    d = _diff(gemv(x, w8.weight, scale=w8.scale, prologue=NONE)[0], x.float() @ w8.dequantize(torch.float32).T)
    out.append({"kernel": "gemv(fp8)", **d, "ok": d["rel_l2"] < 1e-2})
    out.append(_check_fp8_codes(x.device))
    return out


def _check_fp8_codes(device: torch.device, n: int = 256, k: int = 1024) -> dict:
    """Exact FP8 decoding in the one-row GEMV: weight [n, k] holds every finite e4m3 code (row r, column c:
    code (r + 7c) mod 256, the two NaN codes replaced by 0), scales are 1, and x is one-hot at a column, so
    each output is one decoded weight, exactly representable in bf16. Columns 0-3 cover the four bytes of
    a 32-bit word, the last three the end of the row."""
    from runtime.kernels.gemv import gemv

    rows = torch.arange(n, device=device)[:, None]
    cols = torch.arange(k, device=device)[None, :]
    codes = ((rows + 7 * cols) % 256).to(torch.uint8)
    codes[(codes == 0x7F) | (codes == 0xFF)] = 0
    w8 = codes.view(torch.float8_e4m3fn).contiguous()
    want = w8.float()
    scale = torch.ones(n, device=device, dtype=torch.float32)
    mismatches = 0
    for col in (0, 1, 2, 3, 5, k - 3, k - 2, k - 1):
        x = torch.zeros(1, k, device=device, dtype=torch.bfloat16)
        x[0, col] = 1
        got = gemv(x, w8, scale=scale)[0][0].float()
        mismatches += int((got != want[:, col]).sum())
    return {"kernel": "gemv(fp8 codes)", "mismatches": mismatches, "ok": mismatches == 0}


if __name__ == "__main__":  # python -m bench.fast_checks [--out FILE]: every check on the GPU, one JSON line
    import argparse
    import shlex
    import sys
    from pathlib import Path

    from bench.fast_tools import emit

    ap = argparse.ArgumentParser(description="every GPU kernel check of the fast path")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    checks = run_kernel_checks(torch.device("cuda"))
    emit({"bench": "fast_checks", "command": shlex.join(["python", "-m", "bench.fast_checks", *sys.argv[1:]]),
          "device_name": torch.cuda.get_device_name(), "torch": torch.__version__,
          "all_ok": all(c["ok"] for c in checks), "checks": checks}, args.out)
