"""EARLY_KV on against off: the unfused decode kernel's outputs at every loop-trip edge, bit for bit."""
import torch

from runtime.kernels import paged_attention as pa
from runtime.kernels import pdl_launches

torch.manual_seed(0)
dev = torch.device("cuda")
H, KV, D, BS = 32, 8, 128, 16
LENGTHS = [1, 2, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 513, 1000]
blocks = 4096
k_cache = torch.randn(blocks, BS, KV, D, device=dev, dtype=torch.bfloat16)
v_cache = torch.randn(blocks, BS, KV, D, device=dev, dtype=torch.bfloat16)
cases = ok = 0
for batch in (1, 4, 8):
    for length in LENGTHS + ["mixed"]:
        lens = [int(x) for x in torch.randint(1, 1024, (batch,))] if length == "mixed" else [length] * batch
        width = 64
        tables = torch.randperm(blocks, device=dev)[: batch * width].view(batch, width).int()
        seq_lens = torch.tensor(lens, device=dev, dtype=torch.int32)
        q = torch.randn(batch, H, D, device=dev, dtype=torch.bfloat16)
        for parts in (1, 2, 16):
            outs = []
            for early in (True, False):
                pa.OPTIONS["early_kv"] = early
                for mode in ("off", "wait"):
                    with pdl_launches(mode):
                        outs.append(pa.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, parts))
            torch.cuda.synchronize()
            cases += 1
            same = all(torch.equal(outs[0], o) for o in outs[1:]) and bool(torch.isfinite(outs[0]).all())
            ok += same
            if not same:
                print("DIFF", batch, length, parts, [float((outs[0] - o).abs().max()) for o in outs[1:]])
pa.OPTIONS["early_kv"] = True
print(f"early_kv on/off, PDL off/wait: {ok} of {cases} cases bit-equal and finite")
