"""Process-wide settings for the test session: keep Ray on loopback, offline, without auth prompts."""
from __future__ import annotations

import os

# Must be set before Ray is imported anywhere (see docs/development.md).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Replicas push autoscaling metrics every second (default 10 s) so the live scaling test reacts quickly.
os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
