"""The fused embedding lookup (runtime/kernels/elementwise.py `embed`) under Triton's CPU interpreter.

It replaces the reference's two gathers, three selects and a fill (runtime/fast_ops.py TorchOps.embed) with
one launch, so it must give the same bits: a copy from the row's own table, never a sum (a -0.0 stays -0.0).
"""
from __future__ import annotations

SCRIPT = """
import torch
from runtime.fast_ops import TorchOps
from runtime.kernels.elementwise import embed
torch.manual_seed(0)
for hidden, dtype in ((64, torch.float32), (96, torch.bfloat16)):  # 96: a row narrower than its block
    text = torch.randn(50, hidden).to(dtype)
    text[3, 5] = -0.0
    audio = torch.randn(20, hidden).to(dtype)
    tokens = torch.tensor([3, 0, 19, 49, 7, 12], dtype=torch.int64)  # 49: a text id past the audio table
    is_audio = torch.tensor([False, True, True, False, True, False])
    got, want = embed(tokens, is_audio, text, audio), TorchOps.embed(tokens, is_audio, text, audio)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert got.shape == want.shape == (6, hidden) and got.dtype == dtype
    assert torch.equal(got.view(bits), want.view(bits))
    assert got[0, 5].item() == 0.0 and str(got[0, 5].item()) == "-0.0"
    print(hidden, "equal")
"""


def test_embed_kernel_copies_each_row_from_its_own_table(triton_interpreter) -> None:
    assert triton_interpreter(SCRIPT).split() == ["64", "equal", "96", "equal"]
