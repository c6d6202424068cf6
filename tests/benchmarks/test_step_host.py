"""benchmarks/step_host.py at toy sizes: both modes measured, every phase a positive time, host = step less forward,
the front end's time apart; through the CUDA graphs' buffers too (replays stubbed), steps ahead advancing them, with
sampled requests (a run each: the toy sizes cost ~10 s a run)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("graph_buffers,sampled", [(False, False), (True, True)])
def test_the_host_time_benchmark_runs(tmp_path, graph_buffers, sampled):
    out = tmp_path / "step-host.json"
    run = subprocess.run([sys.executable, "benchmarks/step_host.py", "--batches", "1,8", "--rounds", "2", "--steps", "5",
                          "--out", str(out)] + ["--graph-buffers"] * graph_buffers + ["--sampled"] * sampled,
                         cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["async_scheduling"]) for r in rows] == [(1, False), (1, True), (8, False), (8, True)]
    assert all(r["graph_buffers"] == graph_buffers and r["sampled"] == sampled for r in rows)
    for row in rows:
        assert row["forward"] > 0 and row["host"] > 0 and abs(row["host"] + row["forward"] - row["step"]) < 0.01
        assert row["front_end"] > 0  # every step's token detokenized by LLM.step()
