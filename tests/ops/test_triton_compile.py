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

from runtime.kernels import elementwise, fp8_gemv, gemv, paged_attention
from vocoder.kernels import aa_snake, chunk_attention, flow_fused

HOPPER, ADA = GPUTarget("cuda", 90, 32), GPUTarget("cuda", 89, 32)


def _ptx(fn, signature: dict[str, str], constexprs: dict, target: GPUTarget, aligned: tuple[str, ...] = ()) -> str:
    """PTX of `fn`; `aligned` names the arguments to declare divisible by 16, as Triton's launcher does at run
    time for 16-byte aligned pointers and sizes (without it, loads are not vectorized)."""
    sig = dict(signature) | {name: "constexpr" for name in constexprs}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                          target=target).asm["ptx"]


def _ptrs(names: str, ty: str = "*bf16") -> dict[str, str]:
    return {name: ty for name in names.split()}


GEMV_SIG = _ptrs("x_ptr res_ptr nw_ptr res_out_ptr") | {"w_ptr": "*bf16", "s_ptr": "*fp32", "out_ptr": "*bf16",
                                                      "N": "i32", "K": "i32", "eps": "fp32"}
LIN_SIG = _ptrs("x_ptr w_ptr b_ptr g_ptr beta_ptr r_ptr y_ptr") | {"M": "i32", "N": "i32", "K": "i32", "eps": "fp32"}
CONV_SIG = _ptrs("x_ptr cache_ptr w_ptr cb_ptr g_ptr beta_ptr add_ptr") | {
    "valid_ptr": "*i32", "y_ptr": "*bf16", "upd_ptr": "*bf16", "CI": "i32", "CO": "i32", "T": "i32",
    "add_stride": "i32", "eps": "fp32"}
SNAKE_SIG = _ptrs("x_ptr y_ptr alpha_ptr beta_ptr") | {"hu_ptr": "*fp32", "hd_ptr": "*fp32", "C": "i32", "T": "i32"}

