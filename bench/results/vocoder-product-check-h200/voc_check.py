import time

import torch

from vocoder.streaming import build_for_serving

for dtype in ("bfloat16", "float16"):
    t0 = time.perf_counter()
    voc, _ = build_for_serving("full", device="cuda", dtype=dtype, check_matmuls=False)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    checks = voc.check_products()
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    print(dtype, "built", round(built, 1), "s; checks", len(checks), "all ok", all(c.ok for c in checks),
          "max rel err", round(max(c.rel_err for c in checks), 5), "took", round(took, 2), "s;",
          "biased", sum(c.bias for c in checks), "max rel err biased",
          round(max(c.rel_err for c in checks if c.bias), 5))
    t0 = time.perf_counter()
    voc2, _ = build_for_serving("full", device="cuda", dtype=dtype)  # the default: checked on CUDA
    print(dtype, "default build with its check", round(time.perf_counter() - t0, 1), "s")
    del voc, voc2
