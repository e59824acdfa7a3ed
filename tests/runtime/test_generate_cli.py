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
