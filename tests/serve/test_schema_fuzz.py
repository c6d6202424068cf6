"""schemathesis against the live app's own OpenAPI schema: no generated request may get a 5xx."""
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

pytestmark = pytest.mark.slow
MAX_GENERATED_TOKENS = 4  # valid requests generate; keep each short so the fuzz stays in seconds


def short(body):
    """Valid max_tokens values are shortened, and a missing one is set; invalid ones stay as generated."""
    if not isinstance(body, dict):
        return body
    keys = ("max_tokens", "max_completion_tokens", "max_output_tokens")
    for key in keys:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and MAX_GENERATED_TOKENS < value <= 256:
            body[key] = MAX_GENERATED_TOKENS
    if all(body.get(key) is None for key in keys):
        body["max_output_tokens" if "input" in body else "max_tokens"] = MAX_GENERATED_TOKENS  # a response's spelling
    return body


def test_no_generated_request_gets_a_server_error(serve_app, auth):
    # schemathesis' pytest fixture loader fails on this pytest, so the operations' strategies are driven directly
    schema = schemathesis.openapi.from_url(serve_app["base_url"] + "/openapi.json", headers=auth)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/models",
                                                  "/v1/models/{model}", "/tokenize", "/detokenize", "/health",
                                                  "/v1/responses", "/v1/embeddings", "/v1/score", "/v1/rerank"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def fuzz(case):
            case.body = short(case.body)
            case.call_and_validate(base_url=serve_app["base_url"], headers=auth, checks=[not_a_server_error])

        fuzz()


def test_the_app_answers_after_the_fuzz(base_url, auth):
    r = httpx.post(base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, headers=auth, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
