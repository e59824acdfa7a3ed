"""Every Triton kernel of the engine and the vocoder compiles for the GPUs we serve on, without a GPU.

The kernels only run on the GPU machine (their numerical checks live in bench/fast_checks.py and
bench/vocoder_profile.py); this compiles each one ahead of time to PTX for Hopper (sm_90, the H200) and
Ada (sm_89, the RTX 4090) with the constexpr combinations the code launches, so a kernel that no longer
compiles fails here, not after a GPU session has started. With programmatic dependent launch the PTX must
wait on the predecessor (`griddepcontrol.wait`) and release the successor; without it, neither.

The sm_89 compiles run in a fresh process (this file run as a script): with Triton 3.6, once a process has
compiled the FP8 tensor-core kernel for sm_90, its sm_89 build in the same process fails in ptxas, while a
process that only targets sm_89 (as on a 4090) builds it.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from runtime.kernels import elementwise, fp8_act, fp8_gemm, fp8_gemv, gemv, paged_attention
from vocoder.kernels import aa_snake, channel_bias, chunk_attention, flow_fused, frame_noise

HOPPER, ADA = GPUTarget("cuda", 90, 32), GPUTarget("cuda", 89, 32)


def _ptx(fn, signature: dict[str, str], constexprs: dict, target: GPUTarget, aligned: tuple[str, ...] = ()) -> str:
    """PTX of `fn`; `aligned` names the arguments to declare divisible by 16, as Triton's launcher does at run
    time for 16-byte aligned pointers and sizes (without it, loads are not vectorized). Constexprs with
    defaults that are not given take them, as a launch does."""
    constexprs = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default} | constexprs
    sig = dict(signature) | {name: "constexpr" for name in constexprs}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                          target=target).asm["ptx"]


def _ptrs(names: str, ty: str = "*bf16") -> dict[str, str]:
    return {name: ty for name in names.split()}


GEMV_SIG = _ptrs("x_ptr res_ptr nw_ptr res_out_ptr") | {"w_ptr": "*bf16", "s_ptr": "*fp32", "out_ptr": "*bf16",
                                                      "N": "i32", "K": "i32", "eps": "fp32"}
FP8_ACT_SIG = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "M": "i32"}
LIN_SIG = _ptrs("x_ptr w_ptr b_ptr g_ptr beta_ptr r_ptr y_ptr") | {"M": "i32", "N": "i32", "eps": "fp32"}
CONV_SIG = _ptrs("x_ptr cache_ptr w_ptr cb_ptr g_ptr beta_ptr add_ptr") | {
    "valid_ptr": "*i32", "y_ptr": "*bf16", "upd_ptr": "*bf16", "CO": "i32", "T": "i32",
    "add_stride": "i32", "eps": "fp32"}
SPLIT_SIG = _ptrs("x_ptr cache_ptr w_ptr cb_ptr rx_ptr rw_ptr rb_ptr h_ptr r_ptr upd_ptr") | {
    "valid_ptr": "*i32", "CO": "i32", "T": "i32"}
FINISH_SIG = _ptrs("h_ptr r_ptr g_ptr beta_ptr add_ptr y_ptr") | {"CO": "i32", "T": "i32", "add_stride": "i32",
                                                                  "eps": "fp32"}
DECODE_SIG = _ptrs("q_ptr k_ptr v_ptr out_ptr qkv_ptr qw_ptr kw_ptr cos_ptr sin_ptr") | _ptrs(
    "part_acc_ptr part_ml_ptr ks_ptr vs_ptr", "*fp32") | {"tables_ptr": "*i32", "seq_lens_ptr": "*i32", "scale": "fp32",
                                            "max_blocks": "i32", "pos_ptr": "*i64", "slot_ptr": "*i64", "eps": "fp32"}
QK_SIG = _ptrs("qkv_ptr qw_ptr kw_ptr cos_ptr sin_ptr q_out_ptr k_cache_ptr v_cache_ptr") | _ptrs(
    "ks_ptr vs_ptr", "*fp32") | {"pos_ptr": "*i64", "slot_ptr": "*i64", "eps": "fp32"}
FP8_KV = {"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv"}
SNAKE_SIG = _ptrs("x_ptr y_ptr alpha_ptr beta_ptr") | {"hu_ptr": "*fp32", "hd_ptr": "*fp32", "C": "i32", "T": "i32"}

# (name, kernel, signature, constexprs without USE_PDL): the shapes and flags the launch sites use
CASES = [
    *[(f"gemv[{w[1:]},prologue={p},fold={fold}]", gemv._gemv_kernel, GEMV_SIG | {"w_ptr": w},
       {"PROLOGUE": p, "HAS_RES": p == gemv.RMSNORM, "HAS_SCALE": w == "*fp8e4nv", "BLOCK_N": 8, "BLOCK_K": 512,
        "FOLD": fold, "WHOLE_K": 0, "FIRST_W": False})
      for w in ("*bf16", "*fp8e4nv") for p in (gemv.NONE, gemv.RMSNORM, gemv.SILU_MUL) for fold in (0, 1, 2)],
    # the RMSNorm's row read whole (OPTIONS["prologue"] "whole", and "whole_w" with the first tile early)
    *[(f"gemv[{w[1:]},whole_k,first_w={first}]", gemv._gemv_kernel, GEMV_SIG | {"w_ptr": w},
       {"PROLOGUE": gemv.RMSNORM, "HAS_RES": True, "HAS_SCALE": w == "*fp8e4nv", "BLOCK_N": 8, "BLOCK_K": 512,
        "FOLD": 2, "WHOLE_K": 4096, "FIRST_W": first})
      for w in ("*bf16", "*fp8e4nv") for first in (False, True)],
    # float32 logits out of the heads' GEMV (rounded to bf16 first)
    ("gemv[fp8e4nv,float32_out]", gemv._gemv_kernel, GEMV_SIG | {"w_ptr": "*fp8e4nv", "out_ptr": "*fp32"},
     {"PROLOGUE": gemv.RMSNORM, "HAS_RES": True, "HAS_SCALE": True, "BLOCK_N": 32, "BLOCK_K": 512, "FOLD": 2,
      "WHOLE_K": 4096, "FIRST_W": False}),
    # float32 weights: the engine's float32 checks run the GEMV on them (a 16-byte vector is 4 of them)
    ("gemv[fp32,fold=2]", gemv._gemv_kernel, GEMV_SIG | {"w_ptr": "*fp32"},
     {"PROLOGUE": gemv.NONE, "HAS_RES": False, "HAS_SCALE": False, "BLOCK_N": 8, "BLOCK_K": 512, "FOLD": 2,
      "WHOLE_K": 0, "FIRST_W": False}),
    ("add_rmsnorm", elementwise._add_rmsnorm_kernel, _ptrs("x_ptr res_ptr w_ptr out_ptr res_out_ptr")
     | {"n_cols": "i32", "eps": "fp32"}, {"HAS_RES": True, "BLOCK": 4096}),
    *[(name, elementwise._qk_norm_rope_store_kernel,
       QK_SIG | ({"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"} if quant else {}),
       {"NUM_HEADS": 32, "NUM_KV": 8, "HEAD_DIM": 128, "HEADS_BLOCK": 1, "QUANT": quant, "BLOCK_SIZE": 16})
      for name, quant in (("qk_norm_rope_store", False), ("qk_norm_rope_store(fp8_kv)", True))],
    ("silu_mul", elementwise._silu_mul_kernel, _ptrs("gu_ptr out_ptr") | {"inter": "i32"}, {"BLOCK": 1024}),
    ("embed", elementwise._embed_kernel,
     {"tok_ptr": "*i64", "audio_ptr": "*i1"} | _ptrs("text_w_ptr audio_w_ptr out_ptr"), {"HIDDEN": 4096, "BLOCK": 4096}),
    *[(name, paged_attention._decode_kernel, DECODE_SIG,
       {"BLOCK_SIZE": 16, "NUM_KV": 8, "GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "BLOCK_N": 64, "PART": 64,
        "NUM_PARTS": 16, "DOT_PREC": "tf32", "FUSE_ROPE": fuse, "STORE_ONLY": store_only})
      for name, fuse, store_only in (("decode_attention", False, False), ("decode_attention_rope", True, False),
                                     ("decode_attention_rope(store_only)", True, True))],
    # partitions of each sequence's own keys (PART 0: OPTIONS["dynamic_parts"])
    *[(f"{name}(dynamic_parts)", paged_attention._decode_kernel, DECODE_SIG,
       {"BLOCK_SIZE": 16, "NUM_KV": 8, "GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "BLOCK_N": 64, "PART": 0,
        "NUM_PARTS": 8, "DOT_PREC": "tf32", "FUSE_ROPE": fuse, "STORE_ONLY": False})
      for name, fuse in (("decode_attention", False), ("decode_attention_rope", True))],
    # an FP8 cache: e4m3 codes and a float32 scale per (slot, KV head)
    *[(f"{name}(fp8_kv)", paged_attention._decode_kernel, DECODE_SIG | FP8_KV,
       {"BLOCK_SIZE": 16, "NUM_KV": 8, "GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "BLOCK_N": 64, "PART": 0,
        "NUM_PARTS": parts, "DOT_PREC": "tf32", "FUSE_ROPE": fuse, "STORE_ONLY": False, "QUANT": True,
        "F16_DOT": True})
      for name, fuse, parts in (("decode_attention", False, 8), ("decode_attention_rope", True, 1))],
    ("decode_merge", paged_attention._decode_reduce_kernel, _ptrs("part_acc_ptr part_ml_ptr", "*fp32")
     | {"out_ptr": "*bf16"}, {"NUM_PARTS": 16, "HEAD_DIM": 128}),
    ("fp8_gemv_rows", fp8_gemv._fp8_gemv_kernel.fn, {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                                                      "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32"},
     {"BLOCK_N": 32, "BLOCK_K": 256}),
    ("fp8_act_quantize", fp8_act._quantize_rows_kernel, FP8_ACT_SIG, {"K": 12288, "BLOCK": 2048}),
    *[(f"fp8_weight_only[bm={bm},split={split}]", fp8_gemm._fp8_gemm_kernel,
       {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "out_ptr": "*fp32" if split > 1 else "*bf16",
        "M": "i32", "N": "i32"},
       {"K": k, "K_SPLIT": k // split, "BM": bm, "BN": 64, "BK": 128, "PARTIAL": split > 1})
      for bm, split, k in ((32, 4, 12288), (32, 1, 4096), (64, 4, 4096))],
    *[(f"fp8_gemv_rows[rows={rows}]", fp8_gemv._gemv_rows_kernel,
       {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "N": "i32"},
       {"K": 4096, "ROWS": rows, "BLOCK_N": bn, "BLOCK_K": bk}) for rows, bn, bk in ((2, 32, 256), (4, 8, 1024))],
    ("fp8_weight_only_reduce", fp8_gemm._reduce_kernel,
     {"part_ptr": "*fp32", "s_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "N": "i32"}, {"SPLIT": 4, "BLOCK": 1024}),
    *[(f"flow_fused_linear[early_w={early},k={k}]", flow_fused._fused_linear_kernel, LIN_SIG,
       {"K": k, "HAS_LN": k == 256, "HAS_BIAS": True, "ACT": int(k == 256), "HAS_RES": k > 256, "IEEE": False,
        "BM": 16, "BN": 32, "BK": 256, "EARLY_W": early}) for early in (True, False) for k in (256, 1024)],
    *[(f"flow_causal_conv[norm_mish={nm},time_major={tm}]", flow_fused._causal_conv_norm_mish_kernel, CONV_SIG,
       {"HAS_CACHE": True, "HAS_ADD": nm, "HAS_UPDATE": True, "NORM_MISH": nm, "TIME_MAJOR": tm, "IEEE": False,
        "CI": 256, "CTX": 2, "BCO": 256, "BT": 16, "BK": 32})
      for nm, tm in ((True, False), (True, True), (False, True))],
    *[(f"flow_causal_conv_split[res={res},time_major={tm}]", flow_fused._causal_conv_split_kernel, SPLIT_SIG,
       {"CI": 256, "CIR": 320, "HAS_CACHE": True, "HAS_RES": res, "HAS_UPDATE": True, "TIME_MAJOR": tm,
        "RES_TM": tm, "IEEE": False, "CTX": 2, "BCO": 16, "BT": 16, "BK": 128, "BKR": 128})
      for res, tm in ((True, True), (False, True), (True, False))],
    *[(f"flow_norm_mish_finish[add={add},res={res}]", flow_fused._norm_mish_finish_kernel, FINISH_SIG,
       {"HAS_ADD": add, "HAS_RES": res, "TIME_MAJOR": True, "BCO": 256, "BT": 16})
      for add, res in ((True, False), (False, True))],
    *[(f"flow_add_layer_norm[add={add}]", flow_fused._add_layer_norm_kernel,
       _ptrs("x_ptr y_ptr g_ptr beta_ptr s_ptr n_ptr") | {"M": "i32", "eps": "fp32"},
       {"C": 256, "BC": 256, "ROWS": 16, "HAS_ADD": add}) for add in (True, False)],
    *[(f"channel_bias[C={c}]", channel_bias._channel_bias_kernel, {"y_ptr": "*bf16", "b_ptr": "*bf16", "R": "i32"},
       {"C": c, "BC": bc, "ROWS": 4096 // bc}) for c, bc in ((24, 32), (768, 1024))],
    ("chunk_attention", chunk_attention._chunk_attention_kernel, {"qkv_ptr": "*bf16", "out_ptr": "*bf16",
                                                                  "M": "i32", "scale": "fp32"},
     {"H": 8, "D": 64, "CHUNK": 4, "ROWS": 64}),
    ("aa_snake", aa_snake._aa_snake_kernel, SNAKE_SIG, {"LOG_SCALE": True, "HAS_BETA": True, "BLOCK": 256}),
    ("aa_snake_gather", aa_snake._aa_snake_gather_kernel, SNAKE_SIG,
     {"LOG_SCALE": True, "HAS_BETA": True, "BLOCK": 256}),
    ("aa_snake_nwc", aa_snake._aa_snake_nwc_kernel, SNAKE_SIG,
     {"LOG_SCALE": True, "HAS_BETA": True, "FAST_SIN": True, "BT": 16, "BC": 64}),
    ("aa_snake_nwc_gather", aa_snake._aa_snake_nwc_gather_kernel, SNAKE_SIG,
     {"LOG_SCALE": True, "HAS_BETA": True, "FAST_SIN": True, "R": 64, "BC": 32}),
]


@pytest.mark.parametrize(("fn", "signature", "constexprs"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_kernel_compiles_for_hopper_with_and_without_pdl(fn, signature: dict, constexprs: dict) -> None:
    with_pdl = _ptx(fn, signature, constexprs | {"USE_PDL": True}, HOPPER)
    assert "griddepcontrol.wait" in with_pdl and "griddepcontrol.launch_dependents" in with_pdl
    plain = _ptx(fn, signature, constexprs | {"USE_PDL": False}, HOPPER)
    assert ".entry" in plain and "griddepcontrol" not in plain


def test_frame_noise_kernel_compiles_with_one_float64_to_float32_rounding() -> None:
    """The noise kernel (no PDL: it follows a host copy) does Box-Muller in float64 and rounds once."""
    ptx = _ptx(frame_noise._frame_noise_kernel, {"keys_ptr": "*i64", "starts_ptr": "*i64", "out_ptr": "*fp32",
                                                 "total": "i64", "length": "i32"},
               {"MELS": 80, "TWO_PI": frame_noise._TWO_PI, "BLOCK": frame_noise.BLOCK}, HOPPER)
    ops = _opcodes(ptx)
    assert ".entry" in ptx and "griddepcontrol" not in ptx
    assert ops.get("cvt.rn.f32.f64", 0) > 0 and ops.get("sqrt.rn.f64", 0) > 0
    assert "0d401921FB54442D18" in ptx  # 2 pi as the eager code's float64 product, not rounded to float32


def _opcodes(ptx: str) -> dict[str, int]:
    """How often each PTX opcode occurs (predicated instructions included)."""
    counts: dict[str, int] = {}
    for op in re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)", ptx, re.MULTILINE):
        counts[op] = counts.get(op, 0) + 1
    return counts


@pytest.mark.parametrize(("weight", "loads"), [("*bf16", 4), ("*fp8e4nv", 2)])
def test_gemv_folds_each_tile_with_the_same_loads_and_products(weight: str, loads: int) -> None:
    """8 x 512 weights over 128 threads: 32 per thread, in 4 (bf16) or 2 (FP8) 16-byte loads as the runtime's
    aligned launch gets them, and 32 FMAs each way. Folded across the tile (1), each tile's products are
    summed across the threads in the loop (butterfly shuffles there); unfolded (0) or folded within each
    thread's vectors (2), only once after it."""
    constexprs = {"PROLOGUE": gemv.NONE, "HAS_RES": False, "HAS_SCALE": weight == "*fp8e4nv", "BLOCK_N": 8,
                  "BLOCK_K": 512, "USE_PDL": False, "WHOLE_K": 0, "FIRST_W": False}
    aligned = ("x_ptr", "res_ptr", "nw_ptr", "res_out_ptr", "w_ptr", "s_ptr", "out_ptr", "N", "K")
    sig = GEMV_SIG | {"w_ptr": weight}
    for fold in (0, 1, 2):
        ptx = _ptx(gemv._gemv_kernel, sig, constexprs | {"FOLD": fold}, HOPPER, aligned)
        header = re.search(r"^(\$L__BB\d+_\d+):.*Inner Loop Header", ptx, re.MULTILINE)
        assert header is not None
        loop = ptx[header.end():ptx.index(f"bra \t{header.group(1)};", header.end())]
        ops = _opcodes(ptx)
        assert ops["ld.global.v4.b32"] == loads and _opcodes(loop)["ld.global.v4.b32"] == loads
        assert ops["fma.rn.f32"] + ops.get("mul.f32", 0) >= 32  # folded, a tile's first product is a mul
        assert ("shfl.sync.bfly.b32" in _opcodes(loop)) == (fold == 1)


