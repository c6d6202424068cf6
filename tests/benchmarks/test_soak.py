"""The soak report's arithmetic (pure logic: records and rows are built here)."""
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from soak import client_minutes, verdict  # noqa: E402


def test_client_minutes_bin_requests_by_when_they_finished():
    records = [{"start": 0.0, "e2e": 10.0, "ok": True}, {"start": 30.0, "e2e": 20.0, "ok": True},  # minute 1
               {"start": 50.0, "e2e": 20.0, "ok": False}, {"start": 100.0, "e2e": 30.0, "ok": True}]  # minutes 2, 3
    rows = client_minutes(records, 0.0, 3)
    assert [r["req/h"] for r in rows] == [120, 0, 60] and [r["failed"] for r in rows] == [0, 1, 0]
    assert rows[0]["p95 s"] > 19 and math.isnan(rows[1]["p95 s"])


def minutes(n: int, steps=10.0, rph=3600.0, rss=1000.0, failed=0, late=None) -> list[dict]:
    rows = [{"steps/s": steps, "tokens/step": 30.0, "req/h": rph, "RSS MiB": rss, "failed": failed} for _ in range(n)]
    for row in rows[-5:]:
        row.update(late or {})
    return rows


def test_verdict_passes_a_flat_run_and_fails_drift_growth_or_failures():
    assert verdict(minutes(30))["pass"]
    assert not verdict(minutes(30, late={"steps/s": 9.0}))["pass"]  # the step rate fell 10%
    assert not verdict(minutes(30, late={"RSS MiB": 1200.0}))["pass"]  # memory grew 20%
    assert not verdict(minutes(30, failed=1))["pass"]
    assert abs(verdict(minutes(30, late={"req/h": 3500.0}))["rph_change"] + 0.0278) < 1e-3


def test_a_step_rate_that_follows_the_batch_is_not_drift_but_slower_steps_of_the_same_size_are():
    def step_rate(tokens: float, slower: float = 1.0) -> float:  # steps of 20 ms + 1 ms a token
        return 1000 / ((20 + tokens) * slower)

    early_batches = [20, 40, 30, 50, 25, 35]
    rows = [{"steps/s": step_rate(t), "tokens/step": t, "req/h": 3600.0, "RSS MiB": 1000.0, "failed": 0}
            for t in [30] + early_batches + [30] * 18 + [60] * 5]  # the last 5 minutes run twice the batch
    result = verdict(rows)
    assert result["step_rate_change"] < -0.3 and abs(result["step_time_drift"]) < 1e-6 and result["pass"]
    for row in rows[-5:]:
        row["steps/s"] = step_rate(60, slower=1.1)
    assert abs(verdict(rows)["step_time_drift"] - 0.1) < 1e-6 and not verdict(rows)["pass"]
