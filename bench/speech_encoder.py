"""Speech input cost: the Whisper-VQ speech encoder (vocoder/speech_encoder.py) on clips of several lengths.

    python bench/speech_encoder.py --preset full --device cuda --dtype bfloat16 \
        --out bench/results/speech-encoder-h200.json
    python bench/speech_encoder.py --preset tiny --device cpu --seconds 1,5 --reps 5

What the vocoder replica runs per request with speech input: `SpeechEncoder.encode(clip)` (16 kHz float32 on
the host -> codes as a Python list, so the host copy and the read-back are included), timed by the wall
clock. For each clip length:
- checks first: exactly `num_codes(len)` codes, each in 0..16383; with `--check-float32` the codes of a
  float32 copy of the same weights, and the fraction of them the timed dtype reproduces;
- `encode` p50 / p90 / p99 (ms), its real-time factor (encode time / clip duration), and the front end
  (log-mel) alone;
- the baseline in the same run: eager (every kernel launched from Python) against the serving path's CUDA
  graphs (one per frame bucket, `SpeechEncoder.use_cuda_graphs`, on CUDA), and the same weights in float32
  eager (`--no-baseline` skips it), with the fraction of codes each reproduces;
- the roofline in the same run: the clip's matmul FLOPs (2 x parameters used per frame x frames, plus
  attention's 4 x frames^2 x width per layer) against the bf16 matmul rate measured now (an 8192^3 product).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from bench.engine import nearest_rank
from vocoder.speech_encoder import INPUT_SAMPLE_RATE, MEL_HOP, SpeechEncoder, log_mel, speech_encoder_for


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="full", help="tiny, full or a checkpoint folder")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seconds", default="1,2,5,10,30", help="clip lengths, comma separated")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-baseline", action="store_true", help="skip the float32 baseline")
    parser.add_argument("--profile", type=float, default=None,
                        help="also profile one encode of a clip this many seconds long (torch.profiler table)")
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_ms(fn, device: torch.device, warmup: int, reps: int) -> dict[str, float]:
    """p50 / p90 / p99 (nearest rank) of `reps` wall-clock calls after `warmup`, synchronised around each."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    ordered = sorted(samples)
    return {f"p{round(q * 100)}_ms": round(nearest_rank(ordered, q), 3) for q in (0.5, 0.9, 0.99)} | {"reps": reps}


