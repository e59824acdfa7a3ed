"""Autoscaling policies fed synthetic metric histories: exact replica decisions tick by tick."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from deployments.autoscaling import (
    DESIRED_KEY,
    REASON_KEY,
    HysteresisPolicy,
    LLMPolicy,
    VocoderPolicy,
    llm_policy,
    vocoder_policy,
)

IDLE_LLM = {"kv_cache_usage": 0.1, "num_waiting": 0.0, "ttfa_p90_s": 0.0}


@dataclass
class FakeContext:
    """The attributes of ray.serve.config.AutoscalingContext that the policies read."""

    current_num_replicas: int
    target_num_replicas: int
    capacity_adjusted_min_replicas: int
    capacity_adjusted_max_replicas: int
    current_time: float
    aggregated_metrics: dict[str, dict[Any, float]]
    policy_state: dict[str, Any] = field(default_factory=dict)


def per_replica(values: dict[str, float | list[float]], num_replicas: int) -> dict[str, dict[str, float]]:
    """Same value on every replica, or one value per replica when a list is given."""
    out: dict[str, dict[str, float]] = {}
    for name, value in values.items():
        vals = value if isinstance(value, list) else [value] * num_replicas
        out[name] = {f"replica-{i}": v for i, v in enumerate(vals)}
    return out


def simulate(policy: HysteresisPolicy, history: list[dict[str, float | list[float]]], *, start: int,
             lo: int = 1, hi: int = 4, start_delay_ticks: int = 0, tick_s: float = 1.0) -> list[int]:
    """Drive the policy one tick per history entry, the way Ray's controller does.

    A replica asked for starts ``start_delay_ticks`` ticks after the decision; removals are immediate.
    Returns the decision of every tick.
    """
    state: dict[str, Any] = {}
    target = current = start
    pending: list[int] = []  # ticks at which one more replica becomes running
    decisions = []
    for tick, values in enumerate(history):
        current += sum(1 for t in pending if t <= tick)
        pending = [t for t in pending if t > tick]
        ctx = FakeContext(current, target, lo, hi, tick * tick_s, per_replica(values, current), dict(state))
        decision, state = policy(ctx)
        if decision > target:
            pending += [tick + 1 + start_delay_ticks] * (decision - target)
        elif decision < target:
            current = min(current, decision)
        target = decision
        decisions.append(decision)
    return decisions


def test_scales_up_on_kv_pressure_one_step_per_cooldown_up_to_max() -> None:
    policy = LLMPolicy(upscale_cooldown_s=3, quiet_period_s=10)
    hot = {**IDLE_LLM, "kv_cache_usage": 0.9}
    assert simulate(policy, [hot] * 14, start=1) == [1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4]


def test_scales_up_on_slow_first_audio_of_the_worst_replica() -> None:
    policy = LLMPolicy(upscale_cooldown_s=0, ttfa_p90_high_s=1.0)
    ctx = FakeContext(2, 2, 1, 4, 0.0, per_replica({**IDLE_LLM, "ttfa_p90_s": [1.5, 0.0]}, 2))
    decision, state = policy(ctx)
    assert decision == 3
    assert state[REASON_KEY] == "up: ttfa_p90_s 1.5 > 1"
    assert state[DESIRED_KEY] == 3


def test_scales_up_on_queue_but_not_at_the_threshold() -> None:
    policy = LLMPolicy(upscale_cooldown_s=0, waiting_high=2.0)
    at_threshold = FakeContext(2, 2, 1, 4, 0.0, per_replica({**IDLE_LLM, "num_waiting": [2.0, 2.0]}, 2))
    assert policy(at_threshold)[0] == 2
    above = FakeContext(2, 2, 1, 4, 0.0, per_replica({**IDLE_LLM, "num_waiting": [5.0, 0.0]}, 2))
    decision, state = policy(above)
    assert (decision, state[REASON_KEY]) == (3, "up: num_waiting 2.5 > 2")


def test_scales_down_one_step_per_quiet_period_and_stops_at_min() -> None:
    policy = LLMPolicy(quiet_period_s=4)
    decisions = simulate(policy, [IDLE_LLM] * 12, start=3)
    assert decisions == [3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1]


def test_no_scale_down_when_the_smaller_fleet_would_be_hot_again() -> None:
    # 0.4 each on 2 replicas projects to 0.8 on one replica: not below kv_usage_low (0.6).
    policy = LLMPolicy(quiet_period_s=2)
    assert simulate(policy, [{**IDLE_LLM, "kv_cache_usage": 0.4}] * 8, start=2) == [2] * 8
    # 0.25 each projects to 0.5: quiet, so it steps down after the quiet period.
    assert simulate(policy, [{**IDLE_LLM, "kv_cache_usage": 0.25}] * 4, start=2) == [2, 2, 1, 1]


def test_no_flapping_when_load_alternates_between_quiet_and_the_middle_band() -> None:
    policy = LLMPolicy(quiet_period_s=3)
    noise = [{**IDLE_LLM, "kv_cache_usage": 0.7 if i % 2 else 0.1} for i in range(40)]
    assert simulate(policy, noise, start=3) == [3] * 40


def test_alternating_hot_and_quiet_only_ever_scales_up() -> None:
    policy = LLMPolicy(upscale_cooldown_s=2, quiet_period_s=3)
    noise = [{**IDLE_LLM, "kv_cache_usage": 0.95 if i % 2 == 0 else 0.05} for i in range(14)]
    assert simulate(policy, noise, start=1) == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4]


def test_a_quiet_spell_shorter_than_the_period_is_forgotten_after_one_busy_tick() -> None:
    policy = LLMPolicy(quiet_period_s=3)
    history = [IDLE_LLM, IDLE_LLM, IDLE_LLM, {**IDLE_LLM, "num_waiting": 0.8}] + [IDLE_LLM] * 5
    assert simulate(policy, history, start=2) == [2, 2, 2, 2, 2, 2, 2, 1, 1]


def test_no_second_scale_up_while_the_first_new_replica_is_still_starting() -> None:
    policy = LLMPolicy(upscale_cooldown_s=0)
    hot = {**IDLE_LLM, "kv_cache_usage": 0.9}
    assert simulate(policy, [hot] * 8, start=1, start_delay_ticks=3) == [2, 2, 2, 2, 3, 3, 3, 3]


def test_decisions_are_clamped_to_the_capacity_adjusted_bounds() -> None:
    policy = LLMPolicy(upscale_cooldown_s=0, quiet_period_s=0)
    above_max = FakeContext(6, 6, 1, 4, 0.0, per_replica({**IDLE_LLM, "kv_cache_usage": 0.7}, 6))
    assert policy(above_max)[0] == 4
    below_min = FakeContext(0, 0, 2, 4, 0.0, {})
    assert policy(below_min)[0] == 2
    hot = {**IDLE_LLM, "kv_cache_usage": 0.99}
    assert simulate(policy, [hot] * 3, start=3, hi=3) == [3, 3, 3]
    assert simulate(policy, [IDLE_LLM] * 3, start=2, lo=2) == [2, 2, 2]


def test_missing_metrics_hold_and_keep_the_quiet_clock_stopped() -> None:
    policy = LLMPolicy(quiet_period_s=2)
    history: list[dict[str, float | list[float]]] = [{}, {}, {}, IDLE_LLM, IDLE_LLM, IDLE_LLM]
    assert simulate(policy, history, start=2) == [2, 2, 2, 2, 2, 1]
    decision, state = policy(FakeContext(2, 2, 1, 4, 0.0, {"kv_cache_usage": {"replica-0": 0.1}}))
    assert (decision, state[REASON_KEY]) == (2, "no num_waiting, ttfa_p90_s reported")
    # A hot signal still scales up while another one is missing.
    hot_queue = FakeContext(2, 2, 1, 4, 0.0, {"num_waiting": {"replica-0": 3.0, "replica-1": 1.0}})
    assert LLMPolicy(upscale_cooldown_s=0)(hot_queue)[1][REASON_KEY] == "up: num_waiting 2 > 1"


def test_ray_internal_state_keys_survive_and_the_input_state_is_not_mutated() -> None:
    policy = LLMPolicy()
    state_in = {"__decision_counters": -3}
    ctx = FakeContext(1, 1, 1, 4, 5.0, per_replica(IDLE_LLM, 1), state_in)
    _, state_out = policy(ctx)
    assert state_out["__decision_counters"] == -3
    assert state_in == {"__decision_counters": -3}


def test_vocoder_policy_scales_on_lag_and_occupancy_and_down_after_quiet() -> None:
    policy = VocoderPolicy(upscale_cooldown_s=0, quiet_period_s=2)
    lagging = {"batch_occupancy": 0.2, "lag_s": [0.0, 0.8]}
    decision, state = policy(FakeContext(2, 2, 1, 4, 0.0, per_replica(lagging, 2)))
    assert (decision, state[REASON_KEY]) == (3, "up: lag_s 0.8 > 0.5")
    full = {"batch_occupancy": 0.9, "lag_s": 0.0}
    assert simulate(policy, [full] * 3, start=1) == [2, 3, 4]
    idle = {"batch_occupancy": 0.1, "lag_s": 0.0}
    assert simulate(policy, [idle] * 5, start=3) == [3, 3, 2, 2, 1]


def test_invalid_policy_kwargs_are_rejected() -> None:
    with pytest.raises(ValueError, match="kv_cache_usage: low threshold 0.9 must be below high 0.8"):
        LLMPolicy(kv_usage_high=0.8, kv_usage_low=0.9)
    with pytest.raises(ValueError, match="step must be >= 1"):
        VocoderPolicy(step=0)
    with pytest.raises(TypeError):
        LLMPolicy(kv_high=0.9)  # type: ignore[call-arg]


def test_ray_resolves_the_import_paths_to_policies_built_with_policy_kwargs() -> None:
    """Ray 2.60 instantiates class policies with policy_kwargs and wraps them with its delay logic."""
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    config = AutoscalingConfig(
        min_replicas=1, max_replicas=3, upscale_delay_s=0, downscale_delay_s=0,
        policy={"policy_function": "deployments.autoscaling:llm_policy",
                "policy_kwargs": {"kv_usage_high": 0.5, "kv_usage_low": 0.2, "upscale_cooldown_s": 0}})
    resolved = _resolve_policy_callable(config.policy)
    assert type(resolved).__name__ == "LLMPolicy"
    assert resolved.signals[0].high == 0.5
    policy = _apply_autoscaling_config(resolved)
    ctx = AutoscalingContext(
        deployment_id=None, deployment_name="LLM", app_name="moss", current_num_replicas=1,
        target_num_replicas=1, running_replicas=["r0"], total_num_requests=1.0, total_queued_requests=0.0,
        aggregated_metrics=per_replica({**IDLE_LLM, "kv_cache_usage": 0.6}, 1), raw_metrics={},
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=3, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=100.0, config=config)
    decision, state = policy(ctx)
    assert decision == 2
    assert state[DESIRED_KEY] == 2
    assert llm_policy is LLMPolicy and vocoder_policy is VocoderPolicy


def test_ray_upscale_delay_still_applies_because_the_policy_repeats_its_decision(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray applies upscale_delay_s on top of custom policies with its own wall clock; the policy must
    keep asking for the same count for the whole delay, or Ray's delay would restart every tick."""
    import types

    import ray.serve.autoscaling_policy as ray_policy
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    clock = [1000.0]
    monkeypatch.setattr(ray_policy, "time", types.SimpleNamespace(time=lambda: clock[0]))
    config = AutoscalingConfig(min_replicas=1, max_replicas=3, upscale_delay_s=5, downscale_delay_s=0)
    policy = ray_policy._apply_autoscaling_config(LLMPolicy(upscale_cooldown_s=0))
    state: dict[str, Any] = {}
    target = 1
    decisions = []
    for tick in range(8):
        clock[0] = 1000.0 + tick
        ctx = AutoscalingContext(
            deployment_id=None, deployment_name="LLM", app_name="moss", current_num_replicas=target,
            target_num_replicas=target, running_replicas=[], total_num_requests=4.0,
            total_queued_requests=0.0, raw_metrics={},
            aggregated_metrics=per_replica({**IDLE_LLM, "num_waiting": 3.0}, target),
            capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=3, policy_state=state,
            last_scale_up_time=None, last_scale_down_time=None, current_time=clock[0], config=config)
        target, state = policy(ctx)
        decisions.append(target)
    assert decisions == [1, 1, 1, 1, 1, 2, 2, 2]