# (name, kernel, signature, constexprs without USE_PDL): the shapes and flags the launch sites use
CASES = [
    *[(f"gemv[{w[1:]}{',bits' if bits else ''}{',prefetch' if pre else ''}{',early' if early else ''},prologue={p}]", gemv._gemv_kernel,
       GEMV_SIG | {"w_ptr": w},
       {"PROLOGUE": p, "HAS_RES": p == gemv.RMSNORM, "HAS_SCALE": w == "*fp8e4nv", "BLOCK_N": 8, "BLOCK_K": 512,
        "PREFETCH": pre, "FP8_BITS": bits, "EARLY": early, "FOLD": early})
      for w, bits, pre, early in (("*bf16", False, False, False), ("*bf16", False, True, False),
                                  ("*bf16", False, False, True), ("*fp8e4nv", False, False, False),
                                  ("*fp8e4nv", False, True, False), ("*fp8e4nv", True, False, False),
                                  ("*fp8e4nv", False, False, True))
      for p in (gemv.NONE, gemv.RMSNORM, gemv.SILU_MUL)],
    ("add_rmsnorm", elementwise._add_rmsnorm_kernel, _ptrs("x_ptr res_ptr w_ptr out_ptr res_out_ptr")
     | {"n_cols": "i32", "eps": "fp32"}, {"HAS_RES": True, "BLOCK": 4096}),
    ("qk_norm_rope_store", elementwise._qk_norm_rope_store_kernel,
     _ptrs("qkv_ptr qw_ptr kw_ptr cos_ptr sin_ptr q_out_ptr k_cache_ptr v_cache_ptr")
     | {"pos_ptr": "*i64", "slot_ptr": "*i64", "eps": "fp32"},
     {"NUM_HEADS": 32, "NUM_KV": 8, "HEAD_DIM": 128, "HEADS_BLOCK": 1}),
    ("silu_mul", elementwise._silu_mul_kernel, _ptrs("gu_ptr out_ptr") | {"inter": "i32"}, {"BLOCK": 1024}),
    ("decode_attention", paged_attention._decode_kernel, _ptrs("q_ptr k_ptr v_ptr out_ptr")
     | _ptrs("part_acc_ptr part_ml_ptr", "*fp32") | {"tables_ptr": "*i32", "seq_lens_ptr": "*i32", "scale": "fp32",
                                                     "max_blocks": "i32"},
     {"BLOCK_SIZE": 16, "NUM_KV": 8, "GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "BLOCK_N": 64, "PART": 64,
      "NUM_PARTS": 16, "DOT_PREC": "tf32"}),
    ("decode_merge", paged_attention._decode_reduce_kernel, _ptrs("part_acc_ptr part_ml_ptr", "*fp32")
     | {"out_ptr": "*bf16"}, {"NUM_PARTS": 16, "HEAD_DIM": 128}),
    ("fp8_gemv_rows", fp8_gemv._fp8_gemv_kernel.fn, {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                                                      "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32"},
     {"BLOCK_N": 32, "BLOCK_K": 256}),
    ("flow_fused_linear", flow_fused._fused_linear_kernel, LIN_SIG,
     {"HAS_LN": True, "HAS_BIAS": True, "ACT": 1, "HAS_RES": True, "IEEE": False, "BM": 16, "BN": 32, "BK": 256}),
    ("flow_causal_conv_norm_mish", flow_fused._causal_conv_norm_mish_kernel, CONV_SIG,
     {"HAS_CACHE": True, "HAS_ADD": True, "HAS_UPDATE": True, "IEEE": False, "CTX": 2, "BCO": 256, "BT": 16,
      "BK": 32}),
    ("chunk_attention", chunk_attention._chunk_attention_kernel, {"qkv_ptr": "*bf16", "out_ptr": "*bf16",
                                                                  "M": "i32", "scale": "fp32"},
     {"H": 8, "D": 64, "CHUNK": 4, "ROWS": 64}),
    ("aa_snake", aa_snake._aa_snake_kernel, SNAKE_SIG, {"LOG_SCALE": True, "HAS_BETA": True, "BLOCK": 256}),
    ("aa_snake_gather", aa_snake._aa_snake_gather_kernel, SNAKE_SIG,
     {"LOG_SCALE": True, "HAS_BETA": True, "BLOCK": 256}),
]


