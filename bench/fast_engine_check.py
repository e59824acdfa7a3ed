"""The engine with `fast_path=True` on CUDA: exact rows on a tiny float32 model, and time to first audio
code and the per-step decode time (graph replay + sampling + host work) on the full random-weight model,
bf16 and FP8 (all matrices), one conversation, no vocoder.

    python bench/fast_engine_check.py --out bench/results/engine-h200-check.json   # also prints one JSON line
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fast_tools import emit, log
from runtime.config import AUDIO_PAD_ID, IM_START_ID, SOSP_ID, ModelConfig, Row
from runtime.engine import EngineConfig, EngineCore, default_seed
from runtime.kv_cache import kv_bytes_per_block
from runtime.model import MossSpeechForCausalLM, build_model
from runtime.request import AudioCodes, GenerationRequest
from runtime.sampling import RequestSampler, SamplingParams, is_stop_row, sample_next_rows
from runtime.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0.0)


def prompt(rng: random.Random, length: int, audio_out: bool) -> tuple[Row, ...]:
    rows = [(IM_START_ID, AUDIO_PAD_ID)] + [(rng.randrange(256), AUDIO_PAD_ID) for _ in range(length - 1)]
    if audio_out:
        rows[-1] = (SOSP_ID, AUDIO_PAD_ID)
    return tuple(rows)


def reference(model: MossSpeechForCausalLM, request: GenerationRequest) -> list[Row]:
    """Whole-sequence forward per token with the same sampler (no cache, no batching)."""
    sampler = RequestSampler(request.prompt_rows, request.text_sampling, request.audio_sampling,
                             min_new_tokens=request.min_new_tokens, seed=default_seed(request.request_id))
    rows = list(request.prompt_rows)
    for _ in range(request.max_new_tokens):
        text, audio = model.reference_forward(rows)
        row = sample_next_rows(text[-1:], audio[-1:], [sampler])[0]
        rows.append(row)
        if is_stop_row(row):
            break
    return rows[len(request.prompt_rows):]


def run(core: EngineCore, arrivals: dict[int, list[GenerationRequest]]) -> dict[str, list[Row]]:
    seqs, step = {}, 0
    while core.has_work or any(k >= step for k in arrivals):
        for request in arrivals.get(step, []):
            seqs[request.request_id] = core.add_request(request)
        core.step()
        step += 1
    return {k: s.rows[s.num_prompt_rows:] for k, s in seqs.items()}


def tiny_exact(many: bool = False) -> dict:
    """Rows of the engine (fast path, graphs) against the reference, tiny float32 model. `many`: 70 requests,
    up to 64 decoded together: 64 x 2 KV heads = 128 programs, so decode steps split keys in 2 partitions."""
    config = dataclasses.replace(ModelConfig.preset("tiny"), num_shared_layers=2, num_modality_layers=1)
    plain = build_model(config, seed=0, device="cuda")
    fused = build_model(config, seed=0, device="cuda")
    rng = random.Random(13)
    if many:
        requests = [GenerationRequest(f"m{i}", prompt(rng, 4 + 3 * (i % 5), audio_out=i % 7 != 1), GREEDY, GREEDY,
                                      max_new_tokens=6) for i in range(70)]
        arrivals, running, batched, blocks = {0: requests[:64], 3: requests[64:]}, 64, 512, 1024
    else:
        requests = [GenerationRequest(f"f{i}", prompt(rng, 4 + 5 * i, audio_out=i != 1), GREEDY, GREEDY,
                                      max_new_tokens=6) for i in range(3)]
        arrivals, running, batched, blocks = {0: requests[:2], 2: requests[2:]}, 2, 8, 256
    engine_config = EngineConfig(device="cuda", dtype="float32", block_size=4, fast_path=True,
                                 max_num_running=running, max_num_batched_tokens=batched,
                                 kv_cache_bytes=blocks * kv_bytes_per_block(config, 4, torch.float32))
    core = EngineCore(fused, Tokenizer.tiny(), engine_config)
    got = run(core, arrivals)
    equal = {r.request_id: got[r.request_id] == reference(plain, r) for r in requests}
    return {"rows_equal_reference": equal, "steps_by_path": dict(core.runner.num_steps_by_path)}


def full_first_audio(prompt_len: int = 512, reps: int = 5, fp8_scope: str | None = None) -> dict:
    """Time from add_request to the first audio code, full model, one conversation, fast path."""
    config = EngineConfig(model="full", device="cuda", dtype="bfloat16", fast_path=True, max_num_running=8,
                          max_model_len=2048, kv_cache_bytes=4 * 2**30, fp8_scope=fp8_scope)
    model = build_model(ModelConfig.preset("full"), seed=0, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    core = EngineCore(model, Tokenizer.tiny(), config)
    setup_s = time.perf_counter() - t0
    samples, step_ms = [], []
    for i in range(reps + 1):
        request = GenerationRequest(f"a{i}", prompt(random.Random(i), prompt_len, audio_out=True), GREEDY, GREEDY,
                                    max_new_tokens=12)
        torch.cuda.synchronize()
        start = time.perf_counter()
        core.add_request(request)
        first = None
        while core.has_work:
            t0 = time.perf_counter()
            events = core.step()
            if first is not None and i:
                step_ms.append(1e3 * (time.perf_counter() - t0))  # one decode step incl. sampling + host work
            if first is None and any(isinstance(e, AudioCodes) for _, e in events):
                first = time.perf_counter() - start
        if i:  # the first request warms up
            samples.append(first)
    out = {"fp8_scope": fp8_scope, "prompt_len": prompt_len, "setup_s": round(setup_s, 2),
            "first_audio_code_ms": [round(1e3 * s, 2) if s is not None else None for s in samples],
           "decode_step_ms_median": round(sorted(step_ms)[len(step_ms) // 2], 2) if step_ms else None,
           "steps_by_path": dict(core.runner.num_steps_by_path),
           "max_memory_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    del core, model
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args()
    result = {"bench": "fast_engine_check", "command": shlex.join(["python", "bench/fast_engine_check.py", *sys.argv[1:]]),
              "device_name": torch.cuda.get_device_name(), "torch": torch.__version__,
              "tiny_float32": tiny_exact(), "tiny_float32_64_running": tiny_exact(many=True)}
    log(json.dumps(result))
    result["full_bf16"] = full_first_audio()
    log(json.dumps(result))
    result["full_fp8_all"] = full_first_audio(fp8_scope="all")
    emit(result, args.out)
