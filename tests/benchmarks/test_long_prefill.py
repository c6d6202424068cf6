"""benchmarks/long_prefill.py runs end to end at toy lengths (vLLM left out), timing each kernel and SDPA alike."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import cpu_kernels

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_the_long_prefill_benchmark_times_each_path_at_each_length(tmp_path):
    run = subprocess.run([sys.executable, "benchmarks/long_prefill.py", "--lengths", "40,300", "--runs", "2",
                          "--vllm-python", "", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    report = json.loads(next(tmp_path.glob("long-prefill-*.json")).read_text())
    kernel = cpu_kernels.paged_prefill_op(torch.bfloat16, 64, 16)  # as the benchmark's engine chooses
    kernels = {"AMX kernel"} if kernel is not None and kernel.__name__ == "paged_prefill_amx_batch" else set()
    kernels |= {"AVX-512 kernel"} if kernel is not None else set()
    assert set(report["seconds"]) == {f"engine, {path}" for path in kernels | {"SDPA"}}
    for by_length in report["seconds"].values():
        assert set(by_length) == {"40", "300"} and all(len(s) == 2 and min(s) > 0 for s in by_length.values())
    assert next(tmp_path.glob("long-prefill-*.png")).stat().st_size > 0
