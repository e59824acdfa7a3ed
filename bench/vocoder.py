"""Vocoder-only benchmark: first-chunk latency, then ms per chunk and real-time factor at several stream counts.

    python bench/vocoder.py --preset full --device cuda --out bench/results/vocoder-h200.json
    python bench/vocoder.py --preset tiny --device cpu --batches 1,8 --threads 1

Variants '<mode>-<dtype>': mode eager | graph (CUDA graphs of the per-chunk encoder, flow solve and
BigVGAN, replayed per fixed chunk shape; see vocoder/graphs.py) | compile (torch.compile of BigVGAN and
the estimator's transformer blocks, dynamic shapes) | graphcompile (both) | fused (the Triton kernels of
vocoder/kernels/: BigVGAN's anti-aliased activation in one kernel; in the estimator chunk attention, LayerNorm +
linear (+ GELU, residual) and channel norm + Mish fused) | graphfused (fused + graphs) | graphpartial (graphs,
the activation and attention kernels only: the fused mode before the estimator's norms and linears were
fused) | graphnopdl (graphfused with the Triton kernels launched without programmatic dependent launch:
the same-run baseline of PDL). Every other mode runs the `bigvgan` package's modules and SDPA. The eager
float32 row of the same run is the baseline (`speedup_vs_eager`).

Rows, in this order (a partial JSON is written after each one with --out):
- kind "first_chunk", one per variant: one stream, open() then the push of the codes the first chunk
  needs (low latency: first scheduled chunk + 3 lookahead codes = 5); median, p10 and p90 (nearest
  rank) over rounds after graphs are captured; `samples` is what that push returned (low: 2 codes
  minus the held-back overlap).
- kind "steady", per batch (ascending) and variant: B sessions, each step pushes the steady chunk size
  to every session and must return exactly chunk * 1920 samples per session. ms_per_chunk is the
  median step wall time (p10 and p90 beside it); rtf = that median / audio per stream per step (< 1:
  all B streams keep up); x_realtime = B / rtf.
Outputs are checked before timing (finite, exact lengths; low latency: push-size independence and the
distance to decode_whole; exact: streamed == decode_whole). Rows predicted to overrun --max-seconds
are skipped and listed in "skipped".
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from bench.engine import Timing
from vocoder import SAMPLES_PER_CODE, StreamingVocoder, VocoderConfig, noise
from vocoder.config import LOOKAHEAD_CODES, MEL_FRAMES_PER_CODE, SAMPLE_RATE
from vocoder.flow_layers import CausalBlock, CausalConv1d, ChunkTransformer
from vocoder.mel_vocoder import effective_context_frames, receptive_field_frames

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODES = ("eager", "graph", "compile", "graphcompile", "fused", "graphfused", "graphpartial", "graphnopdl")


def spread(name: str, samples_ms: list[float]) -> dict[str, float]:
    """Median, p10 and p90 (nearest rank) of wall times in ms, keyed '<name>', '<name>_p10', '<name>_p90'."""
    timing = Timing(samples_ms)
    return {name: round(timing.median_ms, 3), f"{name}_p10": round(timing.p10_ms, 3),
            f"{name}_p90": round(timing.p90_ms, 3)}


class CheckFailed(RuntimeError):
    """An output check failed; the variant is reported with the reason and not timed further."""


def sync(device: str) -> None:
    """Wait for queued GPU work so wall times are real."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build_base(args: argparse.Namespace) -> StreamingVocoder:
    """The float32 eager vocoder with the flags applied; variants copy its weights."""
    cfg = VocoderConfig.preset(args.preset)
    flow = dataclasses.replace(cfg.flow, num_steps=args.euler_steps or cfg.flow.num_steps)
    stream = dataclasses.replace(
        cfg.stream,
        latency=args.latency,
        chunk_schedule_codes=args.schedule,
        overlap_samples=args.overlap_samples,
        chunk_codes=args.chunk_codes,
        first_chunk_codes=args.first_chunk_codes,
        vocoder_left_context_frames=args.context_frames,
        vocoder_right_context_frames=args.right_context_frames
        if args.right_context_frames is not None
        else args.context_frames,
    )
    cfg = dataclasses.replace(cfg, flow=flow, stream=stream)
    return StreamingVocoder.from_preset(
        args.preset, device=args.device, dtype="float32", seed=0, config=cfg, triton_kernels=False
    )


