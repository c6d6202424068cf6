"""The ingress process stays light: it parses, validates and formats, and never loads torch (issue 43), so the
autoscaled front of the app starts fast and small on nodes without a GPU."""
from pathlib import Path

import httpx
import psutil
import pytest

pytestmark = pytest.mark.slow


def serve_replica_processes(deployment: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"])
            if any("ServeReplica:" in part and deployment in part for part in p.info["cmdline"] or [])]


def loads_torch(process: psutil.Process) -> bool:
    return "libtorch" in Path(f"/proc/{process.pid}/maps").read_text()


def test_the_ingress_never_loads_torch_and_the_engine_replica_does(serve_app, base_url, auth):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 2}
    for extra in ({"response_format": {"type": "json_object"}}, {"tools": [{"type": "function", "function": {"name": "f"}}]}):
        r = httpx.post(base_url + "/v1/chat/completions", headers=auth, timeout=60, json={**chat, **extra})
        assert r.status_code == 200, r.text  # the ingress has parsed, validated and formatted every kind of field
    ingresses, replicas = serve_replica_processes("Ingress"), serve_replica_processes("EngineReplica")
    assert ingresses and replicas
    assert not any(loads_torch(p) for p in ingresses)
    assert all(loads_torch(p) for p in replicas)  # the check sees torch where it is
