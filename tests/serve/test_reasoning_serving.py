"""The app's reasoning parser (vLLM's --reasoning-parser) on the real app: a chat's thinking comes back apart from its
answer, whole or streamed, in the Responses API as a reasoning item, and left out with include_reasoning false; a
constraint waits for the end of the thinking. SmolLM2 does not think, so a regex makes it write a think block: the
prompt closes one of its own (reasoning ended there), so the constraint applies from the first token."""
import json
import re

import httpx
import pytest

from tests.serve.conftest import ingress_only_app

pytestmark = pytest.mark.slow
FORCED = "<think>[a-z]{3,8}( [a-z]{3,8}){2,5}</think>[A-Z][a-z]{3,8}( [a-z]{3,8}){2,5}\\."
MESSAGES = [{"role": "user", "content": "Here is how I think: <think>slowly</think> Now think about the sea."}]
BODY = {"messages": MESSAGES, "max_tokens": 80, "temperature": 0, "structured_outputs": {"regex": FORCED}}


@pytest.fixture(scope="module")
def app(serve_app, replica_handle):
    """An ingress with the parser in front of the session's engine replica (the replica defers constraints as the
    ingress's jobs say)."""
    with ingress_only_app(serve_app, replica_handle, "reasoning", reasoning_parser="deepseek_r1") as base:
        yield base


def post(base: str, auth: dict, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, headers=auth, timeout=120)


