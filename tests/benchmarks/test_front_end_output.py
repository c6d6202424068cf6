"""benchmarks/front_end_output.py at toy sizes: a row per length, each a positive time."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_front_end_output_benchmark_runs(tmp_path):
    out = tmp_path / "front-end-output.json"
    run = subprocess.run([sys.executable, "benchmarks/front_end_output.py", "--batch", "4", "--lengths", "5,20",
                          "--rounds", "2", "--steps", "3", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["length"]) for r in rows] == [(4, 5), (4, 20)] and all(r["ms_a_step"] > 0 for r in rows)
