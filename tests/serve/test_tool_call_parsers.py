"""The app's tool-call parser (vLLM's --tool-call-parser) on the real app: with llama3_json, the tools are described
in Llama 3's words, a forced call is written as Llama 3 writes one, and it comes back parsed as OpenAI's tool_calls,
whole and streamed (the session's app is hermes)."""
import json

import httpx
import pytest

from tests.serve.conftest import ingress_only_app

pytestmark = pytest.mark.slow
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}}
BODY = {"messages": [{"role": "user", "content": "What is 2 plus 3?"}], "tools": [ADD], "tool_choice": "required",
        "max_tokens": 40, "temperature": 0}


@pytest.fixture(scope="module")
def app(serve_app, replica_handle):
    with ingress_only_app(serve_app, replica_handle, "llama3-tools", tool_call_parser="llama3_json") as base:
        yield base


def test_a_forced_call_is_written_and_parsed_in_llama3s_format(app, auth, tokenizer):
    prompt = httpx.post(app + "/tokenize", json={"messages": BODY["messages"], "tools": [ADD]}, headers=auth,
                        timeout=60).json()["tokens"]
    assert "Given the following functions" in tokenizer.decode(prompt) and "<tool_call>" not in tokenizer.decode(prompt)
    r = httpx.post(app + "/v1/chat/completions", json=BODY, headers=auth, timeout=120).json()
    choice = r["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert call["function"]["name"] == "add" and set(json.loads(call["function"]["arguments"])) == {"a", "b"}
    with httpx.stream("POST", app + "/v1/chat/completions", json={**BODY, "stream": True}, headers=auth,
                      timeout=120) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    streamed = [t for d in deltas for t in d.get("tool_calls") or ()]
    assert [t["function"] for t in streamed] == [call["function"]]
    assert not any(d.get("content") for d in deltas)  # the call's JSON never leaks out as text
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
