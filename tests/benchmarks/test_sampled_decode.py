"""benchmarks/sampled_decode.py at toy sizes: a row for greedy and for each temperature, every figure positive."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_sampled_decode_benchmark_runs(tmp_path):
    out = tmp_path / "sampled.json"
    run = subprocess.run([sys.executable, "benchmarks/sampled_decode.py", "--batch", "3", "--tokens", "4", "--rounds",
                          "1", "--temperatures", "0.7,1.0", "--out", str(out)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["sampling"] for r in rows] == ["greedy", "T 0.7, top-p 0.95", "T 1.0, top-p 0.95"]
    assert all(r["wall_s"] > 0 and r["sample_ms_per_step"] > 0 for r in rows)
