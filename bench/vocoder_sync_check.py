"""Where a vocoder step makes the host wait for the GPU (PyTorch's sync debug mode), on a CUDA machine.

    python bench/vocoder_sync_check.py [--preset tiny]

Opens a stream, pushes 20 codes, then counts the synchronising calls of one more `step` (20 codes) and
the `finish`, each with the line of `vocoder/` that made it. One wait per call is expected: the copy of
the PCM to the host. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import numpy as np
    import torch

    from vocoder import StreamingVocoder

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    args = p.parse_args()
    voc = StreamingVocoder.from_preset(args.preset, device="cuda")
    codes = np.random.default_rng(0).integers(0, 16384, 40).tolist()
    session = voc.open("default", seed=1)
    voc.step([(session, codes[:20])])
    torch.cuda.synchronize()
    sites: dict[str, Counter] = {"step": Counter(), "finish": Counter()}

    def record(call: str):
        def show(message, category, filename, lineno, file=None, line=None):
            ours = [f for f in traceback.extract_stack() if "/vocoder/" in f.filename]
            where = f"{Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else f"{filename}:{lineno}"
            sites[call][where] += 1
        return show

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record("step")
            pcm = voc.step([(session, codes[20:])])[0]
            warnings.showwarning = record("finish")
            tail = voc.finish(session)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(pcm) + len(tail) > 0 and np.isfinite(pcm).all() and np.isfinite(tail).all()
    print(json.dumps({"command": shlex.join(["python3", *sys.argv]), "preset": args.preset, "device": torch.cuda.get_device_name(),
                      "samples": [len(pcm), len(tail)],
                      "waits": {k: dict(v) for k, v in sites.items()},
                      "num_waits": {k: sum(v.values()) for k, v in sites.items()}}))


if __name__ == "__main__":
    main()