@pytest.mark.parametrize("first_w", [False, True])
def test_gemv_whole_row_prologue_reads_the_row_outside_any_loop(first_w: bool) -> None:
    """With WHOLE_K the RMSNorm's row (x and the residual, 4096 bf16 over 128 threads: 32 each, 4 + 4
    16-byte loads) is read before the weight loop, in no loop of its own: the PTX has one loop, the weight
    loop, with the tile's 4 16-byte loads and 8-byte loads of x, the residual and the norm weight per
    thread and step. The row loop of the default prologue is the other loop(s) of `looped`. With FIRST_W the
    first tile's 4 loads (masked by the row bound) come first after the PDL wait, then the row's 8, then the
    first step's x loads, the loop starting one tile later."""
    constexprs = {"PROLOGUE": gemv.RMSNORM, "HAS_RES": True, "HAS_SCALE": False, "BLOCK_N": 8, "BLOCK_K": 512,
                  "USE_PDL": True, "FOLD": 2}
    aligned = ("x_ptr", "res_ptr", "nw_ptr", "res_out_ptr", "w_ptr", "s_ptr", "out_ptr", "N", "K")
    whole = _ptx(gemv._gemv_kernel, GEMV_SIG, constexprs | {"WHOLE_K": 4096, "FIRST_W": first_w}, HOPPER, aligned)
    looped = _ptx(gemv._gemv_kernel, GEMV_SIG, constexprs | {"WHOLE_K": 0, "FIRST_W": False}, HOPPER, aligned)
    assert whole.count("Inner Loop Header") == 1 and looped.count("Inner Loop Header") > 1
    label = re.findall(r"^(\$L__BB\d+_\d+):", whole[:whole.index("Inner Loop Header")], re.MULTILINE)[-1]
    start = whole.index(f"{label}:")
    loop = _opcodes(whole[start:whole.index(f"bra \t{label};", start)])
    assert (loop["ld.global.v4.b32"], loop["ld.global.v2.b32"]) == (4, 3)
    before = whole[whole.index("griddepcontrol.wait"):start]
    loads = re.findall(r"^\s*(@%p\d+ )?ld\.global\.(v\d)\.b32", before, re.MULTILINE)
    row = [("", "v4")] * 8
    assert loads == ([("@%p1 ", "v4")] * 4 + row + [("", "v2")] * 3 if first_w else row)


