"""Run a Serve YAML's applications on a private local Ray, on 127.0.0.1 only, until SIGTERM.

    python bench/serve_app.py --config config/serve-h200.yaml --port 8000 --metrics-port 8080 \
        --ready-file /tmp/ready

Used by bench/h200_e2e.sh. Unlike `serve run`, it starts its own Ray with known ports (HTTP, metrics
export), forces the HTTP host to 127.0.0.1, writes `--ready-file` (JSON: url, metrics port, config)
once every application is RUNNING, and on SIGTERM/SIGINT shuts Serve and Ray down, so the caller stops
everything by this one process id. Needs RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (loopback node address).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def load_config(path: str) -> dict[str, Any]:
    """The Serve YAML as a dict."""
    import yaml

    with open(path) as f:
        return yaml.safe_load(f)


def build_application(app: dict[str, Any]) -> Any:
    """`import_path` (module:attr) called with the YAML `args`."""
    module, attr = app["import_path"].split(":")
    return getattr(importlib.import_module(module), attr)(app.get("args", {}))


def _session_dir() -> str | None:
    """This Ray's session folder (logs), or None if Ray's internals moved."""
    try:
        from ray._private import worker

        return worker._global_node.get_session_dir_path()
    except Exception:  # noqa: BLE001 - only used to copy logs
        return None


def main(argv: list[str] | None = None) -> None:
    """Start Ray and Serve, deploy, signal readiness, wait for SIGTERM, shut down."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--port", type=int, default=None, help="HTTP port (default: the YAML's)")
    parser.add_argument("--metrics-port", type=int, required=True, help="Ray metrics export port")
    parser.add_argument("--num-cpus", type=int, default=None)
    parser.add_argument("--ready-file", required=True)
    args = parser.parse_args(argv)
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        raise SystemExit("set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 so that Ray binds to 127.0.0.1")

    import ray
    from ray import serve

    config = load_config(args.config)
    http = dict(config.get("http_options", {}))
    http["host"] = "127.0.0.1"  # whatever the YAML says: the benchmark stays on loopback
    if args.port is not None:
        http["port"] = args.port
    started = time.perf_counter()
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, _metrics_export_port=args.metrics_port,
             _system_config={"metrics_report_interval_ms": 2000})
    # After ray.init: Ray installs its own SIGTERM handler (log + abort), which would skip the shutdown.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options=http, proxy_location=config.get("proxy_location", "HeadOnly"))
        for app in config["applications"]:
            serve.run(build_application(app), name=app["name"], route_prefix=app.get("route_prefix", "/"))
        ready = {"url": f"http://127.0.0.1:{http.get('port', 8000)}", "metrics_port": args.metrics_port,
                 "config": args.config, "startup_s": time.perf_counter() - started,
                 "cluster_resources": ray.cluster_resources(), "session_dir": _session_dir()}
        Path(args.ready_file).write_text(json.dumps(ready) + "\n")
        print(f"serve_app: ready {json.dumps(ready)}", flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        print("serve_app: shutting down", flush=True)
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main()
