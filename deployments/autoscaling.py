"""Custom Ray Serve autoscaling policies for the LLM and vocoder deployments.

Ray Serve 2.60 calls a deployment-scoped policy every control-loop tick (~0.1 s) with an
``AutoscalingContext`` and expects ``(desired_replicas, policy_state)`` back. ``policy_kwargs`` from
``autoscaling_config.policy`` reach only *class* policies (Ray instantiates the class once with them and
calls the instance), so ``llm_policy`` and ``vocoder_policy`` name classes. Ray pickles this module by
value into the controller: it imports nothing from the project.

Each policy reads per-replica values from ``ctx.aggregated_metrics`` (what the deployments return from
``record_autoscaling_stats``, averaged by Ray over ``look_back_period_s``), reduces them to one fleet
value per signal and classifies the tick:

- *hot*: any signal above its ``*_high`` threshold. The policy adds ``step`` replicas, but only once all
  replicas it asked for are running and have been running for ``upscale_cooldown_s`` (so a new replica
  gets a chance to take load before the next one is asked for).
- *quiet*: every signal below its ``*_low`` threshold, with load-proportional signals projected onto
  the smaller fleet (``value * n / (n - step)``), so removing a replica cannot by itself make the fleet
  hot again. Only after ``quiet_period_s`` of uninterrupted quiet ticks does it remove ``step`` replicas;
  the quiet clock then restarts.
- anything else (between the thresholds, or no metrics yet): hold, and restart the quiet clock.

A tick that is not quiet also drops a lower desired count that Ray has not carried out (its own
``downscale_delay_s`` still running, or its cold start from zero replicas): the policy then asks for Ray's
current target, so Ray never removes a replica from a fleet that turned busy meanwhile.

The policy keeps its own desired count in the state and returns it every tick, so Ray's own
``upscale_delay_s`` / ``downscale_delay_s`` (applied on top of custom policies) still work; set them to 0
to let this policy's cooldown and quiet period alone govern timing. The result is always clamped to
``[capacity_adjusted_min_replicas, capacity_adjusted_max_replicas]``.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

Reduce = Literal["mean", "max"]

# Keys this module owns inside the policy state (Ray adds its own delay-logic keys beside them).
DESIRED_KEY = "moss_desired_replicas"
SETTLED_SINCE_KEY = "moss_settled_since"
QUIET_SINCE_KEY = "moss_quiet_since"
REASON_KEY = "moss_reason"


class AutoscalingContextLike(Protocol):
    """The attributes of ``ray.serve.config.AutoscalingContext`` these policies read."""

    current_num_replicas: int
    target_num_replicas: int
    capacity_adjusted_min_replicas: int
    capacity_adjusted_max_replicas: int
    policy_state: dict[str, Any]
    current_time: float | None
    aggregated_metrics: dict[str, dict[Any, float]] | None


@dataclass(frozen=True)
class Signal:
    """One scaling signal: a custom metric, how replicas are combined, and its two thresholds.

    ``scales_with_load`` marks signals that grow as the fleet shrinks (KV use, queue, batch occupancy);
    they are projected onto the smaller fleet before being compared with ``low``.
    """

    metric: str
    reduce: Reduce
    high: float
    low: float
    scales_with_load: bool

    def __post_init__(self) -> None:
        if not self.low < self.high:
            raise ValueError(f"{self.metric}: low threshold {self.low} must be below high {self.high}")


def _reduce(values: list[float], how: Reduce) -> float:
    return max(values) if how == "max" else sum(values) / len(values)


class HysteresisPolicy:
    """Scale up fast on any hot signal, scale down slowly after a quiet period (see module docstring)."""

    def __init__(self, signals: list[Signal], *, upscale_cooldown_s: float, quiet_period_s: float,
                 step: int) -> None:
        if step < 1:
            raise ValueError(f"step must be >= 1, got {step}")
        if upscale_cooldown_s < 0 or quiet_period_s < 0:
            raise ValueError("upscale_cooldown_s and quiet_period_s must be >= 0")
        self.signals = signals
        self.upscale_cooldown_s = float(upscale_cooldown_s)
        self.quiet_period_s = float(quiet_period_s)
        self.step = int(step)

    def classify(self, metrics: Mapping[str, Mapping[Any, float]], min_replicas: int = 1) -> tuple[str, str]:
        """Return ``(verdict, reason)``; verdict is ``"hot"``, ``"quiet"``, ``"hold"`` or ``"no_data"``.
        Load-proportional signals are projected onto the fleet a step down would leave, which is never
        smaller than ``min_replicas``."""
        quiet = True
        missing = []
        for signal in self.signals:
            per_replica = metrics.get(signal.metric)
            if not per_replica:
                missing.append(signal.metric)
                continue
            values = list(per_replica.values())
            value = _reduce(values, signal.reduce)
            if value > signal.high:
                return "hot", f"{signal.metric} {value:.3g} > {signal.high:.3g}"
            if signal.scales_with_load:
                n = len(values)
                value = value * n / max(n - self.step, min_replicas, 1)
            if not value < signal.low:
                quiet = False
        if missing:  # any hot signal wins above; without every signal, never call the fleet quiet
            return "no_data", f"no {', '.join(missing)} reported"
        return ("quiet", "all signals below low thresholds") if quiet else ("hold", "between thresholds")

    def __call__(self, ctx: AutoscalingContextLike) -> tuple[int, dict[str, Any]]:
        """One control-loop decision: ``(desired_replicas, new_policy_state)``."""
        now = ctx.current_time if ctx.current_time is not None else time.time()
        state = dict(ctx.policy_state or {})
        lo, hi = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        desired = int(state.get(DESIRED_KEY, ctx.target_num_replicas))
        desired = min(max(desired, lo), hi)

        settled_since = state.get(SETTLED_SINCE_KEY)
        if ctx.current_num_replicas != desired:
            settled_since = None
        elif settled_since is None:
            settled_since = now
        quiet_since = state.get(QUIET_SINCE_KEY)

        verdict, reason = self.classify(ctx.aggregated_metrics or {}, lo)
        if verdict != "quiet" and desired < ctx.target_num_replicas:
            # a scale-down not carried out yet (Ray's downscale_delay_s still runs) or one Ray never asked
            # for (its cold start from 0 replicas) is dropped once the fleet is not quiet: returning the lower
            # count would let Ray remove a replica from a busy fleet
            desired = min(ctx.target_num_replicas, hi)
            settled_since = now if ctx.current_num_replicas == desired else None
        if verdict == "hot":
            quiet_since = None
            is_settled = settled_since is not None and now - settled_since >= self.upscale_cooldown_s
            if desired < hi and is_settled:
                desired = min(desired + self.step, hi)
                settled_since = None
                reason = f"up: {reason}"
            else:
                reason = f"hot, waiting: {reason}"
        elif verdict == "quiet":
            if quiet_since is None:
                quiet_since = now
            if desired > lo and now - quiet_since >= self.quiet_period_s:
                desired = max(desired - self.step, lo)
                quiet_since = now  # each further step down needs its own quiet period
                settled_since = None
                reason = f"down: {reason}"
        else:
            quiet_since = None

        state.update({DESIRED_KEY: desired, SETTLED_SINCE_KEY: settled_since,
                      QUIET_SINCE_KEY: quiet_since, REASON_KEY: reason})
        return desired, state


class LLMPolicy(HysteresisPolicy):
    """LLM deployment policy over ``kv_cache_usage``, ``num_waiting`` and ``ttfa_p90_s``.

    policy_kwargs (all optional):
      kv_usage_high (0.85) / kv_usage_low (0.6): fleet-mean KV cache use (0..1).
      waiting_high (1.0) / waiting_low (0.5): fleet-mean requests waiting in the engine per replica.
      ttfa_p90_high_s (1.0) / ttfa_p90_low_s (0.5): worst replica's recent p90 time from a request
        reaching the LLM replica to its first codes (the LLM's share of time to first audio, without the
        vocoder's first chunk or the hops; a replica with no recent requests reports 0).
      upscale_cooldown_s (30), quiet_period_s (300), step (1): see the module docstring.
    """

    def __init__(self, *, kv_usage_high: float = 0.85, kv_usage_low: float = 0.6,
                 waiting_high: float = 1.0, waiting_low: float = 0.5,
                 ttfa_p90_high_s: float = 1.0, ttfa_p90_low_s: float = 0.5,
                 upscale_cooldown_s: float = 30.0, quiet_period_s: float = 300.0, step: int = 1) -> None:
        super().__init__(
            [Signal("kv_cache_usage", "mean", kv_usage_high, kv_usage_low, scales_with_load=True),
             Signal("num_waiting", "mean", waiting_high, waiting_low, scales_with_load=True),
             Signal("ttfa_p90_s", "max", ttfa_p90_high_s, ttfa_p90_low_s, scales_with_load=False)],
            upscale_cooldown_s=upscale_cooldown_s, quiet_period_s=quiet_period_s, step=step)


class VocoderPolicy(HysteresisPolicy):
    """Vocoder deployment policy over ``batch_occupancy``, ``busy_fraction`` and ``lag_s``.

    policy_kwargs (all optional; a pair of marks both None leaves that signal out):
      occupancy_high (0.85) / occupancy_low (0.5): fleet-mean batch occupancy (0..1). A replica's occupancy is
        its mean rows per step over the vocoder's step cap, so one that serves anything reports at least
        1/cap: at a cap of 2 every serving replica reads 0.5 or more, and the signal only says which
        replicas serve.
      busy_high (None) / busy_low (None): fleet-mean share of the last 30 s in which some vocoder call ran, on
        any lane (0..1): load at any step cap; projected onto the smaller fleet like occupancy.
      lag_high_s (0.5) / lag_low_s (0.1): worst replica's lag behind real time, seconds.
      upscale_cooldown_s (30), quiet_period_s (300), step (1): see the module docstring.
    """

    def __init__(self, *, occupancy_high: float | None = 0.85, occupancy_low: float | None = 0.5,
                 busy_high: float | None = None, busy_low: float | None = None,
                 lag_high_s: float = 0.5, lag_low_s: float = 0.1,
                 upscale_cooldown_s: float = 30.0, quiet_period_s: float = 300.0, step: int = 1) -> None:
        signals = []
        for metric, high, low in (("batch_occupancy", occupancy_high, occupancy_low),
                                  ("busy_fraction", busy_high, busy_low)):
            if (high is None) != (low is None):
                raise ValueError(f"{metric}: its high and low marks are both numbers or both None (no signal)")
            if high is not None:
                signals.append(Signal(metric, "mean", high, low, scales_with_load=True))
        signals.append(Signal("lag_s", "max", lag_high_s, lag_low_s, scales_with_load=False))
        super().__init__(signals, upscale_cooldown_s=upscale_cooldown_s, quiet_period_s=quiet_period_s, step=step)


# The import paths named in docs/contracts.md and config/*.yaml (`deployments.autoscaling:llm_policy`).
llm_policy = LLMPolicy
vocoder_policy = VocoderPolicy
