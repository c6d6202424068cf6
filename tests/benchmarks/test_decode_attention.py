"""benchmarks/decode_attention.py at toy sizes: the kernel, both walks and the stream timed, the walks over the same
rows (the script checks their sums), every rate positive."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_decode_attention_benchmark_runs(tmp_path):
    out = tmp_path / "decode-attention.json"
    run = subprocess.run([sys.executable, "benchmarks/decode_attention.py", "--batch", "4", "--context", "40",
                          "--layers", "2", "--rounds", "1", "--stream-mib", "16", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["kernel", "walk, two passes", "walk, one pass", "one stream (sum)"]
    assert all(r["ms"] > 0 and r["gb_s"] > 0 for r in rows)
