"""The sampler's GPU time after a decode step, old and new candidate selection, in one process.

    python bench/sampler_bench.py --device cuda --rows 1,8,64,128,256 --out bench/results/sampler-h200.json

In the engine the sampler's kernels are launched while the decode graph runs, so they execute back to back
after it: what lengthens a step is their GPU time, not their launch time. Each timing here therefore queues
the sampler's kernels behind a ~20 ms `torch.cuda._sleep` and measures, with CUDA events, from the end of
the sleep to the end of the sampler (median of `--reps`). Per row count and variant:
- `select`: `_sample_tokens` on audio logits [S, 16512] (upstream audio defaults: temperature 0.6, top-k 20,
  top-p 0.95), then its ids, checked equal across variants before any timing;
- `step`: a whole `sample_next_rows` of audio-mode requests (masks, repetition penalty over a 512-row
  prompt history, the draw), with fresh samplers per call, up to the end of the host's work after reading
  the ids (what a decode step waits for before the next one is prepared);
- `text`: `_sample_tokens` on text logits [S, 151680] (text mode rows).
Variants: `before` (one `torch.topk` per row, candidates ordered by two sorts), `chunked` (two-round top-k),
`key` (one 64-bit key sort), `after` (both: the defaults). Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from runtime import sampling
from runtime.config import AUDIO_PAD_ID, SOSP_ID
from runtime.sampling import RequestSampler, SamplingParams, sample_next_rows

AUDIO_VOCAB, TEXT_VOCAB = 16512, 151680
VARIANTS = {"before": (0, False), "chunked": (sampling.TOPK_CHUNK, False), "key": (0, True),
            "after": (sampling.TOPK_CHUNK, True)}
SLEEP_CYCLES = 40_000_000  # ~20 ms at H200 clocks: the host queues every launch before the GPU gets there


def set_variant(name: str) -> None:
    sampling.TOPK_CHUNK, sampling.ORDER_BY_KEY = VARIANTS[name]


def gpu_ms(fn, device: torch.device, reps: int, setup=None) -> float:
    """Median time from the end of a sleep to the end of `fn(setup())`, whose kernels were queued behind
    the sleep (so they run back to back), in ms. `setup` runs before the sleep, untimed."""
    samples = []
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        arg = setup() if setup is not None else None
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        fn(arg)
        end.record()
        torch.cuda.synchronize(device)
        samples.append(start.elapsed_time(end))
    return statistics.median(samples[1:])


def measure(num_rows: int, device: torch.device, reps: int) -> dict:
    """One row count: the variants' ids checked equal, then each variant's three timings."""
    audio_params = SamplingParams()  # upstream defaults: 0.6 / top-p 0.95 / top-k 20 / penalty 1.1
    prompt = [(1000 + i, AUDIO_PAD_ID) for i in range(511)] + [(SOSP_ID, AUDIO_PAD_ID)]  # ends in audio mode
    gen = torch.Generator(device=device).manual_seed(num_rows)
    audio = torch.randn(num_rows, AUDIO_VOCAB, device=device, generator=gen).mul_(3).bfloat16()
    text = torch.randn(num_rows, TEXT_VOCAB, device=device, generator=gen).mul_(3).bfloat16()
    uniforms = torch.rand(num_rows, device=device, generator=gen)
    params = [audio_params] * num_rows
    row: dict = {"rows": num_rows, "select_ms": {}, "step_ms": {}, "text_ms": {}, "equal": {}}
    reference = None
    for name in VARIANTS:
        set_variant(name)
        ids, ties = sampling._sample_tokens(audio.float(), params, uniforms)
        text_ids, _ = sampling._sample_tokens(text.float(), params, uniforms)
        got = (ids.tolist(), ties.tolist(), text_ids.tolist())
        reference = reference or got
        row["equal"][name] = got == reference
    if not all(row["equal"].values()):
        raise SystemExit(f"variants disagree at {num_rows} rows: {row['equal']}")

    def samplers() -> list[RequestSampler]:
        return [RequestSampler(prompt, SamplingParams(), audio_params, min_new_tokens=0, seed=i)
                for i in range(num_rows)]

    for name in VARIANTS:
        set_variant(name)
        row["select_ms"][name] = gpu_ms(lambda _: sampling._sample_tokens(audio.float(), params, uniforms),
                                        device, reps)
        row["text_ms"][name] = gpu_ms(lambda _: sampling._sample_tokens(text.float(), params, uniforms),
                                      device, reps)
        row["step_ms"][name] = gpu_ms(lambda batch: sample_next_rows(None, audio, batch), device, reps,
                                      setup=samplers)
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", default="1,8,64,128,256")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    out = {"benchmark": "sampler_bench", "command": shlex.join([Path(sys.executable).name, *sys.argv])
           if argv is None else shlex.join(argv), "device_name": torch.cuda.get_device_name(device),
           "torch": torch.__version__, "sleep_cycles": SLEEP_CYCLES, "rows": []}
    for num_rows in [int(r) for r in args.rows.split(",")]:
        row = measure(num_rows, device, args.reps)
        out["rows"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    set_variant("after")
    line = json.dumps(out)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")
    return out


if __name__ == "__main__":
    main()
