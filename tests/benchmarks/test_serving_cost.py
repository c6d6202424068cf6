"""bench-serving's bookkeeping: which process is which part of a server, and CPU per 1,000 tokens from a window."""
import subprocess
import sys
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from serving_cost import Level, role_of  # noqa: E402


def test_processes_are_told_apart_by_their_command_lines_and_the_peers_api_by_its_pid():
    names = ["ray::ProxyActor", "ray::HAProxyManager", "ray::ServeReplica:default:Ingress",
             "ray::ServeReplica:default:EngineReplica", "engine.core_process", "VLLM::EngineCore", "VLLM::Worker_TP0", "haproxy", "raylet"]
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", name]) for name in names]
    try:
        roles = [role_of(psutil.Process(p.pid), api_pid=None) for p in procs]
        assert roles == ["proxy", "proxy", "ingress", "replica", "core", "core", "core", "proxy", "other"]
        assert role_of(psutil.Process(procs[-1].pid), api_pid=procs[-1].pid) == "api server"
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_serving_cost_counts_the_serving_processes_and_leaves_the_core_out():
    level = Level("x", streamed=True, clients=16, seconds=10, output_tokens=5000,
                  cpu_s={"proxy": 1.0, "ingress": 0.5, "replica": 1.0, "core": 9.0, "other": 0.2})
    assert level.tokens_per_s == 500
    assert level.ms_per_1k("proxy") == 200 and level.ms_per_1k("core") == 1800
    assert level.serving_ms_per_1k == 500  # proxy + ingress + replica: 2.5 s of CPU for 5,000 tokens
