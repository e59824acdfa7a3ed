"""How much device memory the vocoder replica of a Serve config needs: build it as the vocoder deployment
does (CUDA graphs, warm-up, reserved sessions, both lanes), then drive the largest steps its batcher can
form, and print one JSON line with the allocator's figures after the build and at the peak.

    python bench/vocoder_memory.py --config config/serve-4090.yaml [--keep-cap] [--eager-warmup-rows 4,8]
        [--speech-encoder full] [--out FILE]

Without `--keep-cap` the config's `vocoder_memory_cap_bytes` is not applied, so the figures say what a cap
must allow. The replica's speech encoder (the config's `speech_encoder`, or `--speech-encoder`) is built after
the vocoder as the replica builds it, and encodes a 30 s clip after the steps (`after_speech_input`). Steps: `max_batch_size` streams get their first chunk in fast-lane-sized steps, then rounds of
chunks through the main schedule up to its repeating last chunk, in steps as large as `step_code_budget`
allows (rows padded as the vocoder pads them x the chunk's codes). Each step's wall time is kept (`step_ms`,
the GPU waited for), so a shape's first step, eager or captured, shows beside its later ones. Off CUDA it
runs the same steps with no memory figures (a check of the script).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.pipeline import app_args, settings_from_config, split_vocoder_settings
from runtime.device_memory import memory_stats
from vocoder.config import LOOKAHEAD_CODES
from vocoder.speech_encoder import build_speech_encoder_for_serving
from vocoder.streaming import StreamingVocoder, build_for_serving


def rows_within(voc: StreamingVocoder, budget: int, codes: int, most: int) -> int:
    """The most streams one step of `codes`-code chunks takes within `budget` padded code rows (at least 1)."""
    rows = 1
    while rows < most and voc.bucket_rows(rows + 1) * codes <= budget:
        rows += 1
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--keep-cap", action="store_true", help="apply vocoder_memory_cap_bytes as the replica does")
    parser.add_argument("--eager-warmup-rows", default=None,
                        help="comma list: override the config's vocoder_eager_warmup_rows (empty string: none)")
    parser.add_argument("--speech-encoder", default=None, help="override the config's speech_encoder")
    parser.add_argument("--out")
    args = parser.parse_args()
    _, vocoder_kwargs = settings_from_config(args.config)
    encoder_spec = args.speech_encoder or app_args(args.config).get("speech_encoder", "tiny")
    if args.eager_warmup_rows is not None:
        vocoder_kwargs["eager_warmup_rows"] = [int(r) for r in args.eager_warmup_rows.split(",") if r.strip()]
    max_batch, batcher = split_vocoder_settings(vocoder_kwargs)
    cap = vocoder_kwargs.pop("memory_cap_bytes", None)
    if args.keep_cap:
        vocoder_kwargs["memory_cap_bytes"] = cap
    started = time.perf_counter()
    voc, warm = build_for_serving(**vocoder_kwargs)
    built = {"seconds": round(time.perf_counter() - started, 1), "warm_up": warm, **(memory_stats(voc.device) or {})}
    started = time.perf_counter()
    encoder = build_speech_encoder_for_serving(encoder_spec, vocoder_kwargs)
    encoder_built = {"spec": encoder_spec, "seconds": round(time.perf_counter() - started, 1),
                     **(memory_stats(voc.device) or {})}
    rng = np.random.default_rng(0)
    lane = 1 if batcher.get("fast_lane_code_budget") else 0  # sessions open and first chunks run there
    budget = batcher.get("step_code_budget", 256)  # (VocoderBatcher's default)
    sessions = [voc.open("default", seed=i, lane=lane) for i in range(max_batch)]
    steps = samples = 0
    on_cuda = voc.device.type == "cuda"
    timings: list[dict[str, float]] = []  # every step's wall time, the GPU waited for (a first shape's shows)

    def step_all(codes: int, rows: int, lane: int = 0) -> None:
        """Every session one chunk of `codes` new codes, `rows` sessions per step; PCM checked finite."""
        nonlocal steps, samples
        for i in range(0, max_batch, rows):
            batch = sessions[i : i + rows]
            t0 = time.perf_counter()
            pcm = voc.step([(s, rng.integers(0, 16384, codes).tolist()) for s in batch], max_chunks=1, lane=lane)
            if on_cuda:
                torch.cuda.synchronize()
            timings.append({"rows": len(batch), "codes": codes, "lane": lane,
                            "ms": round((time.perf_counter() - t0) * 1000, 2)})
            assert all(np.isfinite(p).all() for p in pcm)
            steps, samples = steps + 1, samples + sum(len(p) for p in pcm)

    paced = sessions[-1]  # on the main schedule (with a light-load schedule only the first one opened is not)
    first = voc.next_chunk_codes(paced, 10**6) + LOOKAHEAD_CODES  # a first chunk's codes and lookahead
    step_all(first, rows_within(voc, batcher.get("fast_lane_code_budget") or budget, first, max_batch), lane)
    chunk_codes: list[int] = []
    while not chunk_codes or chunk_codes[-1] != voc.next_chunk_codes(paced, 10**6):  # to the repeating one
        codes = voc.next_chunk_codes(paced, 10**6)
        chunk_codes.append(codes)
        step_all(codes, rows_within(voc, budget, codes, max_batch))
    clip = (rng.standard_normal(30 * 16000) * 0.1).astype(np.float32)
    assert len(encoder.encode(clip)) == encoder.config.num_codes(clip.size)
    if on_cuda:
        torch.cuda.synchronize()
    result = {"command": " ".join(["python", *sys.argv]), "config": args.config, "cap_applied": args.keep_cap,
              "config_cap_bytes": cap, "streams": max_batch, "first_chunk_codes": first,
              "main_chunk_codes": chunk_codes, "steps": steps, "pcm_samples": samples,
              "device": torch.cuda.get_device_name(voc.device) if on_cuda else str(voc.device), "after_build": built,
              "after_speech_encoder": encoder_built, "after_steps_and_speech_input": memory_stats(voc.device),
              "graph_stats": voc.graph_stats, "step_ms": timings}
    line = json.dumps(result)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")


if __name__ == "__main__":
    main()
