"""Session fixtures: one local Ray (loopback, no dashboard, known metrics port) and one running app.

Fixtures for any tests/serve module:
- `serve_base_url`: "http://127.0.0.1:<port>" of the running tiny app (route prefix "/").
- `http`: an httpx.Client on that base URL.
- `serve_metrics_port`: Ray's metrics export port; `serve_harness.scrape_metrics()` reads it.
"""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import serve_harness
from talking_checkpoint import write_talking_checkpoint


@pytest.fixture(scope="session")
def serve_metrics_port() -> Iterator[int]:
    """Start Ray once per test session with a fixed metrics export port."""
    import ray

    port = serve_harness.free_port()
    ray.init(num_cpus=4, include_dashboard=False, _metrics_export_port=port,
             # Export custom metrics every second (the default is several seconds).
             _system_config={"metrics_report_interval_ms": 1000}, log_to_driver=False)
    serve_harness.set_metrics_port(port)
    yield port
    ray.shutdown()


@pytest.fixture(scope="session")
def serve_base_url(serve_metrics_port: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Start Serve on 127.0.0.1 and run the tiny app once for the whole session.

    The engine loads the synthetic "talking" tiny checkpoint (see talking_checkpoint.py) through the
    real checkpoint loader; the vocoder is the real `tiny` preset.
    """
    from ray import serve

    from deployments.app import build_app

    checkpoint = write_talking_checkpoint(tmp_path_factory.mktemp("talking-checkpoint"))
    args = serve_harness.app_args(str(checkpoint))
    port = serve_harness.free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(args), name=serve_harness.APP_NAME, route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="session")
def http(serve_base_url: str) -> Iterator[httpx.Client]:
    """A client for the running app (generous read timeout: CPU generation)."""
    with httpx.Client(base_url=serve_base_url, timeout=httpx.Timeout(120.0, connect=10.0)) as client:
        yield client
