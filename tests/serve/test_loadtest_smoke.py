"""CI smoke load: half a minute of Locust against the embedded app; any failed request, or none done, fails it."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_half_a_minute_of_load_completes_requests_and_fails_none(base_url, serve_app, tmp_path):
    cmd = [sys.executable, "-m", "loadtest.run", "--url", base_url, "--users", "6", "--duration", "25", "--warmup", "5",
           "--max-tokens", "48", "--target-rph", "0", "--p95-e2e-slo", "120", "--api-key", serve_app["api_key"],
           "--prometheus", "", "--label", "smoke", "--out-dir", str(tmp_path)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    summary = json.loads(next(tmp_path.glob("*/summary.json")).read_text())
    assert summary["requests_failed"] == 0, summary["errors"]
    # a smoke test, not a throughput test: a 2-core AVX2 VM completed 6 to 12 in the 20 s steady state (its prefill
    # of the load test's prompts is slow), a faster one dozens; throughput is measured by make loadtest
    assert summary["requests_ok"] >= 4 and r.returncode == 0, (summary["requests_ok"], r.stdout[-2000:])
    for name in ("throughput.png", "latency.png", "smoke.html", "smoke_stats.csv"):
        assert next(tmp_path.glob(f"*/{name}")).stat().st_size > 0, name
