"""Ops checks on the running tiny service: policy-driven autoscaling, an LLM replica replaced after its
health check fails, and the dashboard's and the metrics view's metric names against what the service really
exports."""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import serve_harness

from deployments.monitor import (
    dashboard_exprs,
    delta,
    missing_dashboard_metrics,
    parse_samples,
    promql_metric_names,
    summarize,
)

REPO = Path(__file__).resolve().parents[2]
OPS_APP, OPS_ROUTE = "ops-autoscale", "/ops"
HEALTH_APP, HEALTH_ROUTE = "ops-health", "/ops-health"
SPEECH = {"model": "moss-speech", "voice": "default", "response_format": "pcm", "seed": 7}


def autoscaled_app_args() -> dict[str, Any]:
    """The test app with one request decoded at a time per LLM replica and llm_policy on the queue.

    KV and TTFA thresholds are out of reach, so only `num_waiting` moves the fleet. Ray's default policy
    is told to aim for 100 ongoing requests per replica: it alone would never add a replica here.
    """
    args = serve_harness.app_args("tiny")
    args["engine"].update(max_num_running=1, max_num_waiting=16)
    args["llm_options"] = {"num_cpus": 0.25, "autoscaling_config": {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 100,
        "upscale_delay_s": 0, "downscale_delay_s": 0, "look_back_period_s": 2,
        # how often replicas push their stats (Ray 2.60 reads this field; its default is 10 s)
        "metrics_interval_s": 1,
        "policy": {"policy_function": "deployments.autoscaling:llm_policy", "policy_kwargs": {
            "waiting_high": 0.5, "waiting_low": 0.25, "kv_usage_high": 0.99, "kv_usage_low": 0.98,
            "ttfa_p90_high_s": 1e6, "ttfa_p90_low_s": 1e5, "upscale_cooldown_s": 0, "quiet_period_s": 3}}}}
    args["vocoder_options"] = {"num_cpus": 0.25}
    args["ingress_options"] = {"num_cpus": 0.1}
    return args


def llm_replica_states(app: str = OPS_APP) -> dict[str, int]:
    from ray import serve

    return dict(serve.status().applications[app].deployments["LLMServer"].replica_states)


def running_llm_replicas() -> int:
    return int(llm_replica_states().get("RUNNING", 0))


def speech_payload(text: str, tokens: int) -> dict[str, Any]:
    """What the ingress hands the vocoder deployment for a speech request of exactly `tokens` tokens."""
    from deployments.validation import Limits, speech_request

    limits = Limits(served_model_name="moss-speech", voices=["default"], max_input_chars=2000,
                    max_new_tokens_limit=3000, default_max_new_tokens=64)
    body = json.dumps({**SPEECH, "input": text, "max_new_tokens": tokens, "min_new_tokens": tokens}).encode()
    return speech_request(body, limits)[1]


@pytest.fixture()
def autoscaled_app(serve_base_url: str) -> Iterator[None]:
    """A second application on the session's Serve instance, deleted afterwards."""
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app(autoscaled_app_args()), name=OPS_APP, route_prefix=OPS_ROUTE)
    yield
    serve.delete(OPS_APP)


@pytest.mark.usefixtures("autoscaled_app")
def test_llm_replicas_rise_under_queue_pressure_and_fall_back_after_it() -> None:
    seen: list[int] = []

    def observe() -> int:
        count = running_llm_replicas()
        if not seen or seen[-1] != count:
            seen.append(count)
        return count

    assert observe() == 1
    stop = threading.Event()
    failures: list[str] = []

    def keep_requesting() -> None:
        # Through the ops app's vocoder deployment (the same path the ingress takes: one stream per
        # utterance, which pulls from the LLM deployment), because the ingress answers 404 under a
        # route prefix other than "/".
        from ray import serve

        vocoder = serve.get_deployment_handle("VocoderServer", app_name=OPS_APP)
        while not stop.is_set():
            payload = speech_payload("Scale me up, please.", 60)
            events = list(vocoder.synthesize.options(stream=True).remote(payload))
            failures.extend(str(e) for e in events if e.get("type") == "error")

    clients = [threading.Thread(target=keep_requesting, daemon=True) for _ in range(4)]
    for thread in clients:
        thread.start()
    try:
        serve_harness.wait_until(lambda: observe() == 2, timeout_s=120, interval_s=0.5,
                                 what="a second LLM replica under load")
        serve_harness.wait_until(
            lambda: summarize(parse_samples(serve_harness.scrape_metrics()))["replicas"].get(
                f"{OPS_APP}/LLMServer") == {"healthy": 2, "target": 2},
            timeout_s=60, interval_s=1.0, what="exported replica gauges of the grown fleet")
    finally:
        stop.set()
        for thread in clients:
            thread.join(timeout=120)
    serve_harness.wait_until(lambda: observe() == 1, timeout_s=120, interval_s=0.5,
                             what="the fleet to shrink back to one LLM replica after the load")
    assert failures == []
    assert seen == [1, 2, 1]
    # The dashboard's and the metrics view's replica numbers follow: healthy replicas and Serve's target.
    serve_harness.wait_until(
        lambda: summarize(parse_samples(serve_harness.scrape_metrics()))["replicas"].get(
            f"{OPS_APP}/LLMServer") == {"healthy": 1, "target": 1},
        timeout_s=60, interval_s=1.0, what="exported replica gauges of the shrunk fleet")


