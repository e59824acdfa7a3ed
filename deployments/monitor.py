"""A terminal view of a running service's metrics, for when no Grafana is at hand.

    python -m deployments.monitor --url http://127.0.0.1:PORT/metrics [--interval 10] [--json]
    python -m deployments.monitor --url ... --check-dashboard k8s/grafana-dashboard.json

It reads Ray's Prometheus export (the `ray_moss_*` metrics of docs/metrics.md and Ray Serve's own
`ray_serve_*` families) and prints time to first audio p50/p99, audio chunk gaps, real-time factor,
active streams, queue, KV cache use, prefix-cache hit rate, replicas per deployment and errors.
With one scrape, histograms and counters cover the whole life of the service; with ``--interval S`` it
scrapes twice and reports only what happened between the scrapes (as Prometheus' ``rate`` would).
``--check-dashboard`` lists the metric names a Grafana dashboard queries that the service does not export.
Exit status: 0, 1 when ``--check-dashboard`` finds metrics missing, 2 when the scrape or the dashboard file
cannot be read (a message on stderr, no traceback).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

from prometheus_client.parser import text_string_to_metric_families

TTFA = "ray_moss_time_to_first_audio_seconds"
FIRST_CODE = "ray_moss_time_to_first_code_seconds"
FIRST_PCM = "ray_moss_vocoder_time_to_first_pcm_seconds"
CHUNK_GAP = "ray_moss_audio_chunk_gap_seconds"
RTF = "ray_moss_realtime_factor"
ACTIVE_STREAMS = "ray_moss_active_streams"
QUEUED = "ray_moss_queued_requests"
KV_USED = "ray_moss_kv_blocks_used"
KV_FREE = "ray_moss_kv_blocks_free"
PREFIX_HIT_TOKENS = "ray_moss_prefix_cache_hit_tokens_total"
PREFIX_QUERY_TOKENS = "ray_moss_prefix_cache_query_tokens_total"
ERRORS = "ray_moss_errors_total"
REQUESTS = "ray_moss_requests_total"
AUDIO_SECONDS = "ray_moss_audio_seconds_total"
REPLICA_HEALTHY = "ray_serve_deployment_replica_healthy"
TARGET_REPLICAS = "ray_serve_autoscaling_target_replicas"


class Sample(NamedTuple):
    """One exported series value; ``kind`` is the family type (counter, gauge, histogram, ...)."""

    name: str
    labels: dict[str, str]
    value: float
    kind: str


def parse_samples(text: str) -> list[Sample]:
    """Parse Prometheus text exposition into samples (sample names keep `_total`, `_bucket`, ...)."""
    return [Sample(s.name, dict(s.labels), float(s.value), family.type)
            for family in text_string_to_metric_families(text) for s in family.samples]


MAX_SCRAPE_BYTES = 64 << 20


def scrape(url: str, timeout_s: float = 10.0, total_s: float = 60.0) -> list[Sample]:
    """Fetch and parse one scrape of ``url``: each read within ``timeout_s``, the whole body by ``total_s`` (a
    server trickling bytes kept it open for days), at most MAX_SCRAPE_BYTES. TimeoutError, OSError (URLError,
    HTTPError) or ValueError (not Prometheus text) otherwise."""
    deadline = time.monotonic() + total_s
    body = bytearray()
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        while chunk := response.read1(1 << 16):
            body += chunk
            if len(body) > MAX_SCRAPE_BYTES:
                raise ValueError(f"the scrape is larger than {MAX_SCRAPE_BYTES} bytes")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the scrape took longer than {total_s:g} s")
    return parse_samples(body.decode("utf-8"))


def delta(after: list[Sample], before: list[Sample]) -> list[Sample]:
    """Counters and histograms as increases between two scrapes; gauges as in ``after``."""
    previous = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in before}
    out = []
    for s in after:
        if s.kind in ("counter", "histogram", "summary"):
            start = previous.get((s.name, tuple(sorted(s.labels.items()))), 0.0)
            # A counter that went down belongs to a restarted replica: count it from zero.
            s = s._replace(value=s.value - start if s.value >= start else s.value)
        out.append(s)
    return out


def sum_by(samples: Iterable[Sample], name: str, by: tuple[str, ...] = ()) -> dict[tuple[str, ...], float]:
    """``sum by (by) (name)``: sums of the series called ``name`` grouped by the ``by`` labels."""
    sums: dict[tuple[str, ...], float] = defaultdict(float)
    for s in samples:
        if s.name == name:
            sums[tuple(s.labels.get(label, "") for label in by)] += s.value
    return dict(sums)


def total(samples: Iterable[Sample], name: str) -> float | None:
    """Sum of all series called ``name``, or None when none is exported."""
    sums = sum_by(samples, name)
    return sums[()] if sums else None


def histogram_buckets(samples: Iterable[Sample], family: str) -> list[tuple[float, float]]:
    """Cumulative ``(le, count)`` buckets of ``family`` summed over all its series, sorted by ``le``."""
    by_le = sum_by(samples, f"{family}_bucket", ("le",))
    return sorted((float(le), count) for (le,), count in by_le.items())


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile``: linear interpolation inside the bucket holding rank q.

    Returns None when the histogram holds no observations. A rank in the +Inf bucket returns the
    largest finite upper bound, as Prometheus does.
    """
    if not buckets or buckets[-1][1] <= 0:
        return None
    assert math.isinf(buckets[-1][0]), "a Prometheus histogram always ends with le=+Inf"
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for upper_bound, count in buckets:
        if count >= rank:
            if math.isinf(upper_bound):
                return lower_bound
            if count == lower_count:
                return upper_bound
            return lower_bound + (upper_bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = upper_bound, count
    return lower_bound


def _quantiles(samples: list[Sample], family: str) -> dict[str, float | None]:
    buckets = histogram_buckets(samples, family)
    count = buckets[-1][1] if buckets else 0.0
    return {"p50": histogram_quantile(0.5, buckets), "p99": histogram_quantile(0.99, buckets), "count": count}


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def summarize(samples: list[Sample]) -> dict[str, Any]:
    """The numbers the view prints, as a JSON-ready dict (None where the service exports nothing yet)."""
    kv_used, kv_free = total(samples, KV_USED), total(samples, KV_FREE)
    kv_total = (kv_used or 0.0) + (kv_free or 0.0) if kv_used is not None or kv_free is not None else None
    healthy = sum_by(samples, REPLICA_HEALTHY, ("application", "deployment"))
    target = sum_by(samples, TARGET_REPLICAS, ("application", "deployment"))
    replicas = {f"{app}/{dep}": {"healthy": int(healthy.get((app, dep), 0)),
                                 "target": int(target[(app, dep)]) if (app, dep) in target else None}
                for app, dep in sorted(set(healthy) | set(target))}
    return {
        "time_to_first_audio_s": _quantiles(samples, TTFA),
        "time_to_first_code_s": _quantiles(samples, FIRST_CODE),
        "time_to_first_pcm_s": _quantiles(samples, FIRST_PCM),
        "audio_chunk_gap_s": _quantiles(samples, CHUNK_GAP),
        "realtime_factor": _quantiles(samples, RTF),
        "active_streams": total(samples, ACTIVE_STREAMS),
        "queued_requests": total(samples, QUEUED),
        "kv_cache_usage": _ratio(kv_used, kv_total),
        # (the hit counter is exported from its first hit on: absent while tokens were looked up is 0 %)
        "prefix_cache_hit_rate": _ratio(total(samples, PREFIX_HIT_TOKENS) or 0.0, total(samples, PREFIX_QUERY_TOKENS)),
        "audio_seconds": total(samples, AUDIO_SECONDS),
        "replicas": replicas,
        "errors": {kind: v for (kind,), v in sorted(sum_by(samples, ERRORS, ("kind",)).items())},
        "requests": {f"{route} {status}": v
                     for (route, status), v in sorted(sum_by(samples, REQUESTS, ("route", "status")).items())},
    }


def _fmt(value: float | None, unit: str = "", scale: float = 1.0) -> str:
    if value is None:
        return "-"
    value *= scale
    return f"{value:.0f}{unit}" if abs(value) >= 100 else f"{value:.3g}{unit}"


def render(summary: dict[str, Any]) -> str:
    """The summary as an aligned plain-text block."""
    lines = []
    for key, label, scale, unit in (("time_to_first_audio_s", "time to first audio", 1000.0, " ms"),
                                    ("time_to_first_code_s", "  of which first code", 1000.0, " ms"),
                                    ("time_to_first_pcm_s", "  of which first PCM", 1000.0, " ms"),
                                    ("audio_chunk_gap_s", "audio chunk gap", 1000.0, " ms"),
                                    ("realtime_factor", "real-time factor", 1.0, "")):
        q = summary[key]
        lines.append(f"{label:<22} p50 {_fmt(q['p50'], unit, scale):>10}   p99 {_fmt(q['p99'], unit, scale):>10}"
                     f"   n={int(q['count'])}")
    lines.append(f"{'active streams':<22} {_fmt(summary['active_streams'])}")
    lines.append(f"{'queued requests':<22} {_fmt(summary['queued_requests'])}")
    lines.append(f"{'KV cache use':<22} {_fmt(summary['kv_cache_usage'], ' %', 100.0)}")
    lines.append(f"{'prefix-cache hit rate':<22} {_fmt(summary['prefix_cache_hit_rate'], ' %', 100.0)}")
    lines.append(f"{'audio produced':<22} {_fmt(summary['audio_seconds'], ' s')}")
    lines.append("replicas (healthy / target):")
    lines += [f"  {name:<40} {r['healthy']} / {'-' if r['target'] is None else r['target']}"
              for name, r in summary["replicas"].items()] or ["  -"]
    lines.append("errors by kind:")
    lines += [f"  {kind:<40} {int(n)}" for kind, n in summary["errors"].items()] or ["  none"]
    lines.append("requests by route and status:")
    lines += [f"  {key:<40} {int(n)}" for key, n in summary["requests"].items()] or ["  none"]
    return "\n".join(lines)


# PromQL words that look like metric names but are not.
_PROMQL_WORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
                           "unless", "bool", "offset", "inf", "nan"})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(\s*\()?")


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (label matchers, grouping labels, functions removed)."""
    expr = _STRING.sub('""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)      # label matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)     # range / subquery durations
    expr = _GROUPING.sub(" ", expr)
    names = set()
    for match in _IDENTIFIER.finditer(expr):
        word, is_call = match.group(1), match.group(2)
        if not is_call and word.lower() not in _PROMQL_WORDS:
            names.add(word)
    return names


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    """Every target ``expr`` in a Grafana dashboard (rows' nested panels included)."""
    exprs = []
    stack = list(dashboard.get("panels", []))
    while stack:
        panel = stack.pop()
        stack.extend(panel.get("panels", []))
        exprs += [t["expr"] for t in panel.get("targets", []) if t.get("expr")]
    return exprs


# Counters of events that healthy traffic may never have: Ray exports a counter only after its first
# increment, so their absence from a scrape is no fault of the service (docs/metrics.md).
EVENT_COUNTERS = frozenset({"ray_moss_errors_total", "ray_moss_preemptions_total", "ray_moss_engine_step_failures_total",
                            PREFIX_HIT_TOKENS,
                            # speech input: never on a server without the encoder (the 24 GB bf16 config)
                            "ray_moss_speech_input_seconds_total"})


def missing_dashboard_metrics(dashboard: dict[str, Any], samples: list[Sample]) -> set[str]:
    """Metric names the dashboard queries that are absent from the scrape, EVENT_COUNTERS aside."""
    exported = {s.name for s in samples}
    used = set().union(*(promql_metric_names(e) for e in dashboard_exprs(dashboard)))
    return used - exported - EVENT_COUNTERS


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m deployments.monitor", description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080/metrics", help="Ray's metrics export URL")
    parser.add_argument("--interval", type=_seconds, default=0.0,
                        help="scrape twice this many seconds apart and report only the difference")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--check-dashboard", type=Path, default=None, metavar="JSON",
                        help="list metric names this Grafana dashboard queries but the service does not export")
    args = parser.parse_args(argv)

    try:
        dashboard = None
        if args.check_dashboard is not None:  # read first: a bad file needs no scrape
            dashboard = json.loads(args.check_dashboard.read_text())
            if not isinstance(dashboard, dict):
                raise ValueError(f"{args.check_dashboard} is not a Grafana dashboard (a JSON object)")
        samples = scrape(args.url)
        if args.interval > 0:
            time.sleep(args.interval)
            samples = delta(scrape(args.url), samples)
    except (OSError, ValueError) as exc:  # URLError, HTTPError and TimeoutError are OSErrors; JSON, text: ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if dashboard is not None:
        missing = missing_dashboard_metrics(dashboard, samples)
        print("\n".join(sorted(missing)) if missing else "every dashboard metric is exported")
        return 1 if missing else 0
    summary = summarize(samples)
    print(json.dumps(summary, indent=2) if args.json else render(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
