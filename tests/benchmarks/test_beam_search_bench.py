"""benchmarks/beam_search.py at toy sizes without the vLLM peer: both engine rows, and the JSON it writes."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_beam_search_benchmark_runs(tmp_path):
    run = subprocess.run([sys.executable, "benchmarks/beam_search.py", "--prompts", "2", "--prompt-tokens", "8",
                          "--width", "2", "--max-tokens", "3", "--runs", "1", "--out-dir", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    (written,) = tmp_path.glob("beam-search-*.json")
    result = json.loads(written.read_text())
    assert set(result["median_seconds"]) == {"engine, beam search", "engine, sampled n"}
    assert all(seconds > 0 for seconds in result["median_seconds"].values())
    assert result["settings"]["width"] == 2 and "vllm_over_engine_seconds" not in result