def copy_vocoder(
    base: StreamingVocoder, *, dtype: torch.dtype, triton_kernels: bool, flow_fusion: bool = True,
    pdl: str = "auto", channels_last: bool | None = None, flow_channels_last: bool = True,
    flow_norms: bool = True, flow_attention: bool = True,
) -> StreamingVocoder:
    """A new vocoder with copies of the base's weights, in `dtype`, with or without the Triton kernels;
    flow_fusion False keeps only the activation and chunk attention kernels (the estimator's norms,
    linears and Mish in PyTorch); channels_last as StreamingVocoder's (BigVGAN's data); flow_channels_last
    False keeps the estimator's data channels-first with its plain causal convs in PyTorch, as before the
    estimator went channels-last; flow_norms False keeps PyTorch's LayerNorms and residual adds in the
    estimator's transformers at many rows (`ChunkTransformer.fuse_norms`); flow_attention False keeps their
    few-row attention a kernel of its own after LN1 + QKV (`ChunkTransformer.fuse_attention`)."""
    voc = StreamingVocoder(
        base.config,
        copy.deepcopy(base.flow),
        copy.deepcopy(base.generator),
        base.voices,
        device=base.device,
        dtype=dtype,
        triton_kernels=triton_kernels,
        pdl=pdl,
        channels_last=channels_last,
    )
    plain_convs = not flow_channels_last or not flow_fusion  # the down/up convs in PyTorch, channels-first
    if plain_convs:
        voc.flow.estimator.channels_last = False
    for module in voc.flow.estimator.modules():
        if isinstance(module, ChunkTransformer):
            module.fuse_norms = flow_norms
            module.fuse_attention = flow_attention
            module.fuse_linears = module.fuse_linears and flow_fusion
        elif (type(module) is CausalConv1d and plain_convs) or (isinstance(module, CausalBlock) and not flow_fusion):
            module.use_triton = False  # without flow_fusion: the estimator as before vocoder/kernels/flow_fused.py
    return voc


def build(base: StreamingVocoder, variant: str) -> StreamingVocoder:
    """A vocoder for one variant '<mode>-<dtype>' with the base's weights."""
    mode, dtype = variant.split("-", 1)
    if mode not in MODES or dtype not in DTYPES:
        raise ValueError(f"unknown variant {variant!r}: modes {MODES}, dtypes {sorted(DTYPES)}")
    if variant == "eager-float32":
        return base
    voc = copy_vocoder(
        base,
        dtype=DTYPES[dtype],
        triton_kernels=mode in ("fused", "graphfused", "graphpartial", "graphnopdl"),
        flow_fusion=mode != "graphpartial",
        pdl="off" if mode == "graphnopdl" else "auto",
    )
    if mode in ("compile", "graphcompile"):
        # Tensor-in/tensor-out modules only; the conv-cache bookkeeping stays eager.
        voc.generator.compile(dynamic=True)
        for module in voc.flow.estimator.modules():
            if type(module).__name__ == "ChunkTransformer":
                module.compile(dynamic=True)
    if mode in ("graph", "graphcompile", "graphfused", "graphpartial", "graphnopdl"):
        voc.use_cuda_graphs()
    return voc


def steady_chunk_codes(voc: StreamingVocoder) -> int:
    """Codes per steady-state chunk (and per push in the steady rows)."""
    stream = voc.config.stream
    return stream.chunk_schedule_codes[-1] if voc.is_low_latency else stream.chunk_codes


