"""benchmarks/block_matmul.py at toy sizes: it checks the kernel against the dense matmul before timing, and gives
a positive time for every kind, row count and variant."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cpu_kernels import build_kernels

ROOT = Path(__file__).resolve().parents[2]


def test_the_block_matmul_benchmark_runs(tmp_path):
    if not build_kernels().interleaved_rows():
        pytest.skip("this CPU reads GGUF blocks in the file's layout (no AVX2): the benchmark times the interleaved one")
    out = tmp_path / "blocks.json"
    run = subprocess.run([sys.executable, "benchmarks/block_matmul.py", "--rows", "1,5", "--layers", "1", "--rounds",
                          "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["kind"], r["rows"], r["variant"]) for r in rows} == {
        (kind, m, variant) for kind in ("q4", "q8") for m in (1, 5) for variant in ("this tree native", "dense fp32 (oneDNN)")}
    assert all(r["ms"] > 0 for r in rows)
