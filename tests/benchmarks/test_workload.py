"""The benchmark's workloads: `--workload loadtest` is the load test's own prompt mix, seeded."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from workload import WORKLOADS  # noqa: E402

from loadtest.prompts import load_prompts  # noqa: E402


def test_the_loadtest_workload_is_the_load_tests_prompts_with_seeded_lengths():
    requests = WORKLOADS["loadtest"](40, 16, 64, seed=3)
    assert [r.messages for r in requests] == [p.messages for p in load_prompts(40, 3)]
    assert all(16 <= r.max_tokens <= 64 for r in requests)
    assert len({r.max_tokens for r in requests}) > 1
    assert [r.max_tokens for r in WORKLOADS["loadtest"](40, 16, 64, seed=3)] == [r.max_tokens for r in requests]
    assert {p.kind for p in load_prompts(40, 3)} == {"story", "question", "summary", "chat"}