def first_chunk_codes_needed(voc: StreamingVocoder) -> int:
    """Codes that must be pushed before the first chunk leaves (lookahead + chunk + right context)."""
    stream = voc.config.stream
    first = stream.chunk_schedule_codes[0] if voc.is_low_latency else stream.first_chunk_codes
    return LOOKAHEAD_CODES + -(-(voc.right_context + MEL_FRAMES_PER_CODE * first) // MEL_FRAMES_PER_CODE)


def stream_once(voc: StreamingVocoder, codes: list[int], pushes: list[int], seed: int) -> np.ndarray:
    """PCM of one stream pushed in the given sizes, then finished; checks the exact length."""
    session = voc.open("default", seed=seed)
    parts, i = [], 0
    for n in pushes:
        parts.append(voc.push(session, codes[i : i + n]))
        i += n
    parts.append(voc.finish(session))
    pcm = np.concatenate(parts)
    if len(pcm) != len(codes) * SAMPLES_PER_CODE:
        raise CheckFailed(f"length check failed: {len(pcm)} != {len(codes) * SAMPLES_PER_CODE}")
    if not np.isfinite(pcm).all():
        raise CheckFailed("non-finite PCM")
    return pcm


def verify(voc: StreamingVocoder, reference: np.ndarray | None) -> tuple[dict[str, Any], np.ndarray]:
    """Irregular pushes vs all at once vs decode_whole (and vs the eager float32 stream, if given)."""
    codes = np.random.default_rng(0).integers(0, 16384, 40).tolist()
    whole = voc.decode_whole("default", codes, seed=5)
    irregular = stream_once(voc, codes, [1, 4, 2, 9, 3, 13, 8], seed=5)
    at_once = stream_once(voc, codes, [40], seed=5)
    if len(whole) != len(irregular) or not np.isfinite(whole).all():
        raise CheckFailed("decode_whole length or finiteness check failed")
    out = {
        "max_abs_diff_stream_vs_whole": float(np.abs(irregular - whole).max()),
        "energy_error_stream_vs_whole": float(
            ((irregular - whole) ** 2).sum() / max((whole**2).sum(), 1e-30)
        ),
        "max_abs_diff_push_sizes": float(np.abs(irregular - at_once).max()),
        "pcm_std": float(irregular.std()),
    }
    if reference is not None:
        out["max_abs_diff_vs_eager_float32"] = float(np.abs(irregular - reference).max())
    return out, irregular


def graph_stats(voc: StreamingVocoder) -> tuple[int, int]:
    """(graphs captured, eager calls of graphed functions): unchanged over a step = replay only."""
    stats = voc.graph_stats
    return stats["num_graphs"], stats["num_eager_calls"]


def first_chunk(voc: StreamingVocoder, args: argparse.Namespace) -> dict[str, Any]:
    """One stream: time open() and the push that makes the first chunk (all codes it needs at once)."""
    need = first_chunk_codes_needed(voc)
    codes = np.random.default_rng(1).integers(0, 16384, need).tolist()
    opens, pushes, samples, rounds = [], [], set(), 0
    while len(pushes) < args.first_chunk_rounds and rounds < args.first_chunk_rounds + 8:
        before = graph_stats(voc)
        sync(args.device)
        t0 = time.perf_counter()
        session = voc.open("default", seed=rounds)
        sync(args.device)
        t1 = time.perf_counter()
        pcm = voc.push(session, codes)
        sync(args.device)
        t2 = time.perf_counter()
        voc.close(session)
        if not np.isfinite(pcm).all():
            raise CheckFailed("non-finite PCM in the first chunk")
        samples.add(len(pcm))
        # The first round warms up; with graphs, rounds that captured or ran eagerly are not timed.
        if rounds and graph_stats(voc) == before:
            opens.append(1e3 * (t1 - t0))
            pushes.append(1e3 * (t2 - t1))
        rounds += 1
    if not pushes:
        raise CheckFailed("no first-chunk round ran without capturing or eager fallbacks")
    (num_samples,) = samples
    if num_samples == 0:
        raise CheckFailed(f"no first chunk after {need} codes")
    return {
        "kind": "first_chunk",
        "batch": 1,
        "codes_needed": need,
        "samples": num_samples,
        "audio_ms": round(1e3 * num_samples / SAMPLE_RATE, 1),
        **spread("open_ms", opens),
        **spread("push_ms", pushes),
        "timed_rounds": len(pushes),
    }


def steady_row(voc: StreamingVocoder, args: argparse.Namespace, batch: int) -> dict[str, Any]:
    """B sessions in steady state; wall time of one step (one chunk for every session): median, p10, p90."""
    chunk = steady_chunk_codes(voc)
    rng = np.random.default_rng(batch)
    sessions = voc.open_many([("default", s) for s in range(batch)])
    want = chunk * SAMPLES_PER_CODE
    step_ms: list[float] = []
    num_steady = 0
    for step in range(args.warmup_steps + args.steps + 12):
        work = [(s, rng.integers(0, 16384, chunk).tolist()) for s in sessions]
        before = graph_stats(voc)
        sync(args.device)
        t0 = time.perf_counter()
        pcms = voc.step(work)
        sync(args.device)
        dt = time.perf_counter() - t0
        lengths = {len(p) for p in pcms}
        if lengths == {want}:
            num_steady += 1
            if not all(np.isfinite(p).all() for p in pcms):
                raise CheckFailed("non-finite PCM in steady state")
            if num_steady > args.warmup_steps and graph_stats(voc) == before:
                step_ms.append(1e3 * dt)
                if len(step_ms) == args.steps:
                    break
        elif num_steady:
            raise CheckFailed(f"steady state broke at step {step}: chunk lengths {sorted(lengths)}")
    tails = voc.finish_many(sessions)
    total_codes = (step + 1) * chunk
    for s, tail in zip(sessions, tails):
        if s.num_samples_emitted != total_codes * SAMPLES_PER_CODE or not np.isfinite(tail).all():
            raise CheckFailed(f"session emitted {s.num_samples_emitted} samples for {total_codes} codes")
    if not step_ms:
        raise CheckFailed("no steady step ran without capturing or eager fallbacks")
    times = spread("ms_per_chunk", step_ms)
    rtf = statistics.median(step_ms) / 1e3 / (want / SAMPLE_RATE)
    return {
        "kind": "steady",
        "batch": batch,
        "chunk_codes": chunk,
        **times,
        "rtf": round(rtf, 5),
        "x_realtime": round(batch / rtf, 2),
        "timed_steps": len(step_ms),
    }


def parse_args() -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=["tiny", "full"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", default="1,8,32,64,256")
    p.add_argument("--variants", default=None, help=f"comma list of <{'|'.join(MODES)}>-<dtype>")
    p.add_argument("--dtype", default=None, help="shorthand: eager-float32 baseline plus eager-<dtype>")
    p.add_argument("--latency", default="low", choices=["low", "exact"])
    p.add_argument(
        "--schedule", default="2,3,5,10,25", help="low latency: chunk sizes in codes, last repeats"
    )
    p.add_argument("--overlap-samples", type=int, default=1920, help="low latency: crossfaded samples")
    p.add_argument("--euler-steps", type=int, default=None, help="default: the preset's")
    p.add_argument("--chunk-codes", type=int, default=8, help="exact mode: steady chunk")
    p.add_argument("--first-chunk-codes", type=int, default=2, help="exact mode: first chunk")
    p.add_argument("--context-frames", type=int, default=None, help="BigVGAN context each side")
    p.add_argument("--right-context-frames", type=int, default=None, help="overrides the right side")
    p.add_argument("--steps", type=int, default=5, help="timed steps per steady row")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--first-chunk-rounds", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--max-seconds", type=float, default=330.0, help="skip rows predicted to end later")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here after every row")
    p.add_argument("--cudnn-benchmark", action="store_true",
                   help="torch.backends.cudnn.benchmark = True (cuDNN times its algorithms per conv shape)")
    p.add_argument("--eager-noise", action="store_true",
                   help="make the flow's noise with eager ops instead of one kernel (vocoder.noise.OPTIONS)")
    args = p.parse_args()
    args.schedule = tuple(int(c) for c in args.schedule.split(","))
    return args


def main() -> None:
    """Verify, time, print one JSON line."""
    args = parse_args()
    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    noise.OPTIONS["kernel"] = not args.eager_noise
    on_cuda = args.device.startswith("cuda")
    default_variants = (
        "eager-float32,graph-bfloat16,graphpartial-bfloat16,graphfused-bfloat16,graphfused-float16"
        if on_cuda
        else "eager-float32"
    )
    if args.variants is None and args.dtype is not None:
        args.variants = ",".join(dict.fromkeys(["eager-float32", f"eager-{args.dtype}"]))
    variants = list(dict.fromkeys(["eager-float32", *(args.variants or default_variants).split(",")]))
    batches = sorted(int(b) for b in args.batches.split(","))
    out: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "preset": args.preset,
        "device": torch.cuda.get_device_name() if on_cuda else f"cpu x{torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "tf32": {"cudnn": torch.backends.cudnn.allow_tf32, "matmul": torch.backends.cuda.matmul.allow_tf32},
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "noise_kernel": noise.OPTIONS["kernel"],
        "latency": args.latency,
        "rows": [],
        "verify": {},
        "graph_stats": {},
        "skipped": [],
        "failed": {},
    }

    def save() -> None:
        out["wall_s"] = round(time.perf_counter() - t_start, 1)
        if args.out:
            args.out.write_text(json.dumps(out) + "\n")  # partial results survive a kill

    base = build_base(args)
    out["euler_steps"] = base.config.flow.num_steps
    out["stream_config"] = dataclasses.asdict(base.config.stream)
    out["bigvgan_context_frames"] = [base.left_context, base.right_context]
    out["bigvgan_exact_field_frames"] = list(receptive_field_frames(base.generator))
    out["bigvgan_effective_field_frames_1e-6"] = list(
        effective_context_frames(base.generator, tolerance=1e-6)
    )
    out["first_audio_after_codes"] = first_chunk_codes_needed(base)
    out["steady_chunk_codes"] = steady_chunk_codes(base)

    vocoders: dict[str, StreamingVocoder] = {}
    baseline: dict[tuple[str, int], float] = {}
    reference: np.ndarray | None = None

    def record(variant: str, row: dict[str, Any]) -> None:
        key = "push_ms" if row["kind"] == "first_chunk" else "ms_per_chunk"
        if variant == "eager-float32":
            baseline[(row["kind"], row["batch"])] = row[key]
        elif (row["kind"], row["batch"]) in baseline:
            row["speedup_vs_eager"] = round(baseline[(row["kind"], row["batch"])] / row[key], 3)
        out["rows"].append({"variant": variant, **row})
        out["graph_stats"][variant] = vocoders[variant].graph_stats
        save()

    def fail(variant: str, exc: Exception) -> None:
        if variant == "eager-float32" and not isinstance(exc, CheckFailed):
            raise exc
        out["failed"][variant] = f"{type(exc).__name__}: {exc}"[:800]
        vocoders.pop(variant, None)
        save()

    # Phase 1: per variant, build + verify + the first-chunk row (the latency figure comes first).
    for variant in variants:
        if time.perf_counter() - t_start > args.max_seconds:
            out["skipped"].append(variant)
            continue
        try:
            vocoders[variant] = build(base, variant)
            out["verify"][variant], pcm = verify(vocoders[variant], reference)
            if variant == "eager-float32":
                reference = pcm
            record(variant, first_chunk(vocoders[variant], args))
        except Exception as exc:  # noqa: BLE001 - a compile or capture failure is reported, other variants go on
            fail(variant, exc)
    # Phase 2: steady rows, batch by batch, skipping rows predicted to overrun the budget.
    last_row_s: dict[str, tuple[int, float]] = {}
    for batch in batches:
        for variant in [v for v in variants if v in vocoders]:
            elapsed = time.perf_counter() - t_start
            prev = last_row_s.get(variant)
            predicted = 0.0 if prev is None else prev[1] * batch / prev[0]
            if elapsed + predicted > args.max_seconds:
                out["skipped"].append(f"{variant}@{batch}")
                continue
            t0 = time.perf_counter()
            try:
                record(variant, steady_row(vocoders[variant], args, batch))
            except Exception as exc:  # noqa: BLE001 - reported in "failed"
                fail(variant, exc)
            last_row_s[variant] = (batch, time.perf_counter() - t0)
            if on_cuda:
                torch.cuda.empty_cache()
    save()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