def matmul_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The dense matmul rate on this device now (an 8192^3 product), or None on the CPU."""
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=dtype)
    b = torch.randn(8192, 8192, device=device, dtype=dtype)
    ms = wall_ms(lambda: a @ b, device, 3, 20)["p50_ms"]
    return 2 * 8192**3 / (ms / 1e3) / 1e12


def clip_flops(model: SpeechEncoder, num_samples: int) -> float:
    """Matmul FLOPs of one clip (segments of 30 s counted one by one)."""
    cfg = model.config
    total = 0.0
    for start in range(0, num_samples, cfg.segment_samples):
        mel_frames = min(cfg.segment_samples, num_samples - start) // MEL_HOP
        frames = (mel_frames + 1) // 2
        per_frame = (cfg.d_model * cfg.num_mel_bins * 3 / 2 + cfg.d_model**2 * 3  # the two convolutions
                     + cfg.num_layers * (4 * cfg.d_model**2 + 2 * cfg.d_model * cfg.ffn_dim))
        attention = cfg.num_layers * 4 * frames * frames * cfg.d_model
        codes = -(-frames // cfg.pooling_kernel_size)
        total += 2 * per_frame * frames + attention + 2 * codes * cfg.codebook_size * cfg.d_model
    return total


def profile_table(model: SpeechEncoder, num_samples: int, device: torch.device) -> str:
    """torch.profiler's table (top 25 ops by self CPU time, with their device time) of one encode."""
    from torch.profiler import ProfilerActivity, profile

    clip = (np.random.default_rng(1).standard_normal(num_samples) * 0.1).astype(np.float32)
    for _ in range(3):
        model.encode(clip)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        model.encode(clip)
        sync(device)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = torch.device(args.device)
    model = speech_encoder_for(args.preset, device=device, dtype=args.dtype)
    graphed = None
    if device.type == "cuda":
        graphed = speech_encoder_for(args.preset, device=device, dtype=args.dtype)
        graphed.use_cuda_graphs()
        started = time.perf_counter()
        num_graphs = graphed.warm_up()
        warm_up_s = time.perf_counter() - started
    baseline = None
    if not args.no_baseline and args.dtype != "float32":
        baseline = speech_encoder_for(args.preset, device=device, dtype="float32")
    rate = matmul_tflops(device, model.codebook.weight.dtype)
    result: dict = {"bench": "speech_encoder", "command": shlex.join(["python", "bench/speech_encoder.py", *argv]),
                    "device": str(device), "device_name": torch.cuda.get_device_name(device)
                    if device.type == "cuda" else "cpu", "torch": torch.__version__, "preset": args.preset,
                    "dtype": args.dtype, "parameters": sum(p.numel() for p in model.parameters()),
                    "matmul_tflops": None if rate is None else round(rate, 1), "clips": []}
    if graphed is not None:
        result["graphs"] = {"captured": num_graphs, "warm_up_s": round(warm_up_s, 2)}
    rng = np.random.default_rng(0)
    for seconds in [float(s) for s in args.seconds.split(",")]:
        n = int(seconds * INPUT_SAMPLE_RATE)
        clip = (rng.standard_normal(n) * 0.1).astype(np.float32)
        codes = model.encode(clip)
        assert len(codes) == model.config.num_codes(n), (len(codes), model.config.num_codes(n))
        assert all(0 <= code < 16384 for code in codes)
        # "encode": the serving path (CUDA graphs on CUDA); "eager_encode": every kernel launched from Python
        entry: dict = {"seconds": seconds, "num_codes": len(codes)}
        eager = wall_ms(lambda c=clip: model.encode(c), device, args.warmup, args.reps)
        if graphed is not None:
            graphed_codes = graphed.encode(clip)
            assert len(graphed_codes) == len(codes)
            entry["graphed_codes_equal_eager"] = round(sum(a == b for a, b in zip(graphed_codes, codes, strict=True))
                                                       / len(codes), 4)
            entry["encode"] = wall_ms(lambda c=clip: graphed.encode(c), device, args.warmup, args.reps)
            entry["eager_encode"] = eager
        else:
            entry["encode"] = eager
        audio = torch.from_numpy(clip[:model.config.segment_samples]).to(device)
        entry["log_mel"] = wall_ms(lambda a=audio: log_mel(a, model.mel_filters), device, args.warmup, args.reps)
        entry["real_time_factor"] = round(entry["encode"]["p50_ms"] / 1e3 / seconds, 5)
        flops = clip_flops(model, n)
        entry["gflop"] = round(flops / 1e9, 2)
        entry["tflops_achieved"] = round(flops / (entry["encode"]["p50_ms"] / 1e3) / 1e12, 2)
        if rate is not None:
            entry["roofline_ms"] = round(flops / (rate * 1e12) * 1e3, 3)
        if baseline is not None:
            reference = baseline.encode(clip)
            entry["eager_codes_equal_float32"] = round(sum(a == b for a, b in zip(codes, reference, strict=True))
                                                 / len(codes), 4)
            entry["float32_eager_encode"] = wall_ms(lambda c=clip: baseline.encode(c), device, args.warmup, args.reps)
        result["clips"].append(entry)
        print(json.dumps(entry), file=sys.stderr, flush=True)
    if args.profile is not None:
        result["profile"] = profile_table(model, int(args.profile * INPUT_SAMPLE_RATE), device)
        print(result["profile"], file=sys.stderr)
    print(json.dumps(result))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
