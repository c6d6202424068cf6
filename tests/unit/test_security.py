"""Auth covers every route but /health under any route prefix; exposure without a key is refused."""
import pytest
from starlette.datastructures import Headers

from serve_app.security import authorized, exposure_problem, is_loopback, needs_key


@pytest.mark.parametrize("root, path, protected", [
    ("", "/health", False), ("", "/v1/models", True), ("", "/openapi.json", True), ("", "/", True),
    ("/llm", "/llm/health", False), ("/llm", "/llm/v1/chat/completions", True), ("/llm", "/llm/openapi.json", True),
    ("/llm", "/llm", True), ("/llm", "/llm/health/", True), ("/llm", "/llmx/health", True),
])
def test_every_route_but_health_needs_the_key_under_any_prefix(root, path, protected):
    assert needs_key({"path": path, "root_path": root}) is protected


def test_the_key_is_a_bearer_token_or_an_x_api_key_compared_exactly():
    def asks(**headers) -> bool:
        return authorized(Headers(headers), "s3cret")

    assert asks(authorization="Bearer s3cret") and asks(authorization="bearer  s3cret ")
    assert not asks(authorization="Bearer s3cre") and not asks(authorization="s3cret") and not asks()
    assert asks(**{"x-api-key": "s3cret"}) and not asks(**{"x-api-key": "s3cre"}) and not asks(**{"x-api-key": ""})
    # a wrong bearer token is not saved by a right x-api-key: the bearer header, when sent, is the one read
    assert not asks(authorization="Bearer nope", **{"x-api-key": "s3cret"})
    assert asks(authorization="Basic abc", **{"x-api-key": "s3cret"})


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                            ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("example.com", False)])
def test_loopback_is_recognised(host, loopback):
    assert is_loopback(host) is loopback


def test_exposure_without_a_key_is_refused_unless_said_on_purpose():
    assert exposure_problem("127.0.0.1", None, False) is None
    assert "api_key" in exposure_problem("0.0.0.0", None, False)
    assert "api_key" in exposure_problem(None, None, False)  # unknown address: fail closed
    assert exposure_problem("0.0.0.0", "k", False) is None and exposure_problem("0.0.0.0", None, True) is None


def test_the_engine_core_gets_no_serving_secrets_but_keeps_hub_tokens():
    from engine.core_client import core_environment

    env = core_environment({"LLM_SERVE_API_KEY": "k", "OPENAI_API_KEY": "o", "RAY_AUTH_TOKEN": "r", "DB_PASSWORD": "p",
                            "AWS_SECRET_ACCESS_KEY": "s", "HF_TOKEN": "h", "PATH": "/usr/bin"})
    assert set(env) == {"HF_TOKEN", "PATH", "GLIBC_TUNABLES"}
