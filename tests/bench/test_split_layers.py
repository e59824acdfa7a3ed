"""bench/split_layers.py: the halves it cuts the layer matrices into, and that the split layer computes the
serial one (in float32 on the CPU, with the PyTorch ops standing in for the Triton kernels; the bench itself
checks the kernels' outputs on the GPU before timing)."""
import pytest
import torch

pytest.importorskip("triton")

from bench import split_layers as sl
from bench.decode_attention_tune import decode_tables, new_row_slots
from runtime.fast_ops import TorchOps, rope_tables


def test_qkv_halves_take_their_query_and_kv_heads_rows():
    rows = torch.arange(6144).view(6144, 1)
    a, b = sl.halves_of_qkv(rows)
    assert a.shape == b.shape == (3072, 1)
    # half A: query heads 0-15 (rows 0-2047), K heads 0-3 (4096-4607), V heads 0-3 (5120-5631)
    assert torch.equal(a[:, 0], torch.cat([torch.arange(0, 2048), torch.arange(4096, 4608), torch.arange(5120, 5632)]))
    assert torch.equal(b[:, 0], torch.cat([torch.arange(2048, 4096), torch.arange(4608, 5120), torch.arange(5632, 6144)]))


def test_gate_up_halves_keep_gate_before_up():
    rows = torch.arange(24576).view(24576, 1)
    a, b = sl.halves_of_gate_up(rows)
    assert torch.equal(a[:, 0], torch.cat([torch.arange(0, 6144), torch.arange(12288, 18432)]))
    assert torch.equal(b[:, 0], torch.cat([torch.arange(6144, 12288), torch.arange(18432, 24576)]))


@pytest.mark.parametrize("blocks", ["attn,mlp", "attn", "mlp"])
def test_split_layer_computes_the_serial_layer(monkeypatch, blocks):
    monkeypatch.setattr(sl, "add_rmsnorm", TorchOps.add_rmsnorm)
    monkeypatch.setattr(sl, "silu_mul", TorchOps.silu_mul)
    monkeypatch.setattr(sl, "paged_decode_attention_rope", TorchOps.decode_attention_rope)
    torch.manual_seed(0)
    rows, context = 3, 40
    tables, seq_lens, pos, pages = decode_tables(rows, context, torch.device("cpu"), spare=2)
    cos, sin = rope_tables(context + 64, sl.DIM, sl.THETA, torch.float32, torch.device("cpu"))
    step = sl.Step(pos=pos, slots=new_row_slots(tables, pos), tables=tables, seq_lens=seq_lens, cos=cos, sin=sin,
                   parts=1, parts_half=1)
    layer = sl.make_layer(pages, torch.device("cpu"), torch.float32)
    x, res = torch.randn(rows, sl.HIDDEN), torch.randn(rows, sl.HIDDEN)
    want_out, want_res = sl.serial_layer(layer, step, x, res, [])
    want_kv = sl.stored_rows(layer, step.slots, None)
    sl.clear_new_rows(layer, step.slots)
    out, got_res = sl.split_layer(layer, step, x, res, [], side=None, stagger=False, blocks=blocks)
    assert torch.allclose(out, want_out, rtol=0, atol=1e-5 * float(want_out.abs().max()))
    assert torch.allclose(got_res, want_res, rtol=0, atol=1e-5)
    got_kv = sl.split_stored_rows(layer, step.slots, blocks)  # with attn: each half's own KV heads
    assert all(torch.allclose(g, w, rtol=0, atol=1e-5 * float(w.abs().max())) for g, w in zip(got_kv, want_kv))
    assert not any(bool(r.abs().sum() == 0) for r in want_kv)
