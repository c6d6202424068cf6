"""vLLM's /tokenize and /detokenize on the real app: the ids a completion or chat completion counts in its usage,
their strings, the text back, and refusals that name the field."""
import httpx
import pytest

pytestmark = pytest.mark.slow
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def post(base_url, auth, path, body):
    return httpx.post(base_url + path, json=body, headers=auth, timeout=60)


def test_a_prompts_tokens_are_what_a_completion_counts_and_detokenize_gives_the_text_back(base_url, auth, tokenizer):
    prompt = "The capital of France is"
    r = post(base_url, auth, "/tokenize", {"prompt": prompt, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode(prompt) and body["count"] == len(body["tokens"]) > 0
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"]) and body["max_model_len"] == 8192
    completion = post(base_url, auth, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == body["count"]
    back = post(base_url, auth, "/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": prompt}
    assert post(base_url, auth, "/tokenize", {"prompt": prompt}).json()["token_strs"] is None


def test_chat_messages_count_as_the_chat_completion_does_tools_included(base_url, auth):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    for tools in (None, [WEATHER_TOOL]):
        extra = {"tools": tools} if tools else {}
        counted = post(base_url, auth, "/tokenize", {"messages": messages, **extra}).json()["count"]
        chat = post(base_url, auth, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, **extra}).json()
        assert counted == chat["usage"]["prompt_tokens"], (tools, counted, chat["usage"])
    with_tools = post(base_url, auth, "/tokenize", {"messages": messages, "tools": [WEATHER_TOOL]}).json()["count"]
    assert with_tools > post(base_url, auth, "/tokenize", {"messages": messages}).json()["count"]


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "tools": [WEATHER_TOOL]}, 400, "tools"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": False}, 400, "add_special_tokens"),  # never silently ignored
    ("/tokenize", {"prompt": ""}, 400, "prompt"),
    ("/tokenize", {"prompt": "hi", "model": "gpt-4o"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "12"}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "gpt-4o"}, 404, "model"),
])
def test_refusals_name_their_field(base_url, auth, path, body, status, param):
    r = post(base_url, auth, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_both_routes_need_the_key(base_url, path):
    r = httpx.post(base_url + path, json={"prompt": "hi", "tokens": [1]}, timeout=30)
    assert r.status_code == 401, r.text
