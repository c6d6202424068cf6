"""The exposure check reads the proxy's real address inside a replica: on loopback, an app with no key starts
(as `make serve` does); a check that could not read the address would refuse it."""
import httpx
import pytest

from tests.serve.conftest import ingress_only_app

pytestmark = pytest.mark.slow


def test_a_keyless_app_on_loopback_starts_and_serves_without_a_key(serve_app, replica_handle, monkeypatch):
    monkeypatch.delenv("LLM_SERVE_API_KEY", raising=False)
    with ingress_only_app(serve_app, replica_handle, "keyless", api_key=None) as base:
        r = httpx.post(base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
