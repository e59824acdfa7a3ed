"""Vocoder-only benchmark: ms per chunk and real-time factor at several stream counts, one JSON line.

    python bench/vocoder.py --preset tiny --device cpu --batches 1,8 --threads 1
    python bench/vocoder.py --preset full --device cuda            # eager fp32 baseline + bf16/fp16/compile rows

Each row: B sessions in steady state, each step pushes `--chunk-codes` codes to every session and must
return exactly chunk_codes * 1920 samples per session. rtf = step wall time / audio per stream per step
(< 1: all B streams keep up with real time); x_realtime = B / rtf. Outputs are checked before timing
(finite, exact lengths, streamed == decode_whole for one stream). `speedup_vs_eager` compares with the
eager float32 row of the same batch measured in this run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import copy
import dataclasses

import numpy as np
import torch

from vocoder import SAMPLES_PER_CODE, StreamingVocoder, VocoderConfig
from vocoder.config import LOOKAHEAD_CODES, MEL_FRAMES_PER_CODE, SAMPLE_RATE
from vocoder.mel_vocoder import effective_context_frames, receptive_field_frames


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
        chunk_codes=args.chunk_codes,
        first_chunk_codes=args.first_chunk_codes,
        vocoder_left_context_frames=args.context_frames,
        vocoder_right_context_frames=args.context_frames,
    )
    cfg = dataclasses.replace(cfg, flow=flow, stream=stream)
    return StreamingVocoder.from_preset(args.preset, device=args.device, dtype="float32", seed=0, config=cfg)


def build(base: StreamingVocoder, variant: str) -> StreamingVocoder:
    """A vocoder for one variant '<eager|compile>-<dtype>' with the base's weights."""
    mode, dtype = variant.split("-", 1)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    if mode == "eager" and torch_dtype == torch.float32:
        return base
    voc = StreamingVocoder(
        base.config,
        copy.deepcopy(base.flow),
        copy.deepcopy(base.generator),
        base.voices,
        device=base.device,
        dtype=torch_dtype,
    )
    if mode == "compile":
        # Tensor-in/tensor-out modules only; the conv-cache bookkeeping stays eager.
        voc.generator.compile(dynamic=True)
        for module in voc.flow.estimator.modules():
            if type(module).__name__ == "ChunkTransformer":
                module.compile(dynamic=True)
    elif mode != "eager":
        raise ValueError(f"unknown variant {variant!r}")
    return voc


def verify(voc: StreamingVocoder, args: argparse.Namespace) -> dict[str, Any]:
    """Stream one utterance by irregular pushes; check length, finiteness and agreement with decode_whole."""
    codes = np.random.default_rng(0).integers(0, 16384, 40).tolist()
    ref = voc.decode_whole("default", codes, seed=5)
    session = voc.open("default", seed=5)
    parts, i = [], 0
    for n in [1, 4, 2, 9, 3, 13, 8]:
        parts.append(voc.push(session, codes[i : i + n]))
        i += n
    parts.append(voc.finish(session))
    pcm = np.concatenate(parts)
    if len(pcm) != len(codes) * SAMPLES_PER_CODE or len(ref) != len(pcm):
        raise CheckFailed(f"length check failed: {len(pcm)} / {len(ref)} != {len(codes) * SAMPLES_PER_CODE}")
    if not (np.isfinite(pcm).all() and np.isfinite(ref).all()):
        raise CheckFailed("non-finite PCM")
    return {"max_abs_diff_stream_vs_whole": float(np.abs(pcm - ref).max()), "pcm_std": float(pcm.std())}


def first_chunk(voc: StreamingVocoder, args: argparse.Namespace, repeats: int = 5) -> dict[str, Any]:
    """One stream: time open() and the push that makes the first chunk (all codes it needs at once)."""
    need = LOOKAHEAD_CODES + -(
        -(voc.right_context + MEL_FRAMES_PER_CODE * args.first_chunk_codes) // MEL_FRAMES_PER_CODE
    )
    codes = np.random.default_rng(1).integers(0, 16384, need).tolist()
    opens, pushes, samples = [], [], 0
    for r in range(repeats + 1):
        sync(args.device)
        t0 = time.perf_counter()
        session = voc.open("default", seed=r)
        sync(args.device)
        t1 = time.perf_counter()
        pcm = voc.push(session, codes)
        sync(args.device)
        t2 = time.perf_counter()
        voc.close(session)
        samples = len(pcm)
        if r:  # first round warms up
            opens.append(1e3 * (t1 - t0))
            pushes.append(1e3 * (t2 - t1))
    if samples < args.first_chunk_codes * SAMPLES_PER_CODE:
        raise CheckFailed(f"first chunk too short: {samples} samples")
    return {
        "codes_needed": need,
        "samples": samples,
        "open_ms": round(statistics.median(opens), 3),
        "push_ms": round(statistics.median(pushes), 3),
    }