def _prefetches_before_wait(ptx: str) -> list[str]:
    """The bulk L2 prefetch lines of `ptx` that come before its PDL wait (all of them must)."""
    lines = [line.strip() for line in ptx.splitlines() if "cp.async.bulk.prefetch.L2.global" in line]
    assert all(ptx.index(line) < ptx.index("griddepcontrol.wait") for line in lines)
    return lines


def test_l2_prefetches_are_issued_once_per_program_before_the_pdl_wait() -> None:
    """The FP8 GEMVs, one row and 2-4 rows (L2_SLICE), ask once, the split-key decode attention (L2_KV) twice (the first key's K and
    V rows), each predicated on thread 0 and a non-zero size, before `griddepcontrol.wait`; without the
    options the kernels hold no prefetch."""
    gemv_c = {"PROLOGUE": gemv.RMSNORM, "HAS_RES": True, "HAS_SCALE": True, "BLOCK_N": 32, "BLOCK_K": 512,
              "USE_PDL": True, "FOLD": 2, "WHOLE_K": 4096, "FIRST_W": False}
    sig = GEMV_SIG | {"w_ptr": "*fp8e4nv"}
    with_slice = _ptx(gemv._gemv_kernel, sig, gemv_c | {"L2_SLICE": 2048}, HOPPER)
    (line,) = _prefetches_before_wait(with_slice)
    assert re.fullmatch(r"@%pf cp\.async\.bulk\.prefetch\.L2\.global \[%rd\d+\], %r\d+;", line)
    assert "setp.eq.u32 %po, %tf, 0;" in with_slice and "setp.ne.and.u32 %pf" in with_slice
    assert re.search(r"min\.s32\s+%r\d+, %r\d+, 2048;", with_slice)  # the size capped by the constant
    assert "cp.async.bulk.prefetch" not in _ptx(gemv._gemv_kernel, sig, gemv_c, HOPPER)
    rows_sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "N": "i32"}
    rows_c = {"K": 4096, "ROWS": 2, "BLOCK_N": 8, "BLOCK_K": 1024, "USE_PDL": True}
    assert len(_prefetches_before_wait(_ptx(fp8_gemv._gemv_rows_kernel, rows_sig, rows_c | {"L2_SLICE": 2048},
                                            HOPPER))) == 1
    assert "cp.async.bulk.prefetch" not in _ptx(fp8_gemv._gemv_rows_kernel, rows_sig, rows_c, HOPPER)
    attn_c = {"BLOCK_SIZE": 16, "NUM_KV": 8, "GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "BLOCK_N": 64,
              "PART": 0, "NUM_PARTS": 16, "DOT_PREC": "tf32", "STORE_ONLY": False, "USE_PDL": True}
    for fuse in (False, True):
        with_kv = _ptx(paged_attention._decode_kernel, DECODE_SIG, attn_c | {"FUSE_ROPE": fuse, "L2_KV": True}, HOPPER)
        assert len(_prefetches_before_wait(with_kv)) == 2
        plain = _ptx(paged_attention._decode_kernel, DECODE_SIG, attn_c | {"FUSE_ROPE": fuse}, HOPPER)
        assert "cp.async.bulk.prefetch" not in plain


