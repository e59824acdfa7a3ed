"""Run a Serve YAML's applications on a private local Ray, on 127.0.0.1 only, until SIGTERM.

    python bench/serve_app.py --config config/serve-h200.yaml --port 8000 --metrics-port 8080 \
        --ready-file /tmp/ready

Used by bench/h200_e2e.sh. Unlike `serve run`, it starts its own Ray with known ports (HTTP, metrics
export), forces the HTTP host to 127.0.0.1, writes `--ready-file` (JSON: url, metrics port, config)
once every application is RUNNING, and on SIGTERM/SIGINT shuts Serve and Ray down, so the caller stops
everything by this one process id. Needs RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (loopback node address).
With `--throughput-optimized` (Ray's RAY_SERVE_THROUGHPUT_OPTIMIZED=1, docs/operations.md) the ready file
also names `direct_url`: the ingress replica's own HTTP server, which skips the proxy's hop.
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


DIRECT_PORTS = 64  # ports for ingress replicas' own HTTP servers (direct ingress), from --direct-port on


def optimized_env(direct_port: int, drain_s: float) -> dict[str, str]:
    """Environment of a throughput-optimized Ray (read by every Ray process at import). Ray 2.60 keeps a
    direct-ingress replica draining for RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S (default 30 s, for
    an external load balancer to deregister it) on every stop, and raises the ingress deployment's
    graceful_shutdown_timeout_s to that plus 5 s, so `serve.shutdown()` gave up after its own 30 s and every
    such run of bench/h200_e2e.sh ended in a SIGKILL. On loopback no balancer is there: `drain_s`."""
    if drain_s < 0:
        raise ValueError(f"drain_s must be >= 0, not {drain_s}")
    return {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(direct_port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(direct_port + DIRECT_PORTS),
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(drain_s)}


def direct_ingress_url(first_port: int, timeout_s: float = 60.0) -> str:
    """The loopback URL of the ingress replica's own HTTP server (direct ingress): the first port from
    `first_port` on whose /health answers 200. Ray gives replicas the lowest free port of the range."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for port in range(first_port, first_port + DIRECT_PORTS):
            url = f"http://127.0.0.1:{port}"
            try:
                # trust_env=False: an HTTP_PROXY in the environment would take the probe off loopback
                if httpx.get(url + "/health", timeout=1.0, trust_env=False).status_code == 200:
                    return url
            except httpx.HTTPError:
                continue
        time.sleep(0.5)
    raise RuntimeError(f"no ingress replica answered on 127.0.0.1:{first_port}..{first_port + DIRECT_PORTS - 1}")


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
    parser.add_argument("--throughput-optimized", action="store_true",
                        help="set RAY_SERVE_THROUGHPUT_OPTIMIZED=1 for this Ray (also honoured when already set): "
                             "replicas talk over gRPC, user code runs on the replica's loop, and the ingress "
                             "replica serves HTTP itself from --direct-port on (the ready file's direct_url)")
    parser.add_argument("--direct-port", type=int, default=30000,
                        help="first port of the ingress replicas' own HTTP servers (throughput-optimized)")
    parser.add_argument("--drain-s", type=float, default=1.0,
                        help="throughput-optimized: seconds an ingress replica drains when stopped (Ray's "
                             "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S, 30 by default; no load balancer here)")
    args = parser.parse_args(argv)
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        raise SystemExit("set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 so that Ray binds to 127.0.0.1")
    optimized = args.throughput_optimized or os.environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") == "1"
    if optimized:  # read by every Ray process at import: set before Ray starts them
        os.environ.update(optimized_env(args.direct_port, args.drain_s))

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
        ready = {"url": f"http://127.0.0.1:{http.get('port', 8000)}",
                 "direct_url": direct_ingress_url(args.direct_port) if optimized else None,
                 "metrics_port": args.metrics_port,
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
