"""Where the vocoder's time goes on a GPU: encoder / flow / BigVGAN / host per step, and kernel families.

    python bench/vocoder_profile.py --preset full --device cuda --out bench/results/vocoder-profile-h200.json

For each variant ("package": BigVGAN activations of the `bigvgan` package and SDPA in the estimator;
"fused": the Triton kernels of vocoder/kernels/ and BigVGAN's data channels-last (the default on CUDA);
"fusedncw": the same with BigVGAN's data channels-first, as before; "flowbase": "fused" with the flow
estimator's data channels-first and PyTorch's norms in its transformers at many rows, as before;
"flownorms": "flowbase" with those norms as kernels; "attn5": "fused" with the few-row transformers'
attention in a kernel of its own after LN1 + QKV, as before; "partial": only the activation and chunk
attention kernels, as "fused" was before the estimator's norms and linears were fused; same weights, bf16 by
default, CUDA graphs on; `--variants` picks them) it times with synchronised wall clocks:
- the first chunk of one stream (open, then the 5-code push), split into encoder, flow solve, BigVGAN and
  the rest (host work: windows, crossfade, copies);
- steady steps of B streams pushing 25 codes each, same split.
Before timing, the fused activation kernels are checked against the package's `Activation1d` on the GPU
(float32 and bf16, short and long rows), the chunk attention kernel against SDPA, and the fused vocoder's
PCM against the package one's on the same codes.
Then one eager steady step per --profile-batches is profiled with torch.profiler and kernels are summed by
family (and counted); `top_ops` names the PyTorch ops (with input shapes and the Python line that called
them) that own the most device time. `--host-batches` profiles one graphed steady step per batch with
cProfile: the Python functions where the host's share of a step goes.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import functools
import io
import json
import pstats
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

import bench.vocoder as bench_vocoder
from bench.fast_tools import overridden
from vocoder import SAMPLES_PER_CODE, StreamingVocoder
from vocoder.aa_activation import FusedActivation1d, _snake_params

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sync() -> None:
    bench_vocoder.sync("cuda" if torch.cuda.is_available() else "cpu")


class Split:
    """Wraps the vocoder's three per-chunk tensor functions with synchronised timers."""

    NAMES = ("encoder", "flow", "bigvgan")

    def __init__(self, voc: StreamingVocoder):
        self.ms: dict[str, float] = defaultdict(float)
        lane = voc._lanes[0]  # the lane a plain `step` runs on
        for name, attr in zip(self.NAMES, ("encode", "flow_step", "generate")):
            setattr(lane, attr, self._timed(name, getattr(lane, attr)))

    def _timed(self, name: str, fn: Any) -> Any:
        def call(*args: torch.Tensor) -> Any:
            sync()
            t0 = time.perf_counter()
            out = fn(*args)
            sync()
            self.ms[name] += 1e3 * (time.perf_counter() - t0)
            return out

        return call

    def take(self) -> dict[str, float]:
        out = dict(self.ms)
        self.ms.clear()
        return out


def check_activation(device: str) -> dict[str, float]:
    """Max abs difference fused vs package Activation1d (float32 and bf16 inputs) over several shapes."""
    from bigvgan.activations import Snake, SnakeBeta
    from bigvgan.alias_free_activation.torch.act import Activation1d

    torch.manual_seed(0)
    worst: dict[str, float] = {}
    for cls in (SnakeBeta, Snake):
        for channels, length in [(3, 1), (2, 2), (5, 3), (7, 9), (64, 255), (24, 4097)]:
            ref_mod = Activation1d(cls(channels, alpha_logscale=True)).to(device)
            with torch.no_grad():
                for p in ref_mod.act.parameters():
                    p.normal_(0, 0.5)
            fused = copy.deepcopy(ref_mod)
            fused.__class__ = FusedActivation1d
            alpha, beta, log_scale = _snake_params(fused.act)
            for dtype in (torch.float32, torch.bfloat16) if device.startswith("cuda") else (torch.float32,):
                x = torch.randn(3, channels, length, device=device).to(dtype)
                with torch.no_grad():
                    ref = ref_mod.float()(x.float())
                    got = {"gather": fused(x).float()}
                    if device.startswith("cuda") and channels > 1:  # the channels-last kernel
                        x_nwc = x.transpose(1, 2).contiguous().transpose(1, 2)
                        y_nwc = fused(x_nwc)
                        assert y_nwc.stride() == x_nwc.stride()
                        got["nwc"] = y_nwc.float()
                    if device.startswith("cuda"):
                        from vocoder.kernels.aa_snake import aa_snake

                        got["direct"] = aa_snake(
                            x,
                            alpha,
                            beta,
                            fused.upsample.filter,
                            fused.downsample.lowpass.filter,
                            log_scale=log_scale,
                            direct=True,
                        ).float()
                for kind, out in got.items():
                    assert out.shape == ref.shape and torch.isfinite(out).all()
                    key = f"{kind}-{cls.__name__}-{str(dtype).removeprefix('torch.')}"
                    worst[key] = max(worst.get(key, 0.0), float((out - ref).abs().max()))
    return worst


