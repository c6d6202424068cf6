"""benchmarks/replica_start.py, one start: each phase a positive time, the total from the spawn covering them."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_the_replica_start_benchmark_times_each_phase(tmp_path):
    out = tmp_path / "replica-start.json"
    run = subprocess.run([sys.executable, "benchmarks/replica_start.py", "--runs", "1", "--config",
                          '{"dtype": "float32", "num_kv_blocks": 64}', "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["config"]["engine_process"] and report["config"]["num_kv_blocks"] == 64
    start, = report["runs"]
    assert all(start[phase] > 0 for phase in ("imports", "core_ready", "front_end_warm_up"))
    assert start["total"] > start["imports"] + start["core_ready"] + start["front_end_warm_up"]
    assert report["medians"] == start