def test_every_dashboard_query_names_an_exported_metric_and_the_view_counts_our_requests(
        http: httpx.Client) -> None:
    dashboard = json.loads((REPO / "k8s" / "grafana-dashboard.json").read_text())
    used = set().union(*(promql_metric_names(e) for e in dashboard_exprs(dashboard)))
    before = parse_samples(serve_harness.scrape_metrics())
    # Two identical requests (the second reuses the first's prompt blocks) and one invalid one.
    body = {**SPEECH, "input": "The same long prompt twice, so that the prefix cache gets a hit." * 2,
            "max_new_tokens": 48, "min_new_tokens": 48}
    for _ in range(2):
        response = http.post("/v1/audio/speech", json=body)
        assert response.status_code == 200, response.text
    assert http.post("/v1/audio/speech", json={**body, "speed": 2.0}).status_code == 400

    def recent(after: list[Any]) -> dict[str, Any]:
        summary = summarize(delta(after, before))
        for key in ("errors", "requests"):  # counters other tests moved earlier show up as 0 here
            summary[key] = {k: v for k, v in summary[key].items() if v}
        return summary

    def settled() -> bool:
        summary = recent(parse_samples(serve_harness.scrape_metrics()))
        return (summary["time_to_first_audio_s"]["count"], summary["realtime_factor"]["count"],
                sum(summary["requests"].values())) == (2, 2, 3)

    serve_harness.wait_until(settled, timeout_s=60, interval_s=1.0, what="the traffic's metrics")
    after = parse_samples(serve_harness.scrape_metrics())
    # Ray exports a counter from its first increment: no preemption and no failed step in this app, and the
    # speech-input seconds only once some test of this Ray session sent speech (not this one, run alone)
    lazy = {"ray_moss_preemptions_total", "ray_moss_engine_step_failures_total"}
    assert lazy <= used - {s.name for s in after} <= lazy | {"ray_moss_speech_input_seconds_total"}
    assert missing_dashboard_metrics(dashboard, after) == set()
    summary = recent(after)
    assert summary["time_to_first_audio_s"]["count"] == 2
    assert summary["realtime_factor"]["count"] == 2
    assert summary["errors"] == {"invalid_request": 1.0}
    assert summary["requests"] == {"speech 200": 2.0, "speech 400": 1.0}
    assert summary["prefix_cache_hit_rate"] is not None and summary["prefix_cache_hit_rate"] > 0
    assert summarize(after)["replicas"]["moss/LLMServer"]["healthy"] == 1


@pytest.fixture()
def fragile_app(serve_base_url: str) -> Iterator[None]:
    """A second application whose engine calls any step running longer than 1 us hung, and whose LLM replica
    Serve checks every second: its health check fails whenever it lands inside a step."""
    from ray import serve

    from deployments.app import build_app

    args = serve_harness.app_args("tiny")
    args["engine"]["step_timeout_s"] = 1e-6
    # a replica that fails its checks drains like any stopping one (the app's default: request_timeout_s); here
    # 1 s, so the stream it still carries is cut, which is the path this test is about
    args["llm_options"] = {"num_cpus": 0.25, "health_check_period_s": 1, "health_check_timeout_s": 10,
                           "graceful_shutdown_timeout_s": 1}
    args["vocoder_options"] = {"num_cpus": 0.25}
    args["ingress_options"] = {"num_cpus": 0.1}
    serve.run(build_app(args), name=HEALTH_APP, route_prefix=HEALTH_ROUTE)
    yield
    serve.delete(HEALTH_APP)


@pytest.mark.usefixtures("fragile_app")
def test_an_llm_replica_whose_health_check_fails_is_replaced() -> None:
    from ray import serve

    llm = serve.get_deployment_handle("LLMServer", app_name=HEALTH_APP)
    vocoder = serve.get_deployment_handle("VocoderServer", app_name=HEALTH_APP)
    assert llm_replica_states(HEALTH_APP) == {"RUNNING": 1}
    # A long unpaced stream (1400 tokens: the test cache holds 1632 rows) keeps the engine inside a step nearly
    # all the time, so Serve soon sees three failed checks in a row.
    events: list[dict[str, Any]] = []
    streaming = threading.Thread(target=lambda: events.extend(
        vocoder.synthesize.options(stream=True).remote(speech_payload("Keep the engine busy.", 1400))), daemon=True)
    streaming.start()
    seen: list[dict[str, int]] = []

    def replaced() -> bool:
        states = llm_replica_states(HEALTH_APP)
        if not seen or seen[-1] != states:
            seen.append(states)
        return len(seen) > 1 and states == {"RUNNING": 1}

    serve_harness.wait_until(replaced, timeout_s=120, interval_s=0.1, what="the LLM replica to be replaced",
                             last=lambda: seen)
    streaming.join(timeout=60)
    assert not streaming.is_alive()
    # the killed replica's stream ended with an error event (not a hang), and the new replica has served nothing
    assert events and events[-1]["type"] == "error", events[-1:]
    assert llm.stats.remote().result()["prefix_cache_queries"] == 0