def test_a_pending_scale_down_is_dropped_when_the_fleet_turns_hot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through Ray's own wrapper with downscale_delay_s 60: the policy asks for 1 replica after a quiet
    period; the load turns hot before Ray's delay is over. The policy asks for Ray's target (2) again, so
    Ray never removes a replica from the hot fleet; it adds one once the cooldown has passed."""
    import types

    import ray.serve.autoscaling_policy as ray_policy
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    clock = [1000.0]
    monkeypatch.setattr(ray_policy, "time", types.SimpleNamespace(time=lambda: clock[0]))
    config = AutoscalingConfig(min_replicas=1, max_replicas=4, upscale_delay_s=0, downscale_delay_s=60)
    policy = ray_policy._apply_autoscaling_config(LLMPolicy(upscale_cooldown_s=30, quiet_period_s=10))
    hot = {"kv_cache_usage": 0.95, "num_waiting": 4.0, "ttfa_p90_s": 2.0}
    state: dict[str, Any] = {}
    target = 2
    targets, desired = [], []
    for t in range(0, 91, 5):
        clock[0] = 1000.0 + t
        ctx = AutoscalingContext(
            deployment_id=None, deployment_name="LLM", app_name="moss", current_num_replicas=target,
            target_num_replicas=target, running_replicas=[], total_num_requests=1.0, total_queued_requests=0.0,
            raw_metrics={}, aggregated_metrics=per_replica(IDLE_LLM if t < 20 else hot, target),
            capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4, policy_state=dict(state),
            last_scale_up_time=None, last_scale_down_time=None, current_time=clock[0], config=config)
        target, state = policy(ctx)
        targets.append(target)
        desired.append(state[DESIRED_KEY])
    assert desired[2:4] == [1, 1]  # quiet for 10 s: the policy asks for one replica fewer
    assert min(targets) == 2  # Ray's delay still ran when the load turned hot at t=20: nothing removed
    assert targets == [2] * 10 + [3] * 7 + [4] * 2  # up at t=50 (30 s after t=20), again at t=85


def test_a_cold_started_replica_is_kept_under_load() -> None:
    """min_replicas 0: Ray starts a replica for the first requests without asking the policy, whose desired
    count is still 0. Under load the policy keeps that replica (it used to ask for 0 again: a flap)."""
    policy = LLMPolicy(upscale_cooldown_s=30)
    hot = {"kv_cache_usage": 0.95, "num_waiting": 4.0, "ttfa_p90_s": 2.0}
    ctx = FakeContext(1, 1, 0, 4, 100.0, per_replica(hot, 1), {DESIRED_KEY: 0})
    decision, state = policy(ctx)
    assert decision == 1 and state[REASON_KEY] == "hot, waiting: kv_cache_usage 0.95 > 0.85"
    ctx = FakeContext(1, 1, 0, 4, 131.0, per_replica(hot, 1), state)
    assert policy(ctx)[0] == 2  # settled for the cooldown: one more


def test_the_scale_down_projection_stops_at_the_minimum() -> None:
    """step 2 with min 3 at 4 replicas: a step down can only reach 3, where KV use 0.35 x 4 / 3 = 0.47 is
    quiet; projected onto 2 replicas (0.70) it was not, and the fleet held at 4 for ever."""
    policy = LLMPolicy(quiet_period_s=10, step=2)
    decisions = simulate(policy, [{**IDLE_LLM, "kv_cache_usage": 0.35}] * 12, start=4, lo=3, hi=6)
    assert decisions == [4] * 10 + [3, 3]
