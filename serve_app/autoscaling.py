"""Scaling the engine replicas on what the engine knows (`autoscaling_policy: engine` in AppArgs), not on request
counts: a replica with 64 short chats and one with 64 long contexts hold the same count, but only one has a full KV
pool and a growing queue. Each replica reports its signals through Serve's custom-metrics hook
(`record_autoscaling_stats`, averaged over `look_back_period_s`), and `EngineSignalPolicy` turns them into a
replica count. Serve wraps any policy with `upscale_delay_s` / `downscale_delay_s`, the scaling factors and the
replica bounds (ray/serve/autoscaling_policy.py `_apply_autoscaling_config`), so this file holds only the rules."""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from engine.engine_stats import EngineStats

log = logging.getLogger("ray.serve")  # the policy runs in Serve's controller: its log is where operators look

SIGNALS = ("kv_usage", "waiting", "preemptions_per_s", "ttft_p90_s")
TTFT_WINDOW_S = 60.0  # the p90 is over the first tokens of the last minute


class EngineSignalTargets(BaseModel):
    """When to add and when to remove a replica; each value is the deployment's over Serve's look-back window."""
    model_config = ConfigDict(extra="forbid")

    kv_usage_high: float = Field(default=0.85, gt=0, le=1, description="mean KV pool use above which to add")
    kv_usage_low: float = Field(default=0.40, ge=0, le=1, description="remove only below this")
    waiting_high: float = Field(default=1.0, ge=0, description=(
        "waiting requests per replica above which to add: a queue means the running batch is full"))
    preemptions_high_per_s: float = Field(default=0.1, ge=0, description=(
        "preemptions a second above which to add: the first sign the pool is too small for the contexts"))
    ttft_p90_slo_s: float = Field(default=2.0, gt=0, description="time to first token, p90 over the slowest replica")
    max_step: int = Field(default=1, ge=1, description="replicas added in one decision")


@dataclass(frozen=True)
class DeploymentSignals:
    kv_usage: float  # mean over replicas
    waiting: float  # per replica
    preemptions_per_s: float  # all replicas
    ttft_p90_s: float  # the slowest replica's


def deployment_signals(aggregated: dict | None, replicas: list) -> DeploymentSignals | None:
    """The deployment's signals from Serve's per-replica averages, over the running replicas that have reported (a
    replica just started has not yet); None until one has."""
    reported = [r for r in replicas if aggregated and all(r in aggregated.get(name, {}) for name in SIGNALS)]
    if not reported:
        return None
    per = {name: [aggregated[name][r] for r in reported] for name in SIGNALS}
    return DeploymentSignals(kv_usage=sum(per["kv_usage"]) / len(reported), waiting=sum(per["waiting"]) / len(reported),
                             preemptions_per_s=sum(per["preemptions_per_s"]), ttft_p90_s=max(per["ttft_p90_s"]))


def decide(signals: DeploymentSignals, targets: EngineSignalTargets) -> tuple[str, list[str]]:
    """'up' when any signal is over its target, 'down' when the pool is low with nothing waiting or preempted,
    else 'hold'; with the signals that said so. TTFT is the last minute's, so it counts only while there is load
    (the pool above its low-water mark, or a queue): once the load has gone, old slow first tokens must neither add
    a replica nor keep one."""
    loaded = signals.kv_usage >= targets.kv_usage_low or signals.waiting > 0
    over = [name for name, hot in (
        ("kv_usage", signals.kv_usage > targets.kv_usage_high),
        ("waiting", signals.waiting > targets.waiting_high),
        ("preemptions_per_s", signals.preemptions_per_s > targets.preemptions_high_per_s),
        ("ttft_p90_s", loaded and signals.ttft_p90_s > targets.ttft_p90_slo_s)) if hot]
    if over:
        return "up", over
    idle = not loaded and signals.preemptions_per_s == 0
    return ("down", ["kv_usage", "waiting", "preemptions_per_s"]) if idle else ("hold", [])


class EngineSignalPolicy:
    """Serve's class-callable policy (`policy_kwargs` are EngineSignalTargets' fields). Until a replica has
    reported, it defers to Serve's default request-count policy, so a cold start scales as it always did."""

    def __init__(self, **targets):
        self.targets = EngineSignalTargets(**targets)
        self.last_decision = None

    def __call__(self, ctx) -> tuple[int, dict]:
        signals = deployment_signals(ctx.aggregated_metrics, ctx.running_replicas)
        if signals is None:
            from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

            self._log("no engine signals yet: request count", None, [])
            return replica_queue_length_autoscaling_policy(ctx)
        decision, because = decide(signals, self.targets)
        self._log(decision, signals, because)
        current = ctx.current_num_replicas
        desired = {"up": current + self.targets.max_step, "down": current - 1, "hold": current}[decision]
        bounded = max(ctx.capacity_adjusted_min_replicas, min(ctx.capacity_adjusted_max_replicas, desired))
        return bounded, {"decision": decision, "because": because, **asdict(signals)}

    def _log(self, decision: str, signals: DeploymentSignals | None, because: list[str]) -> None:
        """Each change of mind, with what caused it (the controller calls the policy every 0.1 s)."""
        if decision != self.last_decision:
            self.last_decision = decision
            log.info("engine-signal autoscaling: %s %s %s", decision, because, signals)


class ReplicaSignals:
    """What one engine replica reports to the policy: its engine's stats plus the first tokens it has timed."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.first_tokens: collections.deque[tuple[float, float]] = collections.deque(maxlen=4096)
        self.last_preemptions: tuple[float, float] | None = None  # (time, count)

    def first_token(self, seconds: float) -> None:
        self.first_tokens.append((self.clock(), seconds))

    def report(self, stats: EngineStats) -> dict[str, float]:
        now = self.clock()
        count = float(stats.num_preemptions)
        since, before = self.last_preemptions or (now, count)
        self.last_preemptions = (now, count)
        recent = sorted(s for at, s in self.first_tokens if now - at <= TTFT_WINDOW_S)
        return {"kv_usage": stats.kv_usage, "waiting": float(stats.num_waiting),
                "preemptions_per_s": (count - before) / (now - since) if now > since else 0.0,
                "ttft_p90_s": recent[min(len(recent) - 1, int(0.9 * len(recent)))] if recent else 0.0}