@pytest.mark.parametrize(("fn", "signature", "constexprs"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_kernel_compiles_for_hopper_with_and_without_pdl(fn, signature: dict, constexprs: dict) -> None:
    with_pdl = _ptx(fn, signature, constexprs | {"USE_PDL": True}, HOPPER)
    assert "griddepcontrol.wait" in with_pdl and "griddepcontrol.launch_dependents" in with_pdl
    plain = _ptx(fn, signature, constexprs | {"USE_PDL": False}, HOPPER)
    assert ".entry" in plain and "griddepcontrol" not in plain


def _opcodes(ptx: str) -> dict[str, int]:
    """How often each PTX opcode occurs (predicated instructions included)."""
    counts: dict[str, int] = {}
    for op in re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)", ptx, re.MULTILINE):
        counts[op] = counts.get(op, 0) + 1
    return counts


@pytest.mark.parametrize("prologue", [gemv.NONE, gemv.RMSNORM, gemv.SILU_MUL])
def test_fp8_gemv_bits_mode_unpacks_weights_without_the_conversion_unit(prologue: int) -> None:
    """One tile of 8 x 512 FP8 weights over 128 threads is 32 bytes per thread: two 16-byte loads. "cvt"
    widens them with 16 `cvt.rn.f16x2.e4m3x2` and 32 `cvt.f32.f16`; "bits" with integer shifts and masks
    only (`_e4m3_bits_to_f32`: 3 per byte but 2 for the top one), then the same 32 FMAs."""
    constexprs = {"PROLOGUE": prologue, "HAS_RES": prologue == gemv.RMSNORM, "HAS_SCALE": True, "BLOCK_N": 8,
                  "BLOCK_K": 512, "PREFETCH": False, "EARLY": False, "FOLD": False, "USE_PDL": False}
    aligned = ("x_ptr", "res_ptr", "nw_ptr", "res_out_ptr", "w_ptr", "s_ptr", "out_ptr", "N", "K")
    sig = GEMV_SIG | {"w_ptr": "*fp8e4nv"}
    cvt = _opcodes(_ptx(gemv._gemv_kernel, sig, constexprs | {"FP8_BITS": False}, HOPPER, aligned))
    bits = _opcodes(_ptx(gemv._gemv_kernel, sig, constexprs | {"FP8_BITS": True}, HOPPER, aligned))
    assert cvt["ld.global.v4.b32"] == bits["ld.global.v4.b32"] == 2
    assert (cvt.get("cvt.rn.f16x2.e4m3x2"), cvt.get("cvt.f32.f16")) == (16, 32)
    assert "cvt.rn.f16x2.e4m3x2" not in bits and "cvt.f32.f16" not in bits
    assert bits["shr.s32"] == 32 and bits["shl.b32"] >= 24
    assert bits["fma.rn.f32"] == cvt["fma.rn.f32"] >= 32


@pytest.mark.parametrize(("weight", "loads_per_tile"), [("*bf16", 4), ("*fp8e4nv", 2)])
def test_gemv_prefetch_keeps_a_second_weight_tile_in_flight(weight: str, loads_per_tile: int) -> None:
    """8 x 512 weights over 128 threads are 4 (bf16) or 2 (FP8) 16-byte loads per thread. With prefetch the
    first tile is loaded before the loop and each iteration loads the next one before its math."""
    constexprs = {"PROLOGUE": gemv.NONE, "HAS_RES": False, "HAS_SCALE": weight == "*fp8e4nv", "BLOCK_N": 8,
                  "BLOCK_K": 512, "FP8_BITS": False, "EARLY": False, "FOLD": False, "USE_PDL": False}
    aligned = ("x_ptr", "res_ptr", "nw_ptr", "res_out_ptr", "w_ptr", "s_ptr", "out_ptr", "N", "K")
    sig = GEMV_SIG | {"w_ptr": weight}
    plain = _ptx(gemv._gemv_kernel, sig, constexprs | {"PREFETCH": False}, HOPPER, aligned)
    ahead = _ptx(gemv._gemv_kernel, sig, constexprs | {"PREFETCH": True}, HOPPER, aligned)
    assert _opcodes(plain)["ld.global.v4.b32"] == loads_per_tile
    assert _opcodes(ahead)["ld.global.v4.b32"] == 2 * loads_per_tile
    before_loop = ahead.split("Inner Loop Header")[0]
    assert _opcodes(before_loop)["ld.global.v4.b32"] == loads_per_tile


@pytest.mark.parametrize("weight", ["*bf16", "*fp8e4nv"])
def test_gemv_early_option_loads_the_first_weight_tile_before_waiting_on_the_previous_kernel(weight: str) -> None:
    constexprs = {"PROLOGUE": gemv.RMSNORM, "HAS_RES": True, "HAS_SCALE": weight == "*fp8e4nv", "BLOCK_N": 8,
                  "BLOCK_K": 512, "FP8_BITS": False, "PREFETCH": False, "FOLD": False, "USE_PDL": True}
    aligned = ("x_ptr", "res_ptr", "nw_ptr", "res_out_ptr", "w_ptr", "s_ptr", "out_ptr", "N", "K")
    sig = GEMV_SIG | {"w_ptr": weight}
    for early, loads_before_wait in ((False, 0), (True, 4 if weight == "*bf16" else 2)):
        ptx = _ptx(gemv._gemv_kernel, sig, constexprs | {"EARLY": early}, HOPPER, aligned)
        before_wait, _, after_wait = ptx.partition("griddepcontrol.wait")
        assert _opcodes(before_wait).get("ld.global.v4.b32", 0) == loads_before_wait
        assert "ld.global" in after_wait


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
