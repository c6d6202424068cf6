"""A matrix of bad requests: each gets its status and an OpenAI error envelope that says what is wrong."""
import importlib.metadata

import httpx
import pytest

pytestmark = pytest.mark.slow
CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
OK_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
OK_COMP = {"prompt": "hi", "max_tokens": 4}


def chat(**changes):
    return {**OK_CHAT, **changes}


def comp(**changes):
    return {**OK_COMP, **changes}


CASES = [
    # (id, method, path, json body or raw bytes, extra headers, status, words expected in the message)
    ("malformed json", "POST", CHAT, b'{"messages": [', {}, 400, "JSON"),
    ("non-object body", "POST", CHAT, b"[1, 2, 3]", {}, 400, "object"),
    ("wrong content type", "POST", CHAT, b"messages=hi", {"content-type": "text/plain"}, 400, ""),
    ("missing prompt", "POST", COMPLETIONS, {"max_tokens": 4}, {}, 400, "prompt"),
    ("empty prompt", "POST", COMPLETIONS, comp(prompt=""), {}, 400, "prompt"),
    ("missing messages", "POST", CHAT, {"max_tokens": 4}, {}, 400, "messages"),
    ("empty messages", "POST", CHAT, chat(messages=[]), {}, 400, "messages"),
    ("wrong role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), {}, 400, "role"),
    ("content not text", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), {}, 400, "content"),
    ("unknown model", "POST", CHAT, chat(model="gpt-9"), {}, 404, "gpt-9"),
    ("prompt over context", "POST", COMPLETIONS, comp(prompt="hi " * 9000), {}, 400, "context"),
    ("max_tokens 0", "POST", COMPLETIONS, comp(max_tokens=0), {}, 400, "max_tokens"),
    ("max_tokens -1", "POST", COMPLETIONS, comp(max_tokens=-1), {}, 400, "max_tokens"),
    ("max_tokens 1e9", "POST", COMPLETIONS, comp(max_tokens=10**9), {}, 400, "at most 256"),
    ("max_tokens over the limit", "POST", COMPLETIONS, comp(max_tokens=257), {}, 400, "at most 256"),
    ("prompt and max_tokens over context", "POST", COMPLETIONS, comp(prompt="hi " * 8100, max_tokens=200), {}, 400, "context"),
    ("max_tokens text", "POST", COMPLETIONS, comp(max_tokens="ten"), {}, 400, "max_tokens"),
    ("max_tokens float", "POST", COMPLETIONS, comp(max_tokens=1.5), {}, 400, "max_tokens"),
    ("temperature negative", "POST", CHAT, chat(temperature=-1), {}, 400, "temperature"),
    ("temperature too high", "POST", CHAT, chat(temperature=3), {}, 400, "temperature"),
    ("top_p zero", "POST", CHAT, chat(top_p=0), {}, 400, "top_p"),
    ("top_p above one", "POST", CHAT, chat(top_p=1.5), {}, 400, "top_p"),
    # integers past 64 bits cannot travel to the engine core (msgpack): each was a 500 before it was a 400
    ("top_k past 64 bits", "POST", CHAT, chat(top_k=10**30), {}, 400, "top_k must be a 64-bit integer"),
    ("truncate_prompt_tokens past 64 bits", "POST", COMPLETIONS, comp(truncate_prompt_tokens=10**30), {}, 400,
     "truncate_prompt_tokens must be a 64-bit integer"),
    # each valid alone; together no token may come first ("x", id 104, begins no JSON): the client's, once a 500
    ("allowed_token_ids against response_format", "POST", COMPLETIONS,
     comp(allowed_token_ids=[104], response_format={"type": "json_object"}), {}, 400, "leave no token"),
    ("presence_penalty out of range", "POST", CHAT, chat(presence_penalty=5), {}, 400, "presence_penalty"),
    ("empty stop string", "POST", CHAT, chat(stop=[""]), {}, 400, "stop"),
    ("too many stop strings", "POST", CHAT, chat(stop=[f"s{i}" for i in range(17)]), {}, 400, "stop"),
    ("n above max_n", "POST", CHAT, chat(n=9), {}, 400, "at most 8"),
    ("image content part", "POST", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
     {}, 400, "part 1: only text parts are supported, got 'image_url'"),
    ("null content without tool calls", "POST", CHAT, chat(messages=[{"role": "user", "content": None}]), {}, 400, "content"),
    ("tool message without its call id", "POST", CHAT, chat(messages=[{"role": "tool", "content": "42"}]), {}, 400,
     "tool_call_id"),
    ("audio output is refused by name", "POST", CHAT, chat(audio={"voice": "alloy", "format": "wav"}), {}, 400, "audio"),
    ("deprecated functions are refused by name", "POST", CHAT, chat(functions=[{"name": "f"}]), {}, 400, "functions"),
    ("stored completions are refused", "POST", CHAT, chat(store=True), {}, 400, "store"),
    ("suffix is refused by name", "POST", COMPLETIONS, comp(suffix="end"), {}, 400, "suffix"),
    ("best_of other than n", "POST", COMPLETIONS, comp(best_of=3), {}, 400, "best_of"),
    ("echo with logprobs over the scoring limit", "POST", COMPLETIONS, comp(prompt="hi " * 4500, echo=True, logprobs=1),
     {}, 400, "scores at most 4096"),
    ("logit_bias key not a token id", "POST", CHAT, chat(logit_bias={"hello": 5}), {}, 400, "logit_bias"),
    ("logit_bias key a non-ASCII digit", "POST", CHAT, chat(logit_bias={"²": 5}), {}, 400, "logit_bias"),
    ("logit_bias value out of range", "POST", CHAT, chat(logit_bias={"42": 500}), {}, 400, "logit_bias"),
    ("logit_bias token outside vocabulary", "POST", CHAT, chat(logit_bias={"99999999": 1}), {}, 400, "vocabulary"),
    ("top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=2), {}, 400, "top_logprobs"),
    ("top_logprobs above 20", "POST", CHAT, chat(logprobs=True, top_logprobs=21), {}, 400, "top_logprobs"),
    ("completions logprobs above 20", "POST", COMPLETIONS, comp(logprobs=21), {}, 400, "logprobs"),
    ("tool_choice without tools", "POST", CHAT, chat(tool_choice="required"), {}, 400, "tool_choice"),
    ("tool_choice naming no tool", "POST", CHAT, chat(
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        tool_choice={"type": "function", "function": {"name": "g"}}), {}, 400, "no tool is named 'g'"),
    ("json_schema type without a schema", "POST", CHAT, chat(response_format={"type": "json_schema"}), {}, 400,
     "json_schema"),
    ("a schema that cannot compile", "POST", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}), {}, 400, "response_format"),
    ("repetition_penalty zero", "POST", CHAT, chat(repetition_penalty=0), {}, 400, "repetition_penalty"),
    ("repetition_penalty so small that logits overflow", "POST", COMPLETIONS, comp(repetition_penalty=1.7e-149), {}, 400,
     "repetition_penalty"),
    ("min_tokens above max_tokens", "POST", CHAT, chat(min_tokens=10, max_tokens=4), {}, 400, "min_tokens"),
    ("stop_token_ids outside vocabulary", "POST", CHAT, chat(stop_token_ids=[10**9]), {}, 400, "vocabulary"),
    ("token id outside vocabulary", "POST", COMPLETIONS, comp(prompt=[10**9]), {}, 400, "vocabulary"),
    ("stream_options without a stream", "POST", COMPLETIONS, comp(stream_options={"include_usage": True}), {}, 400,
     "stream_options needs stream"),
    ("bad stream_options", "POST", CHAT, chat(stream=True, stream_options="yes"), {}, 400, "stream_options"),
    ("an unknown stream option", "POST", CHAT, chat(stream=True, stream_options={"include_usage": True, "live": 1}), {},
     400, "stream_options.live"),
    ("stream obfuscation", "POST", CHAT, chat(stream=True, stream_options={"include_obfuscation": True}), {}, 400,
     "stream_options.include_obfuscation"),
    ("oversized body", "POST", CHAT, chat(messages=[{"role": "user", "content": "x" * 1_100_000}]), {}, 413, "limit"),
    ("missing api key", "POST", CHAT, OK_CHAT, {"authorization": ""}, 401, "API key"),
    ("wrong api key", "POST", CHAT, OK_CHAT, {"authorization": "Bearer nope"}, 401, "API key"),
    ("unknown route", "POST", "/v1/nothing", OK_CHAT, {}, 404, "not found"),
    ("wrong method", "GET", CHAT, None, {}, 405, ""),
    ("bad input when streaming is still a plain 400", "POST", CHAT, chat(stream=True, max_tokens=0), {}, 400, "max_tokens"),
    # the Responses API: its own checks, the chat route's under its own names, and the engine's
    ("responses: malformed json", "POST", RESPONSES, b'{"input": [', {}, 400, "JSON"),
    ("responses: missing input", "POST", RESPONSES, {"max_output_tokens": 4}, {}, 400, "input"),
    ("responses: an image part", "POST", RESPONSES, {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x/y.png"}]}]}, {}, 400,
     "only text parts are supported, got 'input_image'"),
    ("responses: an unknown item", "POST", RESPONSES, {"input": [{"type": "reasoning", "summary": []}]}, {}, 400,
     "item type 'reasoning' is not supported"),
    ("responses: unknown model", "POST", RESPONSES, {"input": "hi", "model": "gpt-9"}, {}, 404, "gpt-9"),
    ("responses: input over context", "POST", RESPONSES, {"input": "hi " * 9000}, {}, 400, "input"),
    ("responses: max_output_tokens over the limit", "POST", RESPONSES, {"input": "hi", "max_output_tokens": 257}, {},
     400, "max_output_tokens is 257"),
    ("responses: a chat spelling", "POST", RESPONSES, {"input": "hi", "messages": []}, {}, 400, "messages"),
    ("responses: missing api key", "POST", RESPONSES, {"input": "hi"}, {"authorization": ""}, 401, "API key"),
    ("responses: bad input when streaming is still a plain 400", "POST", RESPONSES,
     {"input": "hi", "stream": True, "temperature": 5}, {}, 400, "temperature"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_status_and_envelope(base_url, auth, case):
    _, method, path, body, headers, status, words = case
    request_headers = httpx.Headers(auth)
    request_headers.update(headers)
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    if isinstance(body, bytes):
        request_headers.setdefault("content-type", "application/json")
    if request_headers.get("authorization") == "":
        del request_headers["authorization"]
    r = httpx.request(method, base_url + path, headers=request_headers, timeout=60, **kwargs)
    assert r.status_code == status, r.text
    assert r.headers.get("x-request-id")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert words.lower() in error["message"].lower(), error


def test_after_the_matrix_a_normal_request_succeeds(base_url, auth):
    r = httpx.post(base_url + CHAT, json=OK_CHAT, headers=auth, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_health_needs_no_key_and_request_ids_are_echoed(base_url, auth):
    assert httpx.get(base_url + "/health", timeout=10).status_code == 200
    r = httpx.post(base_url + CHAT, json=OK_CHAT, headers={**auth, "X-Request-Id": "my-id-42"}, timeout=60)
    assert r.headers["x-request-id"] == "my-id-42" and r.json()["id"] == "my-id-42"


def test_version_names_the_installed_server_as_vllms_does(base_url, auth):
    version = httpx.get(base_url + "/version", headers=auth, timeout=10).json()
    assert version == {"version": importlib.metadata.version("llm-serve")} and version["version"] != "unknown"


def test_a_chunked_body_without_length_is_capped_too(base_url, auth):
    def chunks():
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(1100):
            yield b"x" * 1000
        yield b'"}]}'

    r = httpx.post(base_url + CHAT, content=chunks(), headers={**auth, "content-type": "application/json"}, timeout=60)
    assert "content-length" not in r.request.headers
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"], r.text
