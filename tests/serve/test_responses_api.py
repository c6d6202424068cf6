"""OpenAI's Responses API through the `openai` client, against the real app under Ray Serve (fp32 engine, embedded
model): the same reply as the chat route, whole and streamed; function calls out and their outputs back; JSON by
schema; stateful fields refused by name; a stream the client drops stops its request (the autouse fixture checks
every block is free)."""
import json

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
ASK = "Name three colours."
WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def client(serve_app):
    return openai.OpenAI(base_url=serve_app["base_url"] + "/v1", api_key=serve_app["api_key"], max_retries=0, timeout=120)


def test_a_response_is_the_chat_reply_whole_and_streamed(client):
    chat = client.chat.completions.create(model=MODEL, max_tokens=24, temperature=0.0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}])
    whole = client.responses.create(model=MODEL, instructions="Be brief.", input=ASK, max_output_tokens=24,
                                    temperature=0.0)
    assert whole.output_text == chat.choices[0].message.content and whole.id.startswith("resp_")
    assert whole.usage.input_tokens == chat.usage.prompt_tokens and whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    events = list(client.responses.create(model=MODEL, instructions="Be brief.", input=ASK, max_output_tokens=24,
                                          temperature=0.0, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_function_call_goes_out_and_its_output_comes_back(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=64, temperature=0.0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    follow_up = ask + [{"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
                       for c in calls] + [{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}]
    second = client.responses.create(model=MODEL, input=follow_up, tools=[WEATHER], tool_choice="none",
                                     max_output_tokens=32, temperature=0.0)
    assert second.output_text and all(item.type == "message" for item in second.output)
    streamed = list(client.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice="required",
                                            max_output_tokens=64, temperature=0.0, stream=True))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [c.arguments for c in calls]


def test_a_json_schema_format_holds_the_output_to_it(client):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}}, "required": ["colour"],
              "additionalProperties": False}
    reply = client.responses.create(model=MODEL, input=ASK, max_output_tokens=40, temperature=0.0,
                                    text={"format": {"type": "json_schema", "name": "colour", "schema": schema}})
    assert set(json.loads(reply.output_text)) == {"colour"}


@pytest.mark.parametrize("extra,field", [({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
                                         ({"max_output_tokens": 10 ** 6}, "max_output_tokens")])
def test_what_cannot_be_served_is_a_400_naming_the_responses_field(client, extra, field):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input=ASK, **extra)
    assert refused.value.body["param"] == field, refused.value.body


def test_the_route_needs_the_key_and_a_dropped_stream_stops_its_request(serve_app, client):
    r = httpx.post(serve_app["base_url"] + "/v1/responses", json={"input": ASK}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    stream = client.responses.create(model=MODEL, input=ASK, max_output_tokens=200, temperature=0.0, stream=True,
                                     extra_body={"ignore_eos": True})
    for event in stream:
        if event.type == "response.output_text.delta":
            break
    stream.close()  # the autouse fixture then waits for the replica to be idle with every block free