def test_the_chain_probes_product_prefetches_its_weight_slice_once_before_the_pdl_wait() -> None:
    """bench/rows_gemm.py --chain: the 64-128-row product with L2_SLICE asks L2 once for its program's
    weight slice before `griddepcontrol.wait`, and holds no prefetch without it (a probe for the next GPU
    run; its timing is not known)."""
    from bench import rows_gemm

    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32", "N": "i32"}
    consts = {"K": 4096, "BM": 64, "BN": 32, "BK": 128, "USE_PDL": True}
    for size in (2048, -1):
        (line,) = _prefetches_before_wait(_ptx(rows_gemm._rows_gemm_kernel, sig, consts | {"L2_SLICE": size}, HOPPER))
        assert re.fullmatch(r"@%pf cp\.async\.bulk\.prefetch\.L2\.global \[%rd\d+\], %r\d+;", line)
    assert "cp.async.bulk.prefetch" not in _ptx(rows_gemm._rows_gemm_kernel, sig, consts, HOPPER)
    # the side-branch prefetcher: one bulk prefetch of at most CHUNK bytes per program, no PDL wait
    side = _ptx(rows_gemm._l2_prefetch_kernel, {"ptr": "*u8", "nbytes": "i32"}, {"CHUNK": 1 << 20}, HOPPER)
    (line,) = [line.strip() for line in side.splitlines() if "cp.async.bulk.prefetch.L2.global" in line]
    assert re.fullmatch(r"@%pf cp\.async\.bulk\.prefetch\.L2\.global \[%rd\d+\], %r\d+;", line)
    assert re.search(r"min\.s(32|64)\s+%r(d)?\d+, %r(d)?\d+, 1048576;", side) and "griddepcontrol" not in side


