"""Device memory peak of loading a checkpoint with FP8 weights: staged through host memory (each matrix on the
GPU only to be quantized) against the whole bf16 model on the GPU first, in one run.

    python bench/fp8_load_peak.py --save /tmp/ckpt-full          # once: the full shape, random bf16 weights
    python bench/fp8_load_peak.py --load /tmp/ckpt-full --staged 1 --out staged.json
    python bench/fp8_load_peak.py --load /tmp/ckpt-full --staged 0 --out resident.json
    python bench/fp8_load_peak.py --load full --staged 1 --out preset.json   # the `full` preset, random weights

Each --load runs in its own process and builds an EngineCore (fast path, `fp8_scope`, 1 GiB of KV cache, no
start-up product check), then prints one JSON line: torch's peak allocation and reservation during the
build, the build time, and a checksum of the FP8 weights and scales (equal between the two modes: the same
numbers quantized on the same GPU).

Host memory too: the process's anonymous and file-backed resident memory (RssAnon, RssFile of
/proc/self/status), read every 5 ms during the build, highest values. A staged checkpoint is mapped
(`load_pretrained(mapped=True)`: views of its files, page cache, file-backed); `--mapped 0` copies it into
the process's memory instead, as before the fiftieth session:

    python bench/fp8_load_peak.py --load /tmp/ckpt-full --staged 1 --mapped 0 --out staged-copied.json
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Self

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.fast_tools import emit
from runtime import engine as engine_mod
from runtime.config import ModelConfig
from runtime.fp8 import Fp8Weight
from runtime.model import build_model
from runtime.weights import save_checkpoint

GIB = 2**30


def checksum(weights) -> dict:
    total, scales, count = 0, 0.0, 0
    matrices = [w for layer in (*weights.shared, *weights.text, *weights.audio) for w in layer.matrices().values()]
    for w in [*matrices, weights.text_head, weights.audio_head]:
        if isinstance(w, Fp8Weight):
            total += int(w.weight.view(torch.uint8).sum(dtype=torch.int64))
            scales += float(w.scale.double().sum())
            count += 1
    return {"fp8_matrices": count, "byte_sum": total, "scale_sum": scales}


def host_rss_mib() -> dict[str, float]:
    """This process's RssAnon and RssFile (MiB) from /proc/self/status."""
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("RssAnon:", "RssFile:")):
                out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return out


class HostPeak:
    """Highest RssAnon and RssFile seen by a thread reading them every 5 ms while the block runs."""

    def __init__(self) -> None:
        self.before = host_rss_mib()
        self.peak = dict(self.before)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._done.wait(0.005):
            for key, value in host_rss_mib().items():
                self.peak[key] = max(self.peak[key], value)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.after = host_rss_mib()

    def summary(self) -> dict[str, float]:
        return {f"host_{key.lower()}_{when}_gib": round(values[key] / 1024, 3)
                for when, values in (("before", self.before), ("peak", self.peak), ("after", self.after))
                for key in ("RssAnon", "RssFile")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save", type=Path, default=None)
    p.add_argument("--load", type=Path, default=None)
    p.add_argument("--staged", type=int, default=1)
    p.add_argument("--mapped", type=int, default=1, help="0: a staged checkpoint is copied into host memory")
    p.add_argument("--scope", default="all")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.save is not None:
        model = build_model(ModelConfig.preset("full"), seed=0, device="cuda", dtype=torch.bfloat16)
        save_checkpoint(model, args.save)
        print(f"saved {args.save}", file=sys.stderr)
        return
    if not args.staged:
        engine_mod._stages_fp8 = lambda config: False  # the whole bf16 model on the GPU first, as before
    if not args.mapped:
        from runtime import weights as weights_mod

        load = weights_mod.load_pretrained
        weights_mod.load_pretrained = lambda *a, **kw: load(*a, **{**kw, "mapped": False})
    config = engine_mod.EngineConfig(model=str(args.load), device="cuda", fast_path=True, fp8_scope=args.scope,
                                     kv_cache_bytes=GIB, max_model_len=2048, check_matmuls=False)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with HostPeak() as host:
        core = engine_mod.EngineCore.from_config(config)
        torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    weights = core.runner.fast.weights
    result = {
        "command": " ".join(["python", *sys.argv]),
        "device": torch.cuda.get_device_name(),
        "staged": bool(args.staged),
        "mapped": bool(args.staged and args.mapped),
        "scope": args.scope,
        "build_s": round(build_s, 1),
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 3),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / GIB, 3),
        "allocated_after_gib": round(torch.cuda.memory_allocated() / GIB, 3),
        "matrix_gib": round(weights.matrix_bytes() / GIB, 3),
        **host.summary(),
        "model_params_on": sorted({str(q.device) for q in core.runner.model.parameters()}),
        **checksum(weights),
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
