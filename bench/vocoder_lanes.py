"""A stream's first chunk while a large vocoder step is in flight: wait for it, or run beside it on a lane.

    python bench/vocoder_lanes.py --preset full --device cuda --out bench/results/vocoder-lanes-h200/lanes.json
    python bench/vocoder_lanes.py --preset tiny --device cpu --background-rows 2 --samples 4   # smoke

One process, the vocoder alone (`build_for_serving` as the deployment builds it: CUDA graphs, bucketed
shapes, the serving chunk schedule). A background thread runs lane 0's steps back to back: `rows` streams,
each step one 25-code chunk per stream (a deadline-batcher step at budget rows x 25). A foreground thread
repeatedly takes a newcomer with the codes of its first chunk (first chunk + lookahead) and times its
step from the moment the codes are there to its PCM:
- "lane0": on lane 0, i.e. after the background step in flight, as with one worker;
- "same_priority": on a lane of its own at the background's stream priority;
- "high_priority": on a lane of its own at stream priority -1, above the background's (`add_lane(-1)`).
The newcomer's session is opened first on the lane it steps on (not timed: a request opens its session
at arrival, long before its first codes). Reported per mode: the newcomer's time p50/p90/p99 and the
background steps' time p50 and audio seconds per wall second while the newcomers ran, against both alone.
Checked first: every newcomer's PCM has the first chunk's length, finite values, and equals lane 0's for
the same codes and seed.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from bench.measure import percentiles
from vocoder import SAMPLES_PER_CODE
from vocoder.config import LOOKAHEAD_CODES
from vocoder.streaming import StreamingVocoder, build_for_serving

STEADY_CODES = 25  # the schedule's last chunk: what a playing stream's steps carry


def codes_for(n: int, offset: int = 0) -> list[int]:
    return [(7919 * (i + offset) + 13) % 16384 for i in range(n)]


class Background:
    """`rows` streams stepped back to back on lane 0, one 25-code chunk each per step."""

    def __init__(self, voc: StreamingVocoder, rows: int) -> None:
        self.voc = voc
        self.sessions = [voc.open("default", seed=100 + i) for i in range(rows)]
        schedule = voc.config.stream.chunk_schedule_codes
        self.pushed = 0
        # the schedule's first chunks, so that every timed step is a steady one
        self._push(sum(schedule) + LOOKAHEAD_CODES)
        while any(voc.next_chunk_codes(s) for s in self.sessions):
            voc.step([(s, []) for s in self.sessions], max_chunks=1)
        self.step_s: list[float] = []
        self.audio_s = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _push(self, n: int) -> list[np.ndarray]:
        codes = codes_for(n, self.pushed)
        self.pushed += n
        return self.voc.step([(s, codes) for s in self.sessions], max_chunks=1)

    def one_step(self) -> None:
        t0 = time.perf_counter()
        pcm = self._push(STEADY_CODES)
        self.step_s.append(time.perf_counter() - t0)
        assert all(len(p) == STEADY_CODES * SAMPLES_PER_CODE and np.isfinite(p).all() for p in pcm)
        self.audio_s += sum(len(p) for p in pcm) / 24000

    def start(self) -> None:
        self.step_s, self.audio_s, self._stop = [], 0.0, threading.Event()
        self._t0 = time.perf_counter()

        def loop() -> None:
            while not self._stop.is_set():
                self.one_step()

        self._thread = threading.Thread(target=loop, name="background")
        self._thread.start()

    def stop(self) -> dict[str, Any]:
        assert self._thread is not None
        self._stop.set()
        self._thread.join()
        wall = time.perf_counter() - self._t0
        return {"steps": len(self.step_s), "step_ms": percentiles([1000 * s for s in self.step_s]),
                "audio_s_per_wall_s": round(self.audio_s / wall, 2)}


def newcomer(voc: StreamingVocoder, lane: int, first_codes: list[int]) -> tuple[float, np.ndarray]:
    session = voc.open("default", seed=7, lane=lane)
    try:
        t0 = time.perf_counter()
        pcm = voc.step([(session, first_codes)], max_chunks=1, lane=lane)[0]
        return time.perf_counter() - t0, pcm
    finally:
        voc.close(session)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--background-rows", default="4,8", help="rows of the background steps, comma-separated")
    ap.add_argument("--samples", type=int, default=40, help="newcomers timed per mode and background")
    ap.add_argument("--gap-ms", type=float, default=20.0, help="pause between newcomers")
    ap.add_argument("--chunk-schedule", default="3,5,10,25", help="the service's chunk schedule (codes)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    rows = [int(r) for r in args.background_rows.split(",")]
    schedule = [int(c) for c in args.chunk_schedule.split(",")]
    command = "python " + " ".join(sys.argv)
    t_start = time.perf_counter()
    voc, warm = build_for_serving(
        args.preset, device=args.device, dtype=dtype, cuda_graphs=True, bucket_shapes=True,
        reserved_sessions=64, warmup_rows=sorted({1, *rows}), chunk_schedule_codes=schedule,
    )
    lanes = {"lane0": 0, "same_priority": voc.add_lane(priority=0), "high_priority": voc.add_lane(priority=-1)}
    for name in ("same_priority", "high_priority"):
        voc.warm_up([1], lane=lanes[name])
    first_codes = codes_for(schedule[0] + LOOKAHEAD_CODES, offset=5000)
    want = (schedule[0] * SAMPLES_PER_CODE) - voc.overlap_samples
    # verification before timing: same PCM from every lane, right length, finite
    reference = newcomer(voc, 0, first_codes)[1]
    checks = {}
    for name, lane in lanes.items():
        pcm = newcomer(voc, lane, first_codes)[1]
        checks[name] = {"samples": len(pcm), "finite": bool(np.isfinite(pcm).all()),
                        "max_abs_diff_vs_lane0": float(np.abs(pcm - reference).max()) if len(pcm) == len(reference)
                        else None}
        assert len(pcm) == want and checks[name]["finite"], (name, checks[name])
        assert checks[name]["max_abs_diff_vs_lane0"] == 0.0, (name, checks[name])
    result: dict[str, Any] = {
        "command": command, "preset": args.preset, "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "dtype": dtype, "chunk_schedule_codes": schedule,
        "first_chunk_samples": want, "warm_up": warm, "checks": checks, "alone": {}, "background": {},
        "stream_priority_range": list(torch.cuda.Stream.priority_range()) if cuda else None,
    }

    def save() -> None:
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")

    for name, lane in lanes.items():  # newcomers with nothing else running
        times = [newcomer(voc, lane, first_codes)[0] for _ in range(args.samples)]
        result["alone"][name] = percentiles([1000 * t for t in times])
    print(json.dumps({"alone": result["alone"]}), flush=True)
    for r in rows:
        bg = Background(voc, r)
        for _ in range(3):
            bg.one_step()
        bg.start()
        time.sleep(1.0)
        entry: dict[str, Any] = {"background_alone": bg.stop()}
        for name, lane in lanes.items():
            bg.start()
            time.sleep(0.2)
            times = []
            for _ in range(args.samples):
                seconds, pcm = newcomer(voc, lane, first_codes)
                assert len(pcm) == want and np.isfinite(pcm).all()
                times.append(seconds)
                time.sleep(args.gap_ms / 1000)
            entry[name] = {"newcomer_ms": percentiles([1000 * t for t in times]), "background": bg.stop()}
        for s in bg.sessions:
            voc.close(s)
        result["background"][f"rows_{r}"] = entry
        print(json.dumps({f"rows_{r}": entry}), flush=True)
        save()
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    save()


if __name__ == "__main__":
    main()