def steady_rows(voc: StreamingVocoder, args: argparse.Namespace, batch: int) -> dict[str, Any]:
    """B sessions in steady state; median wall time of one step (one chunk for every session)."""
    chunk = args.chunk_codes
    rng = np.random.default_rng(batch)
    sessions = voc.open_many([("default", s) for s in range(batch)])
    want = chunk * SAMPLES_PER_CODE
    step_ms: list[float] = []
    emitted_any = False
    for step in range(args.warmup_steps + args.steps + 64):
        work = [(s, rng.integers(0, 16384, chunk).tolist()) for s in sessions]
        sync(args.device)
        t0 = time.perf_counter()
        pcms = voc.step(work)
        sync(args.device)
        dt = time.perf_counter() - t0
        lengths = {len(p) for p in pcms}
        if lengths == {want}:
            if not emitted_any:
                emitted_any, first_steady = True, step
            if step >= first_steady + args.warmup_steps:
                if not all(np.isfinite(p).all() for p in pcms):
                    raise CheckFailed("non-finite PCM in steady state")
                step_ms.append(1e3 * dt)
                if len(step_ms) == args.steps:
                    break
        elif emitted_any:
            raise CheckFailed(f"steady state broke at step {step}: chunk lengths {sorted(lengths)}")
    tails = voc.finish_many(sessions)
    total_codes = (step + 1) * chunk
    for s, tail in zip(sessions, tails):
        if s.num_samples_emitted != total_codes * SAMPLES_PER_CODE or not np.isfinite(tail).all():
            raise CheckFailed(f"session emitted {s.num_samples_emitted} samples for {total_codes} codes")
    ms = statistics.median(step_ms)
    chunk_s = want / SAMPLE_RATE
    rtf = ms / 1e3 / chunk_s
    return {
        "batch": batch,
        "ms_per_chunk": round(ms, 3),
        "rtf": round(rtf, 5),
        "x_realtime": round(batch / rtf, 2),
    }


def main() -> None:
    """Parse flags, verify, time, print one JSON line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=["tiny", "full"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", default="1,8,32,64,256")
    p.add_argument(
        "--variants", default=None, help="comma list of <eager|compile>-<float32|bfloat16|float16>"
    )
    p.add_argument("--dtype", default=None, help="shorthand: eager-float32 baseline plus eager-<dtype>")
    p.add_argument("--euler-steps", type=int, default=None, help="default: the preset's")
    p.add_argument("--chunk-codes", type=int, default=8)
    p.add_argument("--first-chunk-codes", type=int, default=2)
    p.add_argument(
        "--context-frames", type=int, default=None, help="BigVGAN context each side (default: exact field)"
    )
    p.add_argument("--steps", type=int, default=5, help="timed steps per row")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--max-seconds", type=float, default=420.0, help="skip remaining rows after this")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here after every row")
    args = p.parse_args()
    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    on_cuda = args.device.startswith("cuda")
    default_variants = (
        "eager-float32,eager-bfloat16,eager-float16,compile-bfloat16" if on_cuda else "eager-float32"
    )
    if args.variants is None and args.dtype is not None:
        args.variants = ",".join(dict.fromkeys(["eager-float32", f"eager-{args.dtype}"]))
    variants = (args.variants or default_variants).split(",")
    batches = [int(b) for b in args.batches.split(",")]
    out: dict[str, Any] = {
        "command": sys.argv,
        "preset": args.preset,
        "device": torch.cuda.get_device_name() if on_cuda else f"cpu x{torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "tf32": {"cudnn": torch.backends.cudnn.allow_tf32, "matmul": torch.backends.cuda.matmul.allow_tf32},
        "chunk_codes": args.chunk_codes,
        "first_chunk_codes": args.first_chunk_codes,
        "rows": [],
        "first_chunk": {},
        "verify": {},
        "skipped": [],
        "failed": {},
    }
    eager_ms: dict[int, float] = {}
    base = build_base(args)
    out["euler_steps"] = base.config.flow.num_steps
    out["bigvgan_context_frames"] = [base.left_context, base.right_context]
    out["bigvgan_exact_field_frames"] = list(receptive_field_frames(base.generator))
    out["bigvgan_effective_field_frames_1e-6"] = list(
        effective_context_frames(base.generator, tolerance=1e-6)
    )
    out["first_audio_after_codes"] = LOOKAHEAD_CODES + -(
        -(base.right_context + MEL_FRAMES_PER_CODE * args.first_chunk_codes) // MEL_FRAMES_PER_CODE
    )
    for variant in variants:
        if time.perf_counter() - t_start > args.max_seconds:
            out["skipped"].append(variant)
            continue
        voc = build(base, variant)
        try:
            out["verify"][variant] = verify(voc, args)
            out["first_chunk"][variant] = first_chunk(voc, args)
            for batch in batches:
                if time.perf_counter() - t_start > args.max_seconds:
                    out["skipped"].append(f"{variant}@{batch}")
                    continue
                row = {"variant": variant, **steady_rows(voc, args, batch)}
                if variant == "eager-float32":
                    eager_ms[batch] = row["ms_per_chunk"]
                elif batch in eager_ms:
                    row["speedup_vs_eager"] = round(eager_ms[batch] / row["ms_per_chunk"], 3)
                out["rows"].append(row)
                if args.out:
                    args.out.write_text(json.dumps(out) + "\n")  # partial results survive a kill
        except CheckFailed as exc:
            out["failed"][variant] = str(exc)
        except Exception as exc:  # e.g. a compile failure: report it, keep the other variants' rows
            if variant == "eager-float32":
                raise
            out["failed"][variant] = f"{type(exc).__name__}: {exc}"[:800]
        del voc
        if on_cuda:
            torch.cuda.empty_cache()
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    if args.out:
        args.out.write_text(json.dumps(out) + "\n")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
