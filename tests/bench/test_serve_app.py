"""bench/serve_app.py: the environment of a throughput-optimized local Ray."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.serve_app import DIRECT_PORTS, optimized_env


def test_optimized_env_names_the_direct_ports_and_a_short_drain() -> None:
    assert optimized_env(30000, 1.0) == {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "30000",
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(30000 + DIRECT_PORTS),
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1.0",
    }
    assert optimized_env(31000, 0)["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "0"


def test_optimized_env_refuses_a_negative_drain() -> None:
    with pytest.raises(ValueError, match="drain_s must be >= 0"):
        optimized_env(30000, -1.0)


def test_ray_reads_the_names_it_is_given() -> None:
    """Every name must be one Ray reads, or its default (a 30 s drain) stays without a word: a fresh
    interpreter with the environment set sees it in Ray Serve's constants."""
    pytest.importorskip("ray.serve")
    env = os.environ | optimized_env(30100, 0.25)
    code = ("from ray.serve._private import constants as c; print(c.RAY_SERVE_THROUGHPUT_OPTIMIZED, "
            "c.RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S, c.RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT, "
            "c.RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    assert out == ["True", "0.25", "30100", str(30100 + DIRECT_PORTS)]
