"""Host memory of FP8 staging on the CPU: load a bf16 checkpoint mapped (the engine's staging since the fiftieth
session) or copied (before), then `quantize_model_in_place(model, "all", "cpu")`, as the engine does onto a GPU.
Prints one JSON line: seconds, FP8 matrix GiB and the process's RssAnon/RssFile before, at their highest and
after (bench/fp8_load_peak.py's HostPeak).

    python bench/results/fp8-load-host-cpu/host_fp8_cpu.py /tmp/ckpt-mid save     # once: full width, 8 layers
    python bench/results/fp8-load-host-cpu/host_fp8_cpu.py /tmp/ckpt-mid mapped
    python bench/results/fp8-load-host-cpu/host_fp8_cpu.py /tmp/ckpt-mid copied
"""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch

from bench.fp8_load_peak import HostPeak
from runtime.config import ModelConfig
from runtime.fused import quantize_model_in_place
from runtime.model import build_model
from runtime.weights import load_pretrained, save_checkpoint

path, mode = Path(sys.argv[1]), sys.argv[2]
if mode == "save":
    config = ModelConfig.preset("full").replace(num_shared_layers=4, num_modality_layers=2)
    save_checkpoint(build_model(config, seed=0, dtype=torch.bfloat16), path)
    sys.exit(0)
started = time.perf_counter()
with HostPeak() as host:
    model, _ = load_pretrained(path, device="cpu", dtype=torch.bfloat16, progress=False, mapped=mode == "mapped")
    weights = quantize_model_in_place(model, "all", "cpu")
print(json.dumps({"mode": mode, "s": round(time.perf_counter() - started, 1),
                  "fp8_matrix_gib": round(weights.matrix_bytes() / 2**30, 3), **host.summary()}))
