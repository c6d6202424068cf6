"""The exposure check reads the proxy's real address inside a replica: on loopback, an app with no key starts
(as `make serve` does); a check that could not read the address would refuse it."""
import httpx
import pytest

from tests.serve.conftest import wait_healthy

pytestmark = pytest.mark.slow


def test_a_keyless_app_on_loopback_starts_and_serves_without_a_key(serve_app, replica_handle, monkeypatch):
    from ray import serve

    from serve_app.config import AppArgs
    from serve_app.ingress import IngressDeployment

    monkeypatch.delenv("LLM_SERVE_API_KEY", raising=False)
    args = AppArgs(**{**serve_app["args"], "api_key": None})
    ingress = serve.deployment(IngressDeployment).options(name="KeylessIngress", ray_actor_options={"num_cpus": 0})
    serve.run(ingress.bind(replica_handle, args), name="keyless", route_prefix="/keyless", blocking=False)
    try:
        base = serve_app["base_url"] + "/keyless"
        wait_healthy(base, timeout=60)
        r = httpx.post(base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        serve.delete("keyless")
