"""The engine-signal autoscaling policy on recorded contexts (Serve's own AutoscalingContext), and the replica's
report from engine stats."""
import msgspec
import pytest
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from engine.engine_stats import EngineStats
from serve_app.autoscaling import SIGNALS, EngineSignalPolicy, EngineSignalTargets, ReplicaSignals, decide, DeploymentSignals

CALM = {"kv_usage": 0.5, "waiting": 0.0, "preemptions_per_s": 0.0, "ttft_p90_s": 0.5}
IDLE = {"kv_usage": 0.1, "waiting": 0.0, "preemptions_per_s": 0.0, "ttft_p90_s": 0.2}


def context(per_replica: list[dict] | None, current: int = 2, low: int = 1, high: int = 4,
            requests: float = 0.0) -> AutoscalingContext:
    replicas = [f"r{i}" for i in range(current)]
    aggregated = None if per_replica is None else {
        name: {r: values[name] for r, values in zip(replicas, per_replica) if name in values} for name in SIGNALS}
    return AutoscalingContext(
        deployment_id=None, deployment_name="EngineReplica", app_name="llm", current_num_replicas=current,
        target_num_replicas=current, running_replicas=replicas, total_num_requests=requests, total_queued_requests=0.0,
        aggregated_metrics=aggregated, raw_metrics=None, capacity_adjusted_min_replicas=low,
        capacity_adjusted_max_replicas=high, policy_state={}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=0.0, config=AutoscalingConfig(min_replicas=low, max_replicas=high, target_ongoing_requests=64))


@pytest.mark.parametrize("hot,value", [("kv_usage", 0.9), ("waiting", 3.0), ("preemptions_per_s", 0.5), ("ttft_p90_s", 4.0)])
def test_any_signal_over_its_target_adds_a_replica(hot, value):
    """Pool use and the queue are averaged over the replicas (one hot replica beside idle ones is the router's to
    balance, not a lack of capacity); preemptions add up; TTFT is the slowest replica's."""
    other = {**CALM, hot: value} if hot == "kv_usage" else CALM
    desired, state = EngineSignalPolicy()(context([other, {**CALM, hot: value}]))
    assert desired == 3 and state["decision"] == "up" and state["because"] == [hot]


def test_a_full_pool_scales_out_while_the_request_count_is_still_low():
    """The issue's case: 8 long-context requests fill the pool; the default policy, at 64 a replica, holds."""
    full = context([{**CALM, "kv_usage": 0.97}], current=1, requests=8)
    assert EngineSignalPolicy()(full)[0] == 2


def test_removing_needs_a_low_pool_an_empty_queue_and_no_preemptions():
    assert EngineSignalPolicy()(context([IDLE, IDLE]))[0] == 1
    for name, value in [("kv_usage", 0.8), ("waiting", 0.2), ("preemptions_per_s", 0.01)]:
        desired, state = EngineSignalPolicy()(context([IDLE, {**IDLE, name: value}]))
        assert desired == 2 and state["decision"] == "hold", name


def test_slow_first_tokens_count_only_while_there_is_load():
    """TTFT p90 is the last minute's: after a burst it stays high with nothing running. (The ramp benchmark held
    an extra replica for the whole quiet phase on that.)"""
    after_the_burst = {**IDLE, "ttft_p90_s": 100.0}
    assert EngineSignalPolicy()(context([after_the_burst] * 2))[0] == 1
    under_load = {**CALM, "ttft_p90_s": 100.0}
    assert EngineSignalPolicy()(context([under_load] * 2))[0] == 3


def test_decisions_stay_within_the_bounds_and_the_step():
    hot = {**CALM, "kv_usage": 0.99}
    assert EngineSignalPolicy()(context([hot] * 4, current=4, high=4))[0] == 4
    assert EngineSignalPolicy()(context([IDLE], current=1, low=1))[0] == 1
    assert EngineSignalPolicy(max_step=3)(context([hot, hot], current=2, high=4))[0] == 4


def test_until_a_replica_reports_the_request_count_policy_decides():
    """Serve's default: ongoing requests against target_ongoing_requests (64 here)."""
    assert EngineSignalPolicy()(context(None, current=2, requests=256))[0] == 4
    assert EngineSignalPolicy()(context([{"kv_usage": 0.99}, {}], current=2, requests=256))[0] == 4


def test_a_replica_that_has_not_reported_yet_is_left_out():
    """A replica just added has no averages yet: the others decide, so it is not removed before it reports."""
    hot = {**CALM, "kv_usage": 0.95}
    desired, state = EngineSignalPolicy()(context([hot, hot, {}], current=3, high=4))
    assert desired == 4 and state["kv_usage"] == pytest.approx(0.95)


def test_targets_are_validated():
    with pytest.raises(ValueError):
        EngineSignalTargets(kv_usage_high=1.5)
    with pytest.raises(ValueError):
        EngineSignalPolicy(unknown=1)
    assert decide(DeploymentSignals(**CALM), EngineSignalTargets()) == ("hold", [])


def test_a_replica_reports_pool_use_queue_preemption_rate_and_ttft_p90():
    now = [100.0]
    signals = ReplicaSignals(clock=lambda: now[0])
    stats = EngineStats(kv_blocks_total=100, kv_blocks_free=25, num_waiting=3, num_preemptions=10)
    first = signals.report(stats)
    assert first == {"kv_usage": 0.75, "waiting": 3.0, "preemptions_per_s": 0.0, "ttft_p90_s": 0.0}
    for seconds in [0.1] * 9 + [2.0]:
        signals.first_token(seconds)
    now[0] = 110.0
    second = signals.report(msgspec.structs.replace(stats, num_preemptions=15))
    assert second["preemptions_per_s"] == pytest.approx(0.5) and second["ttft_p90_s"] == 2.0
    now[0] = 200.0  # a minute later the old first tokens no longer count
    assert signals.report(msgspec.structs.replace(stats, num_preemptions=15))["ttft_p90_s"] == 0.0
