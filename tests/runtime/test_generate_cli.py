"""`python -m runtime.generate --json` end to end (subprocess) on the tiny preset."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runtime.generate", *args],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )


def test_cli_json_is_complete_and_consistent() -> None:
    proc = cli("--model", "tiny", "--text", "Hello", "--max-new-tokens", "4", "--temperature", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    expected_keys = {"text", "num_audio_codes", "audio_codes", "finish_reason", "prefill_ms", "decode_ms_per_step"}
    assert expected_keys <= result.keys()
    assert result["finish_reason"] in ("stop", "length")
    assert result["num_audio_codes"] == len(result["audio_codes"])
    assert all(0 <= c < 16384 for c in result["audio_codes"])
    # Audio output: the prompt ends with SOSP, so every row is an audio row until an EOSP.
    assert 1 <= result["num_generated_tokens"] <= 4
    assert result["num_audio_codes"] <= result["num_generated_tokens"]
    # The first row is sampled by the prefill step, every later one by a decode step.
    assert result["num_decode_steps"] == result["num_generated_tokens"] - 1
    # Step timings are reported, not judged: finite and non-negative, zero when there was no decode step.
    assert math.isfinite(result["prefill_ms"]) and result["prefill_ms"] >= 0
    assert math.isfinite(result["decode_ms_per_step"]) and result["decode_ms_per_step"] >= 0
    assert (result["decode_ms_per_step"] == 0) == (result["num_decode_steps"] == 0)


def test_cli_rejects_over_long_request() -> None:
    proc = cli("--model", "tiny", "--text", "Hi", "--max-new-tokens", "5000", "--json")
    assert proc.returncode == 2
    assert "exceeds max_model_len (4096)" in proc.stderr
    assert proc.stdout == ""


def test_cli_refuses_an_unknown_device_as_a_bad_option() -> None:
    proc = cli("--text", "Hi", "--device", "bogus")
    assert proc.returncode == 2 and "error: --device: Expected one of cpu" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_generation_that_ends_with_an_error_exits_1(tmp_path: Path) -> None:
    """A checkpoint whose audio head is NaN: the result is printed, with finish_reason "error", and the exit
    code says the generation failed (it was 0)."""
    import torch

    from runtime.config import ModelConfig
    from runtime.model import build_model
    from runtime.weights import save_checkpoint

    model = build_model(ModelConfig.preset("tiny").replace(num_shared_layers=2, num_modality_layers=1), seed=5)
    with torch.no_grad():
        model.audio_lm_head.weight.fill_(math.nan)
    save_checkpoint(model, tmp_path)
    proc = cli("--model", str(tmp_path), "--text", "Hi", "--max-new-tokens", "4", "--json")
    assert proc.returncode == 1
    result = json.loads(proc.stdout)
    assert (result["finish_reason"], result["error"]) == (
        "error", "the model produced non-finite logits (NaN or inf) for this request")
    assert proc.stderr.strip().endswith(
        "error: generation failed: the model produced non-finite logits (NaN or inf) for this request")


def test_cli_refuses_devices_it_cannot_run_on_as_a_bad_option() -> None:
    """mps and meta, and cuda where PyTorch has none (this CPU build), ended in a traceback with status 1,
    which means a generation that failed."""
    import torch

    for device, message in [("mps", "--device must be cpu or cuda, got 'mps'"),
                            ("meta", "--device must be cpu or cuda, got 'meta'")] + (
            [] if torch.cuda.is_available() else [("cuda", "--device cuda: this machine's PyTorch sees no CUDA")]):
        proc = cli("--text", "Hi", "--device", device)
        assert proc.returncode == 2 and f"error: {message}" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
