"""Anthropic's Messages API through the `anthropic` client, against the real app under Ray Serve (fp32 engine,
embedded model): the same reply as the chat route, whole and streamed; a stop sequence named; tool use out and its
result back; the prompt's tokens counted as the reply counts them; refusals in Anthropic's envelope, naming the
Messages field; the key as Anthropic's clients send it; a stream the client drops stops its request (the autouse
fixture checks every block is free)."""
import json

import anthropic
import httpx
import openai
import pytest

from tests.serve.conftest import wait_idle

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0.0}  # vLLM's Messages field, which Anthropic's client (2.17) no longer names
ASK = [{"role": "user", "content": "Name three colours."}]
WEATHER = {"name": "get_weather", "description": "the weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def client(serve_app):
    return anthropic.Anthropic(base_url=serve_app["base_url"], api_key=serve_app["api_key"], max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat(serve_app):
    return openai.OpenAI(base_url=serve_app["base_url"] + "/v1", api_key=serve_app["api_key"], max_retries=0,
                         timeout=120)


def texts(message) -> list[tuple[str, str]]:
    return [(block.type, block.text) for block in message.content]


def test_a_message_is_the_chat_reply_whole_and_streamed(client, chat):
    reply = chat.chat.completions.create(model=MODEL, max_tokens=24, temperature=0.0, messages=[
        {"role": "system", "content": "Be brief."}, *ASK])
    whole = client.messages.create(model=MODEL, system="Be brief.", messages=ASK, max_tokens=24, extra_body=GREEDY)
    assert [block.type for block in whole.content] == ["text"] and whole.id.startswith("msg_")
    assert whole.content[0].text == reply.choices[0].message.content and whole.model == MODEL
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (reply.usage.prompt_tokens,
                                                                      reply.usage.completion_tokens)
    assert whole.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[reply.choices[0].finish_reason]
    with client.messages.stream(model=MODEL, system=[{"type": "text", "text": "Be brief."}], messages=ASK,
                                max_tokens=24, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds.count("content_block_start") == 1
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens  # known before the first token
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == whole.content[0].text
    assert texts(final) == texts(whole) and final.stop_reason == whole.stop_reason
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens,
                                                                      whole.usage.output_tokens)


def test_a_last_assistant_turn_is_a_prefill_the_reply_continues(client, chat):
    prefill = [*ASK, {"role": "assistant", "content": "My three favourite colours are"}]
    reply = chat.chat.completions.create(model=MODEL, max_tokens=16, temperature=0.0, messages=prefill,
                                         extra_body={"continue_final_message": True, "add_generation_prompt": False})
    # effort high, Anthropic's default, asks nothing of a template without reasoning_effort (low is refused below)
    whole = client.messages.create(model=MODEL, messages=prefill, max_tokens=16,
                                   extra_body={**GREEDY, "output_config": {"effort": "high"}})
    assert texts(whole) == [("text", reply.choices[0].message.content)]
    assert client.messages.count_tokens(model=MODEL, messages=prefill).input_tokens == reply.usage.prompt_tokens


def test_a_stop_sequence_ends_the_message_and_is_named(client):
    text = client.messages.create(model=MODEL, messages=ASK, max_tokens=32, extra_body=GREEDY).content[0].text
    word = text.split()[len(text.split()) // 2]
    whole = client.messages.create(model=MODEL, messages=ASK, max_tokens=32, extra_body=GREEDY, stop_sequences=[word])
    assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", word)
    assert whole.content[0].text in (text[:text.index(word)], text[:text.index(word)].rstrip(" "))
    with client.messages.stream(model=MODEL, messages=ASK, max_tokens=32, extra_body=GREEDY,
                                stop_sequences=[word]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, texts(final)) == ("stop_sequence", word, texts(whole))


def test_a_tool_use_goes_out_and_its_result_comes_back(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model=MODEL, messages=ask, tools=[WEATHER], tool_choice={"type": "any"},
                                   max_tokens=64, extra_body=GREEDY)
    uses = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    assert isinstance(uses[0].input, dict) and "city" in uses[0].input and uses[0].id.startswith("toolu_")
    follow_up = ask + [{"role": "assistant", "content": [block.model_dump() for block in first.content]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                     "content": "Sunny, 21 C"}]}]
    second = client.messages.create(model=MODEL, messages=follow_up, tools=[WEATHER], tool_choice={"type": "none"},
                                    max_tokens=32, extra_body=GREEDY)
    assert second.content and all(block.type == "text" for block in second.content) and second.content[0].text
    with client.messages.stream(model=MODEL, messages=ask, tools=[WEATHER], tool_choice={"type": "any"},
                                max_tokens=64, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [u.input for u in uses]
    assert final.stop_reason == "tool_use"
    one = client.messages.create(model=MODEL, messages=ask, tools=[WEATHER], max_tokens=64, extra_body=GREEDY,
                                 tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert [b.name for b in one.content if b.type == "tool_use"] == ["get_weather"]


def test_the_prompt_is_counted_as_the_message_counts_it_and_max_tokens_0_only_reads_it(client):
    asked = dict(model=MODEL, system="Be brief.", messages=ASK, tools=[WEATHER])
    counted = client.messages.count_tokens(**asked)
    whole = client.messages.create(**asked, max_tokens=4, extra_body=GREEDY)
    assert counted.input_tokens == whole.usage.input_tokens > client.messages.count_tokens(
        model=MODEL, system="Be brief.", messages=ASK).input_tokens  # the tools' description counts
    warmed = client.messages.create(**asked, max_tokens=0)  # Anthropic's cache pre-warming: the prompt, no reply
    assert (warmed.content, warmed.stop_reason, warmed.usage.output_tokens) == ([], "max_tokens", 0)
    assert warmed.usage.input_tokens == counted.input_tokens
    with client.messages.stream(**asked, max_tokens=0) as stream:
        kinds = [event.type for event in stream]
        assert stream.get_final_message().content == [] and "content_block_start" not in kinds


@pytest.mark.parametrize("extra,field", [
    ({"max_tokens": 10 ** 6}, "max_tokens"), ({"temperature": 1.5}, "temperature"),
    ({"mcp_servers": [{"type": "url", "url": "http://127.0.0.1:1", "name": "x"}]}, "mcp_servers"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
    ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools.0.defer_loading"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
     "messages.0"),
    ({"messages": [*ASK, {"role": "assistant", "content": "Red,"}, {"role": "user", "content": "\ud800"}]},
     "messages[2].content"),
    ({"thinking": {"type": "enabled", "budget_tokens": 16}}, "thinking.budget_tokens"),  # no reasoning parser here
    ({"output_config": {"effort": "low"}}, "output_config.effort"), ({"speed": "fast"}, "speed"),
    ({"invented": 1}, "invented")])
def test_what_cannot_be_served_is_a_400_in_anthropics_envelope_naming_the_field(serve_app, extra, field):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 8, **extra}
    refused = httpx.post(serve_app["base_url"] + "/v1/messages", content=json.dumps(body), timeout=60,
                         headers={"x-api-key": serve_app["api_key"], "content-type": "application/json"})
    error = refused.json()
    assert refused.status_code == 400 and error["type"] == "error", error
    assert error["error"]["type"] == "invalid_request_error" and error["error"]["message"].startswith(field), error


def test_the_key_is_read_where_anthropics_clients_send_it_and_errors_keep_its_envelope(serve_app, client):
    url = serve_app["base_url"] + "/v1/messages"
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4}
    refused = httpx.post(url, json=body, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error", refused.text
    wrong = httpx.post(url, json=body, headers={"x-api-key": "not-the-key"}, timeout=30)
    assert wrong.status_code == 401 and wrong.json()["type"] == "error"
    assert httpx.post(url, json=body, headers={"x-api-key": serve_app["api_key"]}, timeout=60).status_code == 200
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", messages=ASK, max_tokens=4)
    assert missing.value.body["error"]["type"] == "not_found_error"
    oversized = httpx.post(url, content=b"{" + b" " * (serve_app["args"].get("max_body_bytes", 1 << 20) + 1) + b"}",
                           headers={"x-api-key": serve_app["api_key"], "content-type": "application/json"}, timeout=30)
    assert oversized.status_code == 413 and oversized.json()["error"]["type"] == "request_too_large", oversized.text


def test_a_dropped_stream_stops_its_request(client, replica_handle):
    # greedy, this reply counts on to the app's 256-token limit (checked once by hand: stop_reason max_tokens)
    ask = [{"role": "user", "content": "Count from 1 to 1000, separated by commas."}]
    before = replica_handle.stats.remote().result(timeout_s=10).engine.generation_tokens
    with client.messages.stream(model=MODEL, messages=ask, max_tokens=256, extra_body=GREEDY) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                break
    generated = wait_idle(replica_handle).engine.generation_tokens - before
    assert generated < 128, generated  # aborted, not run to its end
