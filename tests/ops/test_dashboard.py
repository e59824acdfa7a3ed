"""The Grafana dashboard: required panels exist and every query names a metric the code defines."""
from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

from deployments.monitor import dashboard_exprs, promql_metric_names

REPO = Path(__file__).resolve().parents[2]
# Ray Serve's own families the dashboard reads (measured on Ray 2.60's export port).
RAY_SERVE_NAMES = {"ray_serve_deployment_replica_healthy", "ray_serve_autoscaling_target_replicas",
                   "ray_serve_deployment_queued_queries"}


def exported_names_of_project_metrics() -> set[str]:
    """Series names Ray exports for the metrics deployments/metrics.py creates.

    Ray prefixes `ray_`, appends `_total` to counters and `_bucket`/`_sum`/`_count` to histograms.
    """
    tree = ast.parse((REPO / "deployments" / "metrics.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            base = f"ray_{node.args[0].value}"
            kind = node.func.id
            if kind == "Counter":
                names.add(f"{base}_total")
            elif kind == "Gauge":
                names.add(base)
            elif kind == "Histogram":
                names |= {f"{base}_bucket", f"{base}_sum", f"{base}_count"}
    return names


def load_dashboard() -> dict[str, Any]:
    return json.loads((REPO / "k8s" / "grafana-dashboard.json").read_text())


def test_dashboard_has_one_panel_per_operational_question() -> None:
    dashboard = load_dashboard()
    assert [p["title"] for p in dashboard["panels"]] == [
        "Time to first audio (p50 / p99)", "Audio chunk gap (p50 / p99)", "Real-time factor (p50 / p99)",
        "Active streams", "Queue", "KV cache use", "Prefix-cache hit rate", "Replicas per deployment",
        "Errors by kind", "Requests by route and status", "Audio produced and speech taken in (seconds of audio per second)",
        "Vocoder batch size (p50 / p99)", "First audio by stage (p50)", "Vocoder step time by kind (p50 / p99)",
        "KV cache preemptions per second", "Engine step failures per second"]
    for panel in dashboard["panels"]:
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)) >= 1, panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource", "application"]


def test_quantile_panels_read_p50_and_p99_from_histogram_buckets() -> None:
    panels = {p["title"]: p for p in load_dashboard()["panels"]}
    for title, family in (("Time to first audio (p50 / p99)", "ray_moss_time_to_first_audio_seconds"),
                          ("Audio chunk gap (p50 / p99)", "ray_moss_audio_chunk_gap_seconds"),
                          ("Real-time factor (p50 / p99)", "ray_moss_realtime_factor")):
        exprs = [t["expr"] for t in panels[title]["targets"]]
        assert [e.split(",")[0] for e in exprs] == ["histogram_quantile(0.5", "histogram_quantile(0.99"]
        assert all(promql_metric_names(e) == {f"{family}_bucket"} for e in exprs)
        assert all("sum by (le)" in e for e in exprs)


def test_every_queried_metric_is_defined_by_the_code_or_exported_by_ray_serve() -> None:
    defined = exported_names_of_project_metrics()
    assert "ray_moss_errors_total" in defined and "ray_moss_time_to_first_audio_seconds_bucket" in defined
    used = set().union(*(promql_metric_names(e) for e in dashboard_exprs(load_dashboard())))
    assert used - defined - RAY_SERVE_NAMES == set()
    # Every project metric family appears somewhere on the dashboard.
    families = {n.removesuffix("_bucket").removesuffix("_total") for n in used}
    defined_families = {n.removesuffix("_bucket").removesuffix("_total") for n in defined
                        if not n.endswith(("_sum", "_count"))}
    assert defined_families - families == set()


def test_every_project_metric_the_dashboard_queries_is_listed_in_docs_metrics() -> None:
    listed = (REPO / "docs" / "metrics.md").read_text()
    used = set().union(*(promql_metric_names(e) for e in dashboard_exprs(load_dashboard())))
    project = {n for n in used if n.startswith("ray_moss_")}
    assert project  # the dashboard does query project metrics
    assert {n for n in project if f"`{n}`" not in listed} == set()
