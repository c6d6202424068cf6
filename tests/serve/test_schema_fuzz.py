"""schemathesis against the live app's own OpenAPI schema: no generated request may get a 5xx."""
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import ServerError

pytestmark = pytest.mark.slow
SERVER_FAULTS_IN_A_STREAM = (b'"type":"internal_error"', b'"code":"internal_error"', b'"code":"server_error"',
                             b'"type":"api_error"')  # the last, Anthropic's Messages stream's
MODEL = "SmolLM2-135M-Instruct"
STREAMING_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
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
    plausible_turns(body)
    return body


def plausible_turns(body: dict) -> None:
    """The schema cannot say which fields each role's message (or a Responses item) needs: without this nearly
    every generated chat and response was refused for its turns, and the sampling fields went unfuzzed there. A
    turn missing what its role needs becomes a user's turn; the other fields stay as generated."""
    for turn in body.get("messages") if isinstance(body.get("messages"), list) else ():
        if isinstance(turn, dict) and not (turn.get("role") == "assistant" and turn.get("tool_calls")) \
                and not (turn.get("role") == "tool" and turn.get("tool_call_id")):
            turn.update(role="user", content=turn.get("content") or "hi")
            turn.pop("tool_calls", None)
    for item in body.get("input") if isinstance(body.get("input"), list) else ():
        if isinstance(item, dict) and item.get("type", "message") == "message":
            item.update(role=item.get("role") or "user", content=item.get("content") or "hi")


def streamed_too(case, response) -> bool:
    """A request served whole is sent again as a stream (where the schema's generator seldom asks for one)."""
    if response.status_code != 200 or not isinstance(case.body, dict) or case.body.get("stream"):
        return False
    if case.operation.path not in STREAMING_ROUTES:
        return False
    case.body["stream"] = True
    return True


@schemathesis.check
def no_server_error_inside_a_stream(ctx, response, case):
    """A stream's status is sent before its tokens: a server's fault after that is an error event inside a 200
    (OpenAI's internal_error; the Responses API's server_error), which `not_a_server_error` cannot see."""
    if response.status_code == 200 and any(mark in response.content for mark in SERVER_FAULTS_IN_A_STREAM):
        raise ServerError(operation=case.operation.label, status_code=500)


def test_no_generated_request_gets_a_server_error(serve_app, auth):
    # schemathesis' pytest fixture loader fails on this pytest, so the operations' strategies are driven directly
    schema = schemathesis.openapi.from_url(serve_app["base_url"] + "/openapi.json", headers=auth)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/models",
                                                  "/v1/models/{model}", "/tokenize", "/detokenize", "/health",
                                                  "/v1/responses", "/v1/embeddings", "/v1/score", "/v1/rerank",
                                                  "/v1/messages", "/v1/messages/count_tokens"}
    checks = [not_a_server_error, no_server_error_inside_a_stream]
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def fuzz(case):
            case.body = short(case.body)
            if case.operation.path.startswith("/v1/messages") and isinstance(case.body, dict):
                case.body["model"] = MODEL  # a name it requires: else nearly every one is a 404 before its fields
                if case.operation.path.endswith("/count_tokens"):
                    case.body.pop("max_tokens")  # short() set it; a token count does not take it
            response = case.call_and_validate(base_url=serve_app["base_url"], headers=auth, checks=checks)
            if streamed_too(case, response):
                case.call_and_validate(base_url=serve_app["base_url"], headers=auth, checks=checks)

        fuzz()


def test_the_app_answers_after_the_fuzz(base_url, auth):
    r = httpx.post(base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, headers=auth, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