def check_attention(device: str) -> dict[str, float]:
    """Max abs difference of the chunk attention kernel vs SDPA per chunk (bf16 and float32)."""
    if not device.startswith("cuda"):
        return {}
    from vocoder.kernels.chunk_attention import chunk_attention

    torch.manual_seed(1)
    worst: dict[str, float] = {}
    for heads, dim, chunk, rows in [(8, 64, 4, 4), (8, 64, 4, 4 * 1000 + 4), (2, 32, 4, 64), (8, 64, 8, 72)]:
        for dtype in (torch.float32, torch.bfloat16):
            qkv = torch.randn(rows, 3 * heads * dim, device=device, dtype=dtype)
            got = chunk_attention(qkv, heads, dim, chunk).float()
            q, k, v = (
                z.float().reshape(rows // chunk, chunk, heads, dim).transpose(1, 2)
                for z in qkv.chunk(3, dim=-1)
            )
            ref = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(rows, -1)
            assert torch.isfinite(got).all()
            key = f"h{heads}d{dim}c{chunk}-{str(dtype).removeprefix('torch.')}"
            worst[key] = float((got - ref).abs().max())
    return worst


def check_flow_fusion(device: str) -> dict[str, float]:
    """Max abs difference of the fused estimator blocks (vocoder/kernels/flow_fused.py) vs their PyTorch
    forward on the same weights and inputs: a transformer block and a causal block with a time bias."""
    if not device.startswith("cuda"):
        return {}
    from vocoder.flow_layers import CausalBlock, CausalConv1d, CausalResnetBlock, ChunkTransformer, ConvCache
    from vocoder.layout import is_channels_last

    torch.manual_seed(2)
    worst: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        block = ChunkTransformer(256, 8, 64, 4, 4).to(device, dtype)
        causal = CausalBlock(256, 256).to(device, dtype)
        conv = CausalConv1d(256, 256, 3).to(device, dtype)
        resnet = CausalResnetBlock(320, 256, 1024).to(device, dtype)  # the estimator's first (down) resnet
        block.fused_max_rows = 1 << 30  # the fused path at every row count checked
        for module in (block, causal, conv, resnet):
            for param in module.parameters():  # LayerNorm weights away from their 1 / 0 init
                param.data.normal_(0.0, 0.1 if param.dim() == 1 else 0.06)
        for rows, frames in ((2, 20), (1, 4), (128, 100)):
            x = torch.randn(rows, frames, 256, device=device, dtype=dtype)
            add = torch.randn(rows, 256, device=device, dtype=dtype)
            got, ref = {}, {}
            conv_in = x.transpose(1, 2).contiguous()
            history = torch.randn(rows, 256, 2, device=device, dtype=dtype)
            valid = torch.randint(1, frames + 1, (rows,), device=device)
            res_in = torch.randn(rows, frames, 320, device=device, dtype=dtype).transpose(1, 2)  # channels-last
            time_bias = torch.randn(rows, 256, device=device, dtype=dtype)
            res_history = torch.randn(rows, 320, 2, device=device, dtype=dtype)
            for fused, out in ((True, got), (False, ref)):
                block.use_triton = causal.use_triton = causal.conv.use_triton = conv.use_triton = fused
                for sub in (resnet.block1, resnet.block2, resnet.block1.conv, resnet.block2.conv):
                    sub.use_triton = fused
                # a resnet (block2 + the 1x1 residual in its kernels), channels-last and channels-first
                cache = ConvCache([res_history, history], valid)
                out["resnet_channels_last"] = resnet(res_in, time_bias, cache).float()
                out["resnet_cache_update"] = torch.cat([u.float().flatten() for u in cache.updated])
                out["resnet"] = resnet(res_in.contiguous(), time_bias, ConvCache()).float()
                out["transformer"] = block(x).float()
                block.fused_max_rows = 0  # the many-row path: cuBLAS linears, norm kernels
                out["transformer_rows"] = block(x).float()
                block.fused_max_rows = 1 << 30
                out["causal_block"] = causal(conv_in, ConvCache(), add=add).float()
                out["causal_block_shared_bias"] = causal(conv_in, ConvCache(), add=add[:1].expand(rows, -1)).float()
                cache = ConvCache([history], valid)
                out["causal_block_streaming"] = causal(conv_in, cache, add=add).float()
                out["causal_block_cache_update"] = cache.updated[0].float()
                # channels-last input (the estimator's layout on CUDA): the output keeps it
                cache = ConvCache([history, history], valid)
                y = causal(x.transpose(1, 2), cache, add=add)
                assert not fused or is_channels_last(y), y.stride()
                out["causal_block_channels_last"] = y.float()
                y = conv(x.transpose(1, 2), cache)
                assert not fused or is_channels_last(y), y.stride()
                out["causal_conv_channels_last"] = y.float()
                out["causal_conv_cache_update"] = cache.updated[1].float()
            for name, value in got.items():
                assert value.shape == ref[name].shape and torch.isfinite(value).all(), name
                key = f"{name}-{str(dtype).removeprefix('torch.')}"
                worst[key] = max(worst.get(key, 0.0), float((value - ref[name]).abs().max()))
                worst[f"{key}-ref_max_abs"] = max(worst.get(f"{key}-ref_max_abs", 0.0), float(ref[name].abs().max()))
    return worst


def time_flow_blocks(device: str, dtype: torch.dtype, rows_list: list[int]) -> dict[str, Any]:
    """Microseconds per call of one estimator transformer block and one causal block (with a time bias),
    fused kernels vs PyTorch (+ the chunk attention kernel), 200 calls captured in one CUDA graph
    (`bench.fast_tools.graph_us_per_call`: median replay / 200), by rows (= batch rows x frames): where the
    fused path pays."""
    if not device.startswith("cuda"):
        return {}
    from bench.fast_tools import graph_us_per_call
    from vocoder.flow_layers import CausalBlock, ChunkTransformer, ConvCache
    from vocoder.kernels import flow_fused

    torch.manual_seed(3)
    block = ChunkTransformer(256, 8, 64, 4, 4).to(device, dtype)
    causal = CausalBlock(256, 256).to(device, dtype)
    block.use_triton, block.fused_max_rows = True, 1 << 30
    out: dict[str, Any] = {}
    for rows in rows_list:
        x = torch.randn(1, rows, 256, device=device, dtype=dtype)
        xc = x.transpose(1, 2).contiguous()
        add = torch.randn(1, 256, device=device, dtype=dtype)
        row: dict[str, float] = {}
        for fused in (True, False):
            block.fuse_linears = causal.use_triton = fused
            calls = (
                ("transformer", functools.partial(block, x)),
                ("causal_block", lambda x=xc, add=add: causal(x, ConvCache(), add)),
            )
            for name, fn in calls:
                row[f"{name}_{'fused' if fused else 'torch'}_us"] = round(graph_us_per_call([fn] * 200), 2)
        block.fuse_linears = True
        for bn in (16, 64):  # output columns per program of the few-row linears (default 32)
            with overridden(flow_fused.LINEAR_OPTIONS, small_bn=bn):
                row[f"transformer_fused_bn{bn}_us"] = round(graph_us_per_call([functools.partial(block, x)] * 200), 2)
        block.fuse_linears, block.fuse_attention = True, False  # 5 kernels: LN1 + QKV, then the attention kernel
        row["transformer_fused5_us"] = round(graph_us_per_call([functools.partial(block, x)] * 200), 2)
        block.fuse_attention = True
        # the many-row transformer path (norm kernels, cuBLAS linears) and the causal block on channels-last data
        block.fuse_linears, block.fused_max_rows, causal.use_triton = True, 0, True
        row["transformer_rows_us"] = round(graph_us_per_call([functools.partial(block, x)] * 200), 2)
        xt = x.transpose(1, 2)  # [1, 256, rows] stored channels-last
        row["causal_block_channels_last_us"] = round(
            graph_us_per_call([lambda x=xt, add=add: causal(x, ConvCache(), add)] * 200), 2)
        default_bk = flow_fused.CONV_BK
        for bk in (64, 128):  # input channels per step of the conv kernel
            flow_fused.CONV_BK = bk
            row[f"causal_block_channels_last_bk{bk}_us"] = round(
                graph_us_per_call([lambda x=xt, add=add: causal(x, ConvCache(), add)] * 200), 2)
        flow_fused.CONV_BK = default_bk
        block.fused_max_rows = 1 << 30
        row.update(time_resnet_split(device, dtype, rows))
        out[str(rows)] = row
    return out


SPLIT_VARIANTS = ((16, 128, 4), (16, 256, 4), (16, 64, 4), (32, 128, 4), (16, 128, 8))  # bco, bk, warps


def time_resnet_split(device: str, dtype: torch.dtype, frames: int) -> dict[str, float]:
    """One CausalResnetBlock(256, 256) over 2 rows (a stream's two guidance branches) x `frames`, channels-last,
    with caches, in a CUDA graph of 100 calls: PyTorch, the whole-channel conv kernel (+ the residual's matmul
    and add), and the channel-split kernels with the residual fused (flow_fused.SPLIT_OPTIONS) in each of
    SPLIT_VARIANTS when the split applies at this size."""
    from bench.fast_tools import graph_us_per_call
    from vocoder.flow_layers import CausalResnetBlock, ConvCache
    from vocoder.kernels import flow_fused

    torch.manual_seed(4)
    resnet = CausalResnetBlock(256, 256, 1024).to(device, dtype)
    x = torch.randn(2, frames, 256, device=device, dtype=dtype).transpose(1, 2)
    bias = torch.randn(2, 256, device=device, dtype=dtype)
    caches = [torch.randn(2, 256, 2, device=device, dtype=dtype) for _ in range(2)]
    valid = torch.full((2,), frames, device=device)

    def timed(fused: bool) -> float:
        for sub in (resnet.block1, resnet.block2, resnet.block1.conv, resnet.block2.conv):
            sub.use_triton = fused
        return round(graph_us_per_call([lambda: resnet(x, bias, ConvCache(caches, valid))] * 100), 2)

    row = {"resnet2_torch_us": timed(False)}
    with overridden(flow_fused.SPLIT_OPTIONS, below=0):
        row["resnet2_whole_us"] = timed(True)
    with overridden(flow_fused.SPLIT_OPTIONS, below=1 << 30):  # the split at any size (it stops at "below")
        row["resnet2_split_any_us"] = timed(True)
    if flow_fused._split_slices(2 * -(-frames // 16), 256) > 1:  # 2 rows x 16-frame tiles
        for bco, bk, warps in SPLIT_VARIANTS:
            with overridden(flow_fused.SPLIT_OPTIONS, bco=bco, bk=bk, warps=warps):
                row[f"resnet2_split_bco{bco}_bk{bk}_w{warps}_us"] = timed(True)
    return row


@contextlib.contextmanager
def split_options(variant: str) -> Iterator[None]:
    """Variant "nosplit": the estimator's causal convs always run as the whole-channel kernel (+ the residual's
    matmul and add), as before the channel split (flow_fused.SPLIT_OPTIONS), for a same-process A/B."""
    if variant != "nosplit":
        yield
        return
    from vocoder.kernels import flow_fused

    with overridden(flow_fused.SPLIT_OPTIONS, below=0):
        yield


def first_chunk(voc: StreamingVocoder, split: Split, rounds: int) -> dict[str, Any]:
    codes = np.random.default_rng(1).integers(0, 16384, 5).tolist()
    rows = []
    for r in range(rounds + 3):
        session = voc.open("default", seed=r)
        split.take()
        sync()
        t0 = time.perf_counter()
        pcm = voc.push(session, codes)
        sync()
        total = 1e3 * (time.perf_counter() - t0)
        voc.close(session)
        parts = split.take()
        assert len(pcm) == 2 * SAMPLES_PER_CODE - voc.overlap_samples and np.isfinite(pcm).all()
        if r >= 3:  # graphs captured by then
            rows.append({"total": total, **parts})
    return summarize(rows)


def steady(voc: StreamingVocoder, split: Split, batch: int, steps: int) -> dict[str, Any]:
    rng = np.random.default_rng(2)
    sessions = voc.open_many([("default", i) for i in range(batch)])
    chunk = 25
    # Walk the schedule 2, 3, 5, 10 (and lookahead) so the timed pushes are steady 25-code chunks.
    for n in (5, 3, 5, 10):
        voc.step([(s, rng.integers(0, 16384, n).tolist()) for s in sessions])
    rows = []
    for i in range(steps + 3):
        work = [(s, rng.integers(0, 16384, chunk).tolist()) for s in sessions]
        split.take()
        sync()
        t0 = time.perf_counter()
        out = voc.step(work)
        sync()
        total = 1e3 * (time.perf_counter() - t0)
        parts = split.take()
        assert all(len(p) == chunk * SAMPLES_PER_CODE and np.isfinite(p).all() for p in out)
        if i >= 3:
            rows.append({"total": total, **parts})
    for s in sessions:
        voc.close(s)
    res = summarize(rows)
    audio_s = batch * chunk * SAMPLES_PER_CODE / 24000
    res["aggregate_rtf"] = round(res["total_ms"] / 1e3 / audio_s, 5)
    for name in Split.NAMES:
        res[f"{name}_rtf"] = round(res[f"{name}_ms"] / 1e3 / audio_s, 5)
    return res


def summarize(rows: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {"timed": len(rows)}
    for key in ("total", *Split.NAMES):
        out[f"{key}_ms"] = round(statistics.median(r.get(key, 0.0) for r in rows), 3)
    out["host_ms"] = round(out["total_ms"] - sum(out[f"{n}_ms"] for n in Split.NAMES), 3)
    return out


def family(name: str) -> str:
    n = name.lower()
    for key, fam in (
        ("aa_snake", "fused_activation"),
        ("conv_transpose", "depthwise/transposed conv"),
        ("dgrad", "depthwise/transposed conv"),
        ("depthwise", "depthwise/transposed conv"),
        ("flash", "attention"),
        ("fmha", "attention"),
        ("attention", "attention"),
        ("conv", "conv"),
        ("cudnn", "conv"),
        ("gemm", "gemm"),
        ("gemv", "gemm"),
        ("nvjet", "gemm"),
        ("cutlass", "gemm"),
        ("sm90", "gemm"),
        ("layer_norm", "norm"),
        ("sin", "elementwise"),
        ("elementwise", "elementwise"),
        ("reduce", "reduce"),
        ("copy", "copy/cat"),
        ("cat", "copy/cat"),
        ("pad", "copy/cat"),
        ("gather", "copy/cat"),
    ):
        if key in n:
            return fam
    return "other"


def profile_step(voc: StreamingVocoder, batch: int) -> dict[str, Any]:
    """Kernel time by family over one eager steady step (graphs off so kernels are visible)."""
    lane = voc._lanes[0]
    lane.encode, lane.flow_step, lane.generate = voc.flow.encoder, voc._solve_from_pool, voc.generator
    rng = np.random.default_rng(3)
    sessions = voc.open_many([("default", i) for i in range(batch)])
    for n in (5, 3, 5, 10, 25):
        voc.step([(s, rng.integers(0, 16384, n).tolist()) for s in sessions])
    work = [(s, rng.integers(0, 16384, 25).tolist()) for s in sessions]
    from torch.profiler import ProfilerActivity, profile, record_function

    sync()
    with profile(
        activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], record_shapes=True, with_stack=True
    ) as prof:
        with record_function("step"):
            voc.step(work)
        sync()
    for s in sessions:
        voc.close(s)
    fams: dict[str, float] = defaultdict(float)
    kernels: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            us = evt.device_time if hasattr(evt, "device_time") else evt.cuda_time
            fams[family(evt.name)] += us / 1e3
            kernels[evt.name[:90]] += us / 1e3
            counts[evt.name[:90]] += 1
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return {
        "batch": batch,
        "kernels": sum(counts.values()),
        "kernel_ms_by_family": {k: round(v, 2) for k, v in sorted(fams.items(), key=lambda kv: -kv[1])},
        "kernel_ms_total": round(sum(fams.values()), 2),
        "top_kernels": [{"name": k, "ms": round(v, 2), "calls": counts[k]} for k, v in top],
        "top_ops": top_ops(prof, 25),
    }


def top_ops(prof: Any, n: int) -> list[dict[str, Any]]:
    """The `n` (op, input shapes, calling line) groups with the most self device time in `prof`."""
    rows = []
    for evt in prof.key_averages(group_by_input_shape=True, group_by_stack_n=6):
        if evt.device_type != torch.autograd.DeviceType.CPU:  # kernels are in top_kernels
            continue
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = evt.self_cuda_time_total
        if us > 0:
            stack = [f for f in evt.stack if "vocoder" in f or "bench" in f][:3]
            rows.append({"op": evt.key, "shapes": str(evt.input_shapes)[:160], "calls": evt.count,
                         "self_device_ms": round(us / 1e3, 3), "called_from": stack})
    return sorted(rows, key=lambda r: -r["self_device_ms"])[:n]


def host_profile(voc: StreamingVocoder, batch: int, n: int = 30) -> dict[str, Any]:
    """cProfile of one graphed steady step of `batch` streams (25-code chunks): its `n` costliest Python
    functions by own time, next to the step's wall time (the GPU work inside counts where it is waited on)."""
    rng = np.random.default_rng(4)
    sessions = voc.open_many([("default", i) for i in range(batch)])
    for n_codes in (5, 3, 5, 10, 25, 25, 25):  # to the steady chunk, its graphs captured
        voc.step([(s, rng.integers(0, 16384, n_codes).tolist()) for s in sessions])
    work = [(s, rng.integers(0, 16384, 25).tolist()) for s in sessions]
    sync()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    voc.step(work)
    sync()
    prof.disable()
    wall = 1e3 * (time.perf_counter() - t0)
    for s in sessions:
        voc.close(s)
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (path, line, func), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(path).name}:{line}:{func}", "calls": calls,
                     "own_ms": round(1e3 * tottime, 3), "cumulative_ms": round(1e3 * cumtime, 3)})
    rows.sort(key=lambda r: -r["own_ms"])
    return {"batch": batch, "wall_ms_profiled": round(wall, 3), "top_functions": rows[:n]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile-batches", default="1,64")
    ap.add_argument("--host-batches", default="", help="cProfile one graphed steady step per batch")
    ap.add_argument("--block-rows", default="8,40,80,160,320,640,1280,2560,5120,12800")
    ap.add_argument("--blocks-only", action="store_true", help="stop after the checks and block timings")
    ap.add_argument("--variants", default="fused,partial",
                    help="comma list of fused (channels-last BigVGAN and estimator), fusedncw (fused, BigVGAN "
                         "channels-first), flowbase, flownorms, attn5 (see above), partial; the package's modules always run for the PCM check")
    ap.add_argument("--skip-package", action="store_true", help="do not time or profile the package's modules")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = False
    result: dict[str, Any] = {
        "command": "python " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }

    def save() -> None:
        print(json.dumps(result), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))

    result["activation_check_max_abs"] = check_activation(args.device)
    result["attention_check_max_abs"] = check_attention(args.device)
    result["flow_fusion_check_max_abs"] = check_flow_fusion(args.device)
    result["flow_block_us"] = time_flow_blocks(
        args.device, DTYPES[args.dtype], [int(r) for r in args.block_rows.split(",")]
    )
    save()
    if args.blocks_only:
        return
    base = StreamingVocoder.from_preset(
        args.preset, device=args.device, dtype=args.dtype, seed=0, triton_kernels=False
    )
    on_cuda = args.device.startswith("cuda")
    builders = {
        "fused": lambda: bench_vocoder.copy_vocoder(base, dtype=base.dtype, triton_kernels=on_cuda),
        "fusedncw": lambda: bench_vocoder.copy_vocoder(base, dtype=base.dtype, triton_kernels=on_cuda,
                                                       channels_last=False),
        "partial": lambda: bench_vocoder.copy_vocoder(base, dtype=base.dtype, triton_kernels=on_cuda,
                                                      flow_fusion=False),
        "flowbase": lambda: bench_vocoder.copy_vocoder(base, dtype=base.dtype, triton_kernels=on_cuda,
                                                       flow_channels_last=False, flow_norms=False),
        "flownorms": lambda: bench_vocoder.copy_vocoder(base, dtype=base.dtype, triton_kernels=on_cuda,
                                                        flow_channels_last=False),
        "attn5": lambda: bench_vocoder.copy_vocoder(base, dtype=base.dtype, triton_kernels=on_cuda,
                                                    flow_attention=False),
        "nosplit": lambda: bench_vocoder.copy_vocoder(base, dtype=base.dtype, triton_kernels=on_cuda),
        "package": lambda: base,
    }
    names = list(dict.fromkeys([*args.variants.split(","), "package"]))
    variants = tuple((name, builders[name]()) for name in names)
    fused = dict(variants).get("fused")
    if fused is not None:
        result["fused_activations"] = sum(isinstance(m, FusedActivation1d) for m in fused.generator.modules())
    codes = np.random.default_rng(0).integers(0, 16384, 40).tolist()
    pcm = {}
    for name, voc in variants:
        s = voc.open("default", seed=5)
        with split_options(name):
            pcm[name] = np.concatenate([voc.push(s, codes[:17]), voc.push(s, codes[17:]), voc.finish(s)])
        assert len(pcm[name]) == 40 * SAMPLES_PER_CODE and np.isfinite(pcm[name]).all()
    for name in [n for n in names if n != "package"]:
        result[f"pcm_{name}_vs_package"] = {
            "max_abs": float(np.abs(pcm[name] - pcm["package"]).max()),
            "pcm_std": float(pcm["package"].std()),
        }
    save()
    batches = [int(b) for b in args.batches.split(",")]
    for name, voc in variants:
        if name == "package" and args.skip_package:
            continue
        voc.use_cuda_graphs()
        lane = voc._lanes[0]
        graphed = (lane.encode, lane.flow_step, lane.generate)
        split = Split(voc)
        with split_options(name):  # graphs are captured on the second use of a shape: inside
            row: dict[str, Any] = {"first_chunk": first_chunk(voc, split, args.rounds)}
            result.setdefault("variants", {})[name] = row
            save()
            for b in batches:
                row[f"steady_{b}"] = steady(voc, split, b, args.steps)
                save()
        lane.encode, lane.flow_step, lane.generate = graphed  # without the split's synchronising timers
        for b in (int(x) for x in args.host_batches.split(",") if x):
            result.setdefault("host_profile", {}).setdefault(name, {})[f"batch_{b}"] = host_profile(voc, b)
            save()
    for name, voc in variants:
        if name == "package" and args.skip_package:
            continue
        for b in (int(x) for x in args.profile_batches.split(",") if x):
            result.setdefault("profile", {}).setdefault(name, {})[f"batch_{b}"] = profile_step(voc, b)
            save()


if __name__ == "__main__":
    main()
