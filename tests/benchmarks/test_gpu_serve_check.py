"""`make gpu-serve-check` runs end to end on CPU at toy sizes: a local Ray, the app from config.gpu.yaml's args, its
checks over HTTP and a few seconds of streamed load, so what reaches a GPU machine has already run."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.long]  # 40-60 s; run it (make test-all) before the GPU machine does
ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_serve_check_runs_end_to_end_on_cpu(tmp_path):
    command = [sys.executable, "benchmarks/gpu_serve_check.py", "--device", "cpu", "--out", str(tmp_path),
               "--model-dir", str(tmp_path / "model")]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=400)
    report = json.loads((tmp_path / "gpu_serve_check.json").read_text())
    assert run.returncode == 0 and report["failures"] == [], report["failures"] or run.stdout[-3000:]
    args = report["app_args"]
    assert args["topology"] == "colocated" and args["engine_config"]["model"].startswith(str(tmp_path)), args
    served, alone = report["served"], report["engine_alone"]
    assert served["requests"] > 0 and served["errors"] == 0 and served["short"] == 0
    assert served["tokens"] == served["requests"] * report["load"]["max_tokens"], "each stream's usage counted"
    assert 0 < served["ttft_s"]["p50"] <= served["e2e_s"]["p50"] and alone["tok_s"] > 0
    assert "all checks passed" in (tmp_path / "gpu_serve_check.log").read_text()