def test_the_tma_probe_asks_for_its_weight_tiles_before_the_pdl_wait_only_when_told() -> None:
    """bench/tma_rows.py (a Gluon kernel): with EARLY_W the first STAGES weight tiles' TMA copies come before
    `griddepcontrol.wait` and the activation tiles' after it; without, every copy comes after the wait; without
    PDL there is no wait. Every stage is one weight and one activation copy on wgmma."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from bench import tma_rows

    def ptx(early: bool, pdl: bool, stages: int = 4) -> str:
        desc = {name: f"tensordesc<bf16[{rows}, 64],{gl.NVMMASharedLayout.get_default_for([rows, 64], gl.bfloat16)!r}>"
                for name, rows in (("w_desc", 128), ("x_desc", 64))}
        consts = {"K_TILES": 16, "UNITS_PER": 2, "STAGES": stages, "SPLIT": 1, "USE_PDL": pdl, "EARLY_W": early,
                  "TILED": False, "num_warps": 4}
        sig = desc | {"y_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32"} | {name: "constexpr" for name in consts}
        src = GluonASTSource(fn=tma_rows._tma_rows_kernel, signature=sig, constexprs=consts)
        return triton.compile(src, target=HOPPER, options={"num_warps": 4}).asm["ptx"]

    for early in (True, False):
        text = ptx(early, True)
        lines = [line.strip() for line in text.splitlines()]
        wait = next(i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait"))
        copies = [i for i, line in enumerate(lines) if "cp.async.bulk.tensor.2d" in line]
        assert sum(i < wait for i in copies) == (4 if early else 0)
        assert "wgmma.mma_async" in text
    assert "griddepcontrol" not in ptx(True, False)


@pytest.mark.parametrize("ksplit_a", [1, 2])
def test_the_dataflow_mlp_asks_for_weights_before_the_pdl_wait_and_publishes_h_through_one_thread(ksplit_a: int) -> None:
    """bench/dataflow_mlp.py (a Gluon kernel): under PDL the first STAGES - 1 tiles' weight copies (two halves
    each) come before `griddepcontrol.wait` and no activation copy does; the counters are updated by
    single-thread (predicated) atomics, h's release is gpu-scoped, and both sides of it fence the async proxy."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from bench import dataflow_mlp

    stages = 4
    desc = {name: f"tensordesc<bf16[64, 128],{gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)!r}>"
            for name in ("wgu_desc", "wd_desc", "x_desc", "h_desc")}
    consts = {"SPLIT": 6, "KSPLIT_A": ksplit_a, "STAGES": stages, "EARLY_X": True, "TILED": True, "USE_PDL": True,
              "TRACE": False, "num_warps": 4}
    sig = desc | {"h_ptr": "*bf16", "part_ptr": "*fp32", "apart_ptr": "*fp32", "y_ptr": "*bf16", "cnt_ptr": "*i32",
                  "err_ptr": "*i32", "trace_ptr": "*i64", "M": "i32", "spin_cap": "i32"}
    sig |= {name: "constexpr" for name in consts}
    src = GluonASTSource(fn=dataflow_mlp._mlp_kernel, signature=sig, constexprs=consts)
    lines = [line.strip() for line in triton.compile(src, target=HOPPER, options={"num_warps": 4}).asm["ptx"].splitlines()]
    # which register holds which descriptor: mov.b64 %rdP, <kernel>_param_N; cvta.param.u64 %rdD, %rdP
    param_of = {m[0]: int(m[1]) for m in (re.findall(r"mov\.b64\s+(%rd\d+), _mlp_kernel_param_(\d+);", "\n".join(lines)))}
    desc_of = {d: param_of[s] for d, s in re.findall(r"cvta\.param\.u64\s+(%rd\d+), (%rd\d+);", "\n".join(lines))}
    weights = set(sorted(desc_of, key=desc_of.get)[:2])  # wgu_desc, wd_desc: the first two descriptors
    copies = [(i, re.search(r"\[(%rd\d+),", line)[1]) for i, line in enumerate(lines) if "cp.async.bulk.tensor.2d" in line]
    last_wait = max(i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait"))
    before = [d for i, d in copies if i < last_wait]
    # the first STAGES - 1 tiles' two halves, written once for an A unit and once for a B unit
    assert len(before) == 4 * (stages - 1) and set(before) == weights
    assert any(i > last_wait and d not in weights for i, d in copies)
    atomics = [line for line in lines if "atom.global" in line]
    assert atomics and all(line.startswith("@%p") for line in atomics)
    assert any("atom.global.gpu.release.add" in line for line in atomics)
    assert sum("fence.proxy.async.global" in line for line in lines) >= 2
    assert sum("wgmma.mma_async" in line for line in lines) > 0


def test_the_warp_specialized_dataflow_mlp_compiles_with_a_load_warp_that_streams_weights_before_the_wait() -> None:
    """bench/dataflow_mlp.py's `_mlp_ws_kernel`: warp-specialized (register reallocation between the
    partitions), and the load warp's first weight copies come before its `griddepcontrol.wait`."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from bench import dataflow_mlp

    desc = {name: f"tensordesc<bf16[64, 128],{gl.NVMMASharedLayout.get_default_for([64, 128], gl.bfloat16)!r}>"
            for name in ("wgu_desc", "wd_desc", "x_desc", "h_desc")}
    consts = {"SPLIT": 3, "KSPLIT_A": 1, "STAGES": 4, "UQ": 2, "TILED": True, "USE_PDL": True, "num_warps": 4}
    sig = desc | {"h_ptr": "*bf16", "part_ptr": "*fp32", "apart_ptr": "*fp32", "y_ptr": "*bf16", "cnt_ptr": "*i32",
                  "err_ptr": "*i32", "ulist_ptr": "*i32", "M": "i32", "spin_cap": "i32"}
    sig |= {name: "constexpr" for name in consts}
    src = GluonASTSource(fn=dataflow_mlp._mlp_ws_kernel, signature=sig, constexprs=consts)
    ptx = triton.compile(src, target=HOPPER, options={"num_warps": 4}).asm["ptx"]
    lines = [line.strip() for line in ptx.splitlines()]
    wait = [i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait")]
    copies = [i for i, line in enumerate(lines) if "cp.async.bulk.tensor.2d" in line]
    assert "setmaxnreg" in ptx and len(wait) == 1 and copies[0] < wait[0] < copies[-1]


def test_every_kernel_compiles_for_ada_without_pdl() -> None:
    root = Path(__file__).resolve().parents[2]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, __file__], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.split() == [c[0] for c in CASES]  # one line per kernel that built


if __name__ == "__main__":  # the sm_89 builds, in a process that targets nothing else
    for name, fn, signature, constexprs in CASES:
        ptx = _ptx(fn, signature, constexprs | {"USE_PDL": False}, ADA)
        assert ".entry" in ptx and "griddepcontrol" not in ptx, name
        print(name, flush=True)


def test_fp8_cache_kernels_quantize_by_ieee_division_and_multiply_in_float16() -> None:
    """An FP8 cache: the K/V store rounds row / scale (an IEEE division, as PyTorch's quantize_rows, not the
    approximate div.full) to e4m3 with saturation; the decode kernel widens the codes to float16 pairs and
    multiplies on float16 tensor cores. The bf16 variants of both kernels do neither."""
    qk = {"NUM_HEADS": 32, "NUM_KV": 8, "HEAD_DIM": 128, "HEADS_BLOCK": 1, "BLOCK_SIZE": 16, "USE_PDL": False}
    fp8_store = _opcodes(_ptx(elementwise._qk_norm_rope_store_kernel, QK_SIG | {"k_cache_ptr": "*fp8e4nv",
                                                                                 "v_cache_ptr": "*fp8e4nv"},
                              qk | {"QUANT": True}, HOPPER))
    bf16_store = _opcodes(_ptx(elementwise._qk_norm_rope_store_kernel, QK_SIG, qk | {"QUANT": False}, HOPPER))
    assert fp8_store["cvt.rn.satfinite.e4m3x2.f32"] == 2 and fp8_store["div.rn.f32"] == 2
    assert "cvt.rn.satfinite.e4m3x2.f32" not in bf16_store and "div.rn.f32" not in bf16_store
    decode = {"BLOCK_SIZE": 16, "NUM_KV": 8, "GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "BLOCK_N": 32, "PART": 0,
              "NUM_PARTS": 1, "DOT_PREC": "tf32", "FUSE_ROPE": True, "STORE_ONLY": False, "USE_PDL": False}
    fp8_attn = _opcodes(_ptx(paged_attention._decode_kernel, DECODE_SIG | FP8_KV,
                             decode | {"QUANT": True, "F16_DOT": True}, HOPPER))
    bf16_attn = _opcodes(_ptx(paged_attention._decode_kernel, DECODE_SIG, decode, HOPPER))
    assert fp8_attn["cvt.rn.f16x2.e4m3x2"] > 0 and fp8_attn["mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"] > 0
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" not in fp8_attn
    assert bf16_attn["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"] > 0 and "cvt.rn.f16x2.e4m3x2" not in bf16_attn


def test_fp8_activation_quantization_divides_exactly_and_rounds_to_nearest() -> None:
    """runtime/kernels/fp8_act.py must give the eager ops' bits (runtime/fp8.py): each code's division
    IEEE-rounded (div.rn, not the approximate div.full; the scale is a product by float32(1 / 448)) and the
    codes rounded to nearest by the hardware's e4m3 conversion."""
    ops = _opcodes(_ptx(fp8_act._quantize_rows_kernel, FP8_ACT_SIG, {"K": 4096, "BLOCK": 2048, "USE_PDL": False},
                        HOPPER))
    # 4 warps x 32 threads hold 2048 values: 16 per thread and chunk, 2 chunks
    assert ops["div.rn.f32"] == 32 and "div.full.f32" not in ops and "div.approx.f32" not in ops
    assert ops["cvt.rn.satfinite.e4m3x2.f32"] == 16  # 32 codes per thread, two per conversion
