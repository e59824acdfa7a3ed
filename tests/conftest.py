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



@pytest.fixture
def zero_tensor_bytes() -> Callable[[Path], None]:
    """Overwrites every tensor byte of a safetensors file with zeros, in place (the header stays valid), as a
    new download over an old file would change it under a process that still maps it."""

    def zero(path: Path) -> None:
        with path.open("r+b") as f:
            header_len = int.from_bytes(f.read(8), "little")
            f.seek(8 + header_len)
            f.write(bytes(path.stat().st_size - 8 - header_len))

    return zero
