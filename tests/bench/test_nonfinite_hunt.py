"""bench/nonfinite_hunt.py on tiny: its post-mortem of broken logits, and a refused engine as its result."""
from __future__ import annotations

import math

import torch

import bench.nonfinite_hunt as hunt
import runtime.fp8
from runtime.engine import EngineConfig, EngineCore
from runtime.model_runner import ModelRunner

ARGS = ["--preset", "tiny", "--device", "cpu", "--arrivals", "3", "--interval-ms", "0", "--max-new-tokens", "6"]


def test_kv_blocks_holding_nan_are_named_with_their_owners() -> None:
    core = EngineCore.from_config(EngineConfig())
    seq = core.add_request(hunt.speech_request(core.tokenizer, "hello there", max_new_tokens=4, min_new_tokens=4,
                                               seed=0, temperature=None))
    core.step()  # the prompt's blocks
    owned = seq.block_table[1]
    core.runner.kv_cache.v[3, owned, 2, 0, 5] = math.nan
    core.runner.kv_cache.k[0, 20, 0, 0, 0] = math.inf  # a free block
    found = hunt.nonfinite_blocks(core)
    assert (found["num_pairs"], found["layers"], found["num_blocks"]) == (2, [0, 3], 2)
    assert seq.block_table == list(range(11)) and owned == 1  # a 163-row prompt in blocks of 16
    assert found["blocks"] == [
        {"block": 1, "ref_count": 1, "prefix_cached": True, "owners": [seq.request_id]},
        {"block": 20, "ref_count": 0, "prefix_cached": False, "owners": []},
    ]
    assert hunt.nonfinite_weights(core) == []
    with torch.no_grad():
        core.runner.model.audio_lm_head.weight[0, 0] = math.nan
    assert hunt.nonfinite_weights(core) == ["audio_lm_head.weight"]


def test_the_first_broken_request_gets_a_post_mortem(monkeypatch) -> None:
    forward = ModelRunner.forward
    calls = [0]

    def nan_on_fourth_step(self, inp, feed=None):  # the audio logits of every row of one step
        text, audio = forward(self, inp, feed)
        calls[0] += 1
        return (text, torch.full_like(audio, math.nan)) if calls[0] == 4 else (text, audio)

    monkeypatch.setattr(ModelRunner, "forward", nan_on_fourth_step)
    summary = hunt.main([*ARGS, "--variants", "sync"])
    variant = summary["variants"][0]
    # the three prompts (512 rows each) share one step, then two decode steps, then the NaN step ends all three
    assert (variant["steps"], variant["finish_reasons"], variant["num_broken"]) == (4, {"error": 3}, 3)
    broken = variant["broken"]
    assert [{k: b[k] for k in ("step", "sampled", "computed", "generated")} for b in broken] == [
        {"step": 3, "sampled": 3, "computed": 514, "generated": 3}] * 3
    post = variant["post_mortem"]
    assert [(s["path"], s["num_seqs"], s["num_rows"]) for s in post["steps"]] == [
        ("plain", 3, 1536), ("plain", 3, 3), ("plain", 3, 3)]  # (sync: the broken step is not logged yet)
    assert post["weights"] == [] and post["kv"]["num_pairs"] == 0  # only the logits were made NaN
    assert [r["request"] for r in post["running"]] == [b["request"] for b in broken]
    assert [len(r["blocks"]) for r in post["running"]] == [33, 33, 33]


def test_an_engine_that_refuses_to_start_is_the_result(monkeypatch) -> None:
    linear = runtime.fp8.linear

    def broken(x, w, **kwargs):  # the audio head's product at 64 rows returns zeros
        y = linear(x, w, **kwargs)
        return torch.zeros_like(y) if (w.shape[0], x.shape[0]) == (16512, 64) else y

    monkeypatch.setattr(runtime.fp8, "linear", broken)
    summary = hunt.main([*ARGS, "--fast-path", "--check-matmuls"])
    assert "variants" not in summary
    assert summary["refused"].startswith("1 of 42 matrix products on this device were wrong: audio_head [64 x 64] @ "
                                         "[64 x 16512]: 0 non-finite outputs, relative error 1")