def streamed(base: str, auth: dict, body: dict) -> list[dict]:
    with httpx.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True}, headers=auth,
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_the_thinking_comes_back_apart_from_the_answer_whole_and_streamed(app, auth):
    whole = post(app, auth, "/v1/chat/completions", BODY).json()
    message = whole["choices"][0]["message"]
    thinking, answer = message["reasoning"], message["content"]
    assert re.fullmatch("[a-z]{3,8}( [a-z]{3,8}){2,5}", thinking) and message["reasoning_content"] == thinking, message
    assert re.fullmatch("[A-Z][a-z]{3,8}( [a-z]{3,8}){2,5}\\.", answer), message
    used = whole["usage"]
    assert 0 < used["completion_tokens_details"]["reasoning_tokens"] < used["completion_tokens"], used
    chunks = streamed(app, auth, {**BODY, "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"] == used  # the stream counts the thinking the same
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == thinking
    assert "".join(d.get("content") or "" for d in deltas) == answer
    kinds = [("reasoning" if d.get("reasoning") else "content") for d in deltas if d.get("reasoning") or d.get("content")]
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning") and len(set(kinds)) == 2  # all thinking first
    hidden = post(app, auth, "/v1/chat/completions", {**BODY, "include_reasoning": False}).json()["choices"][0]["message"]
    assert "reasoning" not in hidden and hidden["content"] == answer
    hidden_deltas = [c["choices"][0]["delta"] for c in streamed(app, auth, {**BODY, "include_reasoning": False})
                     if c["choices"]]
    assert not any("reasoning" in d for d in hidden_deltas)
    assert "".join(d.get("content") or "" for d in hidden_deltas) == answer


def test_the_responses_api_gives_a_reasoning_item_before_the_message(app, auth):
    body = {"input": MESSAGES[0]["content"], "max_output_tokens": 80, "temperature": 0,
            "text": {"format": {"type": "text"}}, "structured_outputs": {"regex": FORCED}}
    response = post(app, auth, "/v1/responses", body).json()
    output = response["output"]
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    assert [item["type"] for item in output] == ["reasoning", "message"], output
    thinking = output[0]["content"][0]
    assert thinking["type"] == "reasoning_text" and re.fullmatch("[a-z]{3,8}( [a-z]{3,8}){2,5}", thinking["text"])
    with httpx.stream("POST", app + "/v1/responses", json={**body, "stream": True}, headers=auth, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta"), kinds
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == thinking["text"]
    done = next(e for e in events if e["type"] == "response.completed")["response"]["output"]
    assert [item["type"] for item in done] == ["reasoning", "message"] and done[0]["content"] == [thinking]


def test_the_messages_api_gives_a_thinking_block_under_its_budget(app, auth):
    """Anthropic's thinking options on the Messages route: enabled's budget_tokens is vLLM's thinking_token_budget,
    disabled a budget of 0, display omitted leaves the block out; the blocks are the chat reply's parts."""
    ask = {"messages": [{"role": "user", "content": "Describe the sea.\n<think>"}], "max_tokens": 24, "temperature": 0}
    chat = post(app, auth, "/v1/chat/completions", {**ask, "thinking_token_budget": 9}).json()
    reply = chat["choices"][0]["message"]
    body = {**ask, "model": "SmolLM2-135M-Instruct", "thinking": {"type": "enabled", "budget_tokens": 9}}
    message = post(app, auth, "/v1/messages", body).json()
    assert [block["type"] for block in message["content"]] == ["thinking", "text"], message
    assert (message["content"][0]["thinking"], message["content"][1]["text"]) == (reply["reasoning"], reply["content"])
    assert message["usage"]["output_tokens_details"]["thinking_tokens"] == chat["usage"]["completion_tokens_details"][
        "reasoning_tokens"] > 0
    with httpx.stream("POST", app + "/v1/messages", json={**body, "stream": True}, headers=auth, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == reply["reasoning"]
    assert "".join(d.get("text", "") for d in deltas) == reply["content"]
    assert [d["type"] for d in deltas if d["type"] != "thinking_delta"][0] == "signature_delta"  # closes the thinking
    omitted = post(app, auth, "/v1/messages", {**body, "thinking": {**body["thinking"], "display": "omitted"}}).json()
    assert [(b["type"], b["text"]) for b in omitted["content"]] == [("text", reply["content"])], omitted
    unthought = post(app, auth, "/v1/chat/completions", {**ask, "thinking_token_budget": 0}).json()["choices"][0]
    disabled = post(app, auth, "/v1/messages", {**body, "thinking": {"type": "disabled"}}).json()
    assert [b.get("text") for b in disabled["content"] if b["type"] == "text"] == [unthought["message"]["content"]]


def test_a_constraint_waits_for_the_end_of_the_thinking(app, auth):
    """Without a closed think block in the prompt, the model thinks first (DeepSeek-R1's template opened it): the
    regex would bind its first token, but SmolLM2 never writes </think>, so the whole reply stays free thinking."""
    body = {"messages": [{"role": "user", "content": "Describe the sea."}], "max_tokens": 24, "temperature": 0,
            "structured_outputs": {"regex": "[0-9]{3}"}}
    message = post(app, auth, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert message["content"] is None and len(message["reasoning"]) > 20 and not re.search("[0-9]{3}", message["reasoning"])


def test_a_thinking_budget_forces_the_end_of_the_thinking_then_the_constraint_binds_the_answer(app, auth):
    """vLLM's thinking_token_budget: the section the prompt opened (a `<think>` the template's turn markers follow,
    which count; after a newline, as SmolLM2 tokenizes the marker alone the same) gets the budget; then `</think>` is forced, the reasoning parser splits there and the waiting
    constraint binds the answer. A completion is counted the same, by the app's parser's markers."""
    body = {"messages": [{"role": "user", "content": "Describe the sea.\n<think>"}], "max_tokens": 24,
            "temperature": 0, "structured_outputs": {"regex": "[0-9]{3}"}, "thinking_token_budget": 9}
    message = post(app, auth, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert re.fullmatch("[0-9]{3}", message["content"]) and message["reasoning"], message
    free = post(app, auth, "/v1/chat/completions", {**body, "thinking_token_budget": -1}).json()["choices"][0]
    assert free["message"]["content"] is None and free["message"]["reasoning"].startswith(message["reasoning"])
    tokenize = lambda text: post(app, auth, "/tokenize", {"prompt": text}).json()["tokens"]  # noqa: E731
    end = tokenize("</think>")
    completion = {"prompt": "Think about the sea:\n<think>\n", "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                  "return_token_ids": True}
    for budget in (0, 4):
        ids = post(app, auth, "/v1/completions", {**completion, "thinking_token_budget": budget}).json()[
            "choices"][0]["token_ids"]
        left = max(0, budget - 1)  # the prompt's "\n" is the section's first token
        assert ids[left:left + len(end)] == end, (budget, ids)


@pytest.mark.parametrize("extra", [{"thinking_token_budget": -2}, {"thinking_token_budget": 4, "use_beam_search": True,
                                                                   "n": 2}])
def test_a_thinking_budget_that_cannot_be_is_a_400_naming_it(app, auth, extra):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    refused = post(app, auth, "/v1/chat/completions", body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "thinking_token_budget", refused.text


def test_without_a_reasoning_parser_a_thinking_budget_is_a_400_naming_it(serve_app, auth):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "thinking_token_budget": 4}
    refused = post(serve_app["base_url"], auth, "/v1/chat/completions", body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "thinking_token_budget", refused.text
    assert "reasoning_parser" in refused.json()["error"]["message"]
