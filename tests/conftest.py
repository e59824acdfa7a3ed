"""Process-wide settings for the test session: keep Ray on loopback, offline, without auth prompts; and the
`triton_interpreter` fixture."""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

# Must be set before Ray is imported anywhere (README.md, "Run it"; ../shared/design/ray-serve-notes.md).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def triton_interpreter() -> Callable[[str], str]:
    """Runs a Python script in a fresh process under Triton's CPU interpreter (chosen when kernels are
    defined, hence the process) with the repository importable; returns what it printed, failing the test on
    a non-zero exit. Skips where Triton is not installed."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = os.environ | {"TRITON_INTERPRET": "1",
                        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}

    def run(script: str) -> str:
        proc = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                              timeout=600, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    return run

